"""PyTorch's FSDP2 (fully_shard) on the model bench/memory_bench.cpp builds,
measured the same way: one unit per Linear layer, Adam (lr 1e-4), batch 8 of
cross-entropy, gloo, one intra-op thread, and the process's peak resident
memory over the steps (VmHWM reset once the model and optimizer exist) next
to its resident memory before the model was built. Prints one JSON line per
rank with memory_bench's field names. Run under torchrun:

  MALLOC_MMAP_THRESHOLD_=1048576 python -m torch.distributed.run --standalone --nproc-per-node 2 \\
      bench/python_fsdp_memory_bench.py --width 1024 --layers 32 --steps 5

bench/run_fsdp2_memory_compare.py runs it and memory_bench side by side.
"""
import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


def status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def reset_peak_rss():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    rss_before_model = status_bytes("VmRSS")
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)])
    for layer in net:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    construction_peak_rss = status_bytes("VmHWM")
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(rank)
    x = torch.randn(8, args.width, generator=generator)
    y = torch.randint(0, args.width, (8,), generator=generator)
    reset_peak_rss()
    step_ms = []
    for step in range(args.steps):
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optimizer.step()
        if step > 0:
            step_ms.append((time.perf_counter() - start) * 1000)
    training_peak_rss = status_bytes("VmHWM")
    print(json.dumps({
        "strategy": "fsdp2-python",
        "world": world,
        "rank": rank,
        "parameters": sum(p.numel() for p in net.parameters()),
        "rss_before_model_bytes": rss_before_model,
        "construction_peak_rss_bytes": construction_peak_rss,
        "training_peak_rss_bytes": training_peak_rss,
        "step_ms": round(statistics.median(step_ms), 1) if step_ms else 0.0,
        "torch": torch.__version__,
    }), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
