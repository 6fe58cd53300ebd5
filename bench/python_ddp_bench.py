"""Step-time benchmark of PyTorch's own DistributedDataParallel, the Python
side of bench/ddp_bench.cpp: the same models, batches, optimizer and modes.

  torchrun --standalone --nproc-per-node 2 bench/python_ddp_bench.py --model mlp2m --mode ddp

Prints one JSON line (rank 0): per-step times in ms after warm-up.
"""
import argparse
import json
import math
import os
import sys
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class Mlp(torch.nn.Module):
    def __init__(self, widths):
        super().__init__()
        self.layers = []
        for i in range(len(widths) - 1):
            layer = torch.nn.Linear(widths[i], widths[i + 1])
            self.add_module(f"fc{i + 1}", layer)
            self.layers.append(layer)

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.relu(x)
        return x


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x, causal_mask):
        b, t, d = x.shape
        hd = d // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, 2)
        q, k, v = (y.view(b, t, self.heads, hd).transpose(1, 2) for y in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
        scores = scores.masked_fill(causal_mask, float("-inf"))
        attended = torch.matmul(torch.softmax(scores, -1), v).transpose(1, 2).reshape(b, t, d)
        h = x + self.proj(attended)
        return h + self.fc2(F.gelu(self.fc1(self.ln2(h))))


class Transformer(torch.nn.Module):
    def __init__(self, vocab, context, d, heads, layers):
        super().__init__()
        self.token = torch.nn.Embedding(vocab, d)
        self.position = torch.nn.Embedding(context, d)
        self.blocks = []
        for i in range(layers):
            block = Block(d, heads)
            self.add_module(f"block{i}", block)
            self.blocks.append(block)
        self.ln = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab)

    def forward(self, tokens):
        t = tokens.shape[1]
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        x = self.token(tokens) + self.position(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln(x))


def register_comm_hook(model, args):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    if args.comm_hook == "fp16":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.comm_hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif args.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=2)
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="mlp2m", choices=["wine", "mlp2m", "transformer"])
    parser.add_argument("--mode", default="ddp", choices=["ddp", "bucket-view", "local"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=0)
    # None: PyTorch's default (25 MB, and a 1 MB first bucket); a value also sets the first bucket.
    parser.add_argument("--bucket-cap-mb", type=float, default=None)
    parser.add_argument("--comm-hook", default="allreduce", choices=["allreduce", "fp16", "bf16", "powersgd"],
                        help="as ddp_bench's: powersgd starts after 2 plain steps")
    parser.add_argument("--powersgd-rank", type=int, default=4)
    parser.add_argument("--optimizer-in-backward", action="store_true",
                        help="Adam steps each bucket as its all-reduce completes (DDP._register_fused_optim): "
                             "ddp_bench's --step-in-backward")
    args = parser.parse_args()

    torch.set_num_threads(1)
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    if args.model in ("wine", "mlp2m"):
        wine = args.model == "wine"
        batch = args.batch or (32 if wine else 64)
        widths = [13, 64, 3] if wine else [512, 1024, 1024, 512, 10]
        model = Mlp(widths)
        x = torch.randn(batch, widths[0], generator=generator)
        y = torch.randint(0, widths[-1], (batch,), generator=generator)

        def loss_of(forward):
            return F.cross_entropy(forward(x), y)
    else:
        batch = args.batch or 8
        vocab, context = 2048, 32
        model = Transformer(vocab, context, 256, 4, 12)
        tokens = torch.randint(0, vocab, (batch, context), generator=generator)
        targets = torch.randint(0, vocab, (batch * context,), generator=generator)

        def loss_of(forward):
            return F.cross_entropy(forward(tokens).view(-1, vocab), targets)

    world, rank = 1, 0
    forward = model
    buckets = None
    if args.mode != "local":
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
        forward = DistributedDataParallel(model, gradient_as_bucket_view=args.mode == "bucket-view",
                                          bucket_cap_mb=args.bucket_cap_mb)
        register_comm_hook(forward, args)
        if args.optimizer_in_backward:
            forward._register_fused_optim(torch.optim.Adam, lr=1e-3)
    # With --optimizer-in-backward DDP steps (and clears the gradients) itself.
    optimizer = None if args.optimizer_in_backward else torch.optim.Adam(forward.parameters(), lr=1e-3)

    times = []
    for step in range(args.warmup + args.steps):
        start = time.perf_counter()
        if optimizer:
            optimizer.zero_grad()
        loss = loss_of(forward)
        loss.backward()
        if optimizer:
            optimizer.step()
        ms = (time.perf_counter() - start) * 1000
        if step >= args.warmup:
            times.append(ms)

    if rank == 0:
        median = statistics.median(times)
        parameters = sum(p.numel() for p in model.parameters())
        print(json.dumps({
            "impl": "python", "model": args.model, "mode": args.mode, "world": world,
            "batch_per_rank": batch, "parameters": parameters,
            "tensors": len(list(model.parameters())), "threads": torch.get_num_threads(),
            "step_ms_median": round(median, 4), "samples_per_s": round(1000.0 * world * batch / median, 2),
            "step_ms": [round(t, 4) for t in times],
            "bucket_cap_mb": args.bucket_cap_mb, "comm_hook": args.comm_hook,
            "optimizer_in_backward": args.optimizer_in_backward,
        }), flush=True)
    if args.mode != "local":
        dist.barrier()
        # torch 2.11's gloo teardown occasionally aborts a rank here
        # ("terminate called without an active exception") after all work is
        # done; leave without running destructors so the run's result stands.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
