"""PyTorch's own post-local SGD on examples/lm's task, for bench/slow_links.py:
the same byte-level transformer, corpus, split, batches and evaluation as
examples/lm/lm_train.cpp (built in the same order from the same seed, so the
initial weights are the same tensors), trained with DDP and
post_localSGD_hook for K warm-up steps, then PostLocalSGDOptimizer's
PeriodicModelAverager every H steps. Run by torchrun, one rank per node:

    torchrun --nnodes 4 --nproc-per-node 1 ... bench/python_post_local_sgd.py --steps 600 --warmup 100 --period 8 \
        --corpus DIR --metrics FILE

Writes lm_train's metrics lines (step, samples, train_loss, eval_loss, wall_s, syncs).
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import PostLocalSGDState, post_localSGD_hook
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.optim import PostLocalSGDOptimizer


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, w))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ByteLM(nn.Module):
    def __init__(self, context=64, width=128, layers=2, heads=4):
        super().__init__()
        self.bytes = nn.Embedding(256, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList([Block(width, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 256)

    def forward(self, tokens):
        x = self.bytes(tokens) + self.positions(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def load_corpus(root, max_bytes):
    """examples/lm/corpus.h's corpus: the same files in the same order."""
    python_tree = os.path.exists(os.path.join(root, "os.py"))
    paths = []
    for directory, subdirs, files in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in ("site-packages", "dist-packages", "__pycache__")
                      and not os.path.islink(os.path.join(directory, d))]
        for name in files:
            path = os.path.join(directory, name)
            if os.path.islink(path) or not os.path.isfile(path):
                continue
            if python_tree and not name.endswith(".py"):
                continue
            paths.append(path)
    paths.sort(key=lambda p: p.encode())
    data = bytearray()
    for path in paths:
        if len(data) >= max_bytes:
            break
        with open(path, "rb") as f:
            data += f.read()
    data = bytes(data[:max_bytes])
    all_bytes = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    cut = all_bytes.numel() * 9 // 10
    return all_bytes[:cut], all_bytes[cut:]


def windows(data, starts, context):
    index = starts.unsqueeze(1) + torch.arange(context + 1).unsqueeze(0)
    rows = data[index].long()
    return rows[:, :context], rows[:, 1:]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=100, help="K: steps of DDP before local SGD")
    p.add_argument("--period", type=int, default=8, help="H: steps between model averages")
    p.add_argument("--corpus", required=True)
    p.add_argument("--corpus-mb", type=int, default=4)
    p.add_argument("--metrics", default="")
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, held_out = load_corpus(args.corpus, args.corpus_mb << 20)
    torch.manual_seed(args.seed)
    model = ByteLM()
    ddp_model = nn.parallel.DistributedDataParallel(model)
    # After the warm-up every rank trains alone (a subgroup of itself), as ddp's post-local SGD.
    alone, _ = dist.new_subgroups(group_size=1)
    ddp_model.register_comm_hook(PostLocalSGDState(process_group=None, subgroup=alone,
                                                   start_localSGD_iter=args.warmup), post_localSGD_hook)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    averager = PeriodicModelAverager(period=args.period, warmup_steps=args.warmup)
    optimizer = PostLocalSGDOptimizer(optim=inner, averager=averager)

    context = 64
    eval_windows = args.eval_batches * args.batch_size
    eval_starts = torch.linspace(0, held_out.numel() - context - 2, eval_windows).long()
    generator = torch.Generator().manual_seed(args.seed * 1000003 + rank + 1)
    metrics = open(args.metrics, "w") if rank == 0 and args.metrics else None
    start = time.time()
    losses = []
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, train.numel() - context - 1, (args.batch_size,), generator=generator)
        x, y = windows(train, starts, context)
        optimizer.zero_grad()
        loss = F.cross_entropy(ddp_model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if step % args.eval_every and step != args.steps:
            continue
        if rank == 0:
            with torch.no_grad():
                total = 0.0
                for b in range(args.eval_batches):
                    ex, ey = windows(held_out, eval_starts[b * args.batch_size:(b + 1) * args.batch_size], context)
                    total += F.cross_entropy(model(ex).reshape(-1, 256), ey.reshape(-1)).item()
            # PeriodicModelAverager averages at steps K, K + H, ... (counted from 0).
            syncs = min(step, args.warmup) + max(0, math.ceil((step - args.warmup) / args.period))
            line = {"step": step, "samples": step * args.batch_size * world, "train_loss": sum(losses) / len(losses),
                    "eval_loss": total / args.eval_batches, "wall_s": time.time() - start, "syncs": syncs}
            print(f"step {step}  train {line['train_loss']:.4f}  eval {line['eval_loss']:.4f}", flush=True)
            if metrics:
                metrics.write(json.dumps(line) + "\n")
                metrics.flush()
        losses = []
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
