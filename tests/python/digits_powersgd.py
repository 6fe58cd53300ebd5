"""PyTorch's side of PowerSGD.TrainsDigits... (tests/test_powersgd.cpp): digits_ddp's
task in Python DDP with PyTorch's own powerSGD_hook, under torchrun on gloo.

usage: torchrun --nproc-per-node 2 digits_powersgd.py DIGITS_CSV_GZ EPOCHS RANK START

The same data split (a randperm seeded 42, the first 20% for testing), pixels
scaled to [0, 1], the same convnet, DistributedSampler (seed 0, set_epoch),
batch 32 per rank and Adam at 1e-3 as examples/digits. Rank 0 prints the test
accuracy and PowerSGDState.compression_stats()'s ratio.
"""

import gzip
import math
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main():
    path, epochs, rank, start = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rows = [[int(v) for v in line.split(",")] for line in gzip.open(path, "rt") if line.strip()]
    data = torch.tensor(rows)
    images = data[:, :64].float().view(-1, 1, 8, 8) / 16.0
    labels = data[:, 64].long()
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(42))
    n_test = math.ceil(0.2 * len(rows))
    test, train = order[:n_test], order[n_test:]

    dist.init_process_group("gloo")
    torch.manual_seed(42)
    model = DistributedDataParallel(ConvNet())
    state = powerSGD.PowerSGDState(process_group=None, matrix_approximation_rank=rank,
                                   start_powerSGD_iter=start, min_compression_rate=2)
    model.register_comm_hook(state, powerSGD.powerSGD_hook)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    dataset = TensorDataset(images[train], labels[train])
    sampler = DistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
    if dist.get_rank() == 0:
        with torch.no_grad():
            accuracy = (model.module(images[test]).argmax(1) == labels[test]).float().mean().item()
        ratio, before, after = state.compression_stats()
        print(f"Test accuracy: {accuracy:.4f}")
        print(f"PowerSGD compression ratio {ratio:.4f} ({after} of {before} gradient elements sent after the warm-up)")
    dist.barrier()
    # torch 2.11's gloo teardown sometimes aborts a rank after all work is
    # done ("terminate called without an active exception", seen here about
    # one run in two with the hook's futures); leave without destructors.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
