"""Prints what Python's DistributedSampler yields for a grid of arguments.

One line per case: "size replicas rank shuffle seed drop_last epoch: i i i ...".
The C++ test compares ddp::distributed_sampler_indices against every line.
"""
import torch
from torch.utils.data.distributed import DistributedSampler

for size in (1, 2, 7, 10, 13, 100, 101):
    for replicas in (1, 2, 3, 4):
        for shuffle in (False, True):
            for drop_last in (False, True):
                for seed in (0, 42):
                    for epoch in (0, 1, 5):
                        for rank in range(replicas):
                            s = DistributedSampler(range(size), num_replicas=replicas, rank=rank,
                                                   shuffle=shuffle, seed=seed, drop_last=drop_last)
                            s.set_epoch(epoch)
                            indices = " ".join(str(i) for i in s)
                            print(f"{size} {replicas} {rank} {int(shuffle)} {seed} {int(drop_last)} {epoch}: {indices}")
