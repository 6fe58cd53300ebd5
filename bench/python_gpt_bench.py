"""The Python twin of bench/gpt_bench.cpp: the same GPT-2-style decoder
(module names, registration order, init, synthetic data, AdamW, bf16
autocast on CUDA, timing) with torch.nn.parallel.DistributedDataParallel.

  torchrun --standalone --nproc-per-node 1 bench/python_gpt_bench.py --mode ddp
  python bench/python_gpt_bench.py --mode local
  python bench/python_gpt_bench.py --device cpu --layers 2 --d-model 64 --heads 2 --seq 32 --vocab 256 --steps 2

Prints one JSON line (rank 0) with the same fields as gpt_bench.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel


class Attention(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.c_attn = torch.nn.Linear(d, 3 * d)
        self.c_proj = torch.nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(x).split(d, 2)
        q, k, v = (y.view(b, t, self.heads, d // self.heads).transpose(1, 2) for y in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, d))


class Mlp(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.c_fc = torch.nn.Linear(d, 4 * d)
        self.c_proj = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(torch.nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln_2 = torch.nn.LayerNorm(d)
        self.mlp = Mlp(d)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(torch.nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tied = not a.untied
        self.wte = torch.nn.Embedding(a.vocab, a.d_model)
        self.wpe = torch.nn.Embedding(a.seq, a.d_model)
        self.h = torch.nn.ModuleList(Block(a.d_model, a.heads) for _ in range(a.layers))
        self.ln_f = torch.nn.LayerNorm(a.d_model)
        if not self.tied:
            self.lm_head = torch.nn.Linear(a.d_model, a.vocab, bias=False)

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return F.linear(x, self.wte.weight) if self.tied else self.lm_head(x)


def init_weights(model, a):
    """GPT-2's init in registration order from one seeded CPU generator, as gpt_bench.cpp."""
    generator = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name:
                p.zero_() if name.endswith("bias") else p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                std = 0.02 / math.sqrt(2.0 * a.layers) if "c_proj.weight" in name else 0.02
                p.normal_(0.0, std, generator=generator)


def device_for_rank(a, local_rank):
    """cuda:<local rank> when CUDA is available, as ddp::init_device."""
    if a.device == "cpu" or (a.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        sys.exit("error: CUDA was asked for, but no CUDA device is visible")
    count = torch.cuda.device_count()
    if local_rank >= count and not a.share_devices:
        sys.exit(f"error: local rank {local_rank} has no GPU of its own: only {count} visible; "
                 "pass --share-devices")
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    return device


def main():
    p = argparse.ArgumentParser(formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--mode", default="ddp", choices=["ddp", "local"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--share-devices", action="store_true", help="let ranks share GPUs (gloo only)")
    p.add_argument("--amp", default="auto", choices=["auto", "bf16", "off"])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--untied", action="store_true")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--peak-tflops", type=float, default=989.5)
    # gpt_bench's C++ AdamW updates one parameter at a time; "loop" does the
    # same, so the comparison measures DDP and not the optimizer.
    p.add_argument("--optimizer-impl", default="loop", choices=["loop", "foreach", "fused"])
    a = p.parse_args()

    if a.threads > 0:
        torch.set_num_threads(a.threads)
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = device_for_rank(a, local_rank)
    amp = a.amp == "bf16" or (a.amp == "auto" and device.type == "cuda")

    # In local mode under a launcher every process trains alone; all count.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = "none"
    if a.mode == "ddp":
        backend = a.backend if a.backend != "auto" else ("nccl" if device.type == "cuda" else "gloo")
        dist.init_process_group(backend, device_id=device if backend == "nccl" else None)
        world, rank = dist.get_world_size(), dist.get_rank()

    model = Gpt(a)
    init_weights(model, a)
    model.to(device)
    parameters = sum(p.numel() for p in model.parameters())

    generator = torch.Generator().manual_seed(a.seed + 1 + rank)
    tokens = torch.randint(0, a.vocab, (a.batch, a.seq + 1), generator=generator).to(device)
    inputs = tokens[:, :a.seq].contiguous()
    targets = tokens[:, 1:].reshape(-1)

    forward = DistributedDataParallel(model) if a.mode == "ddp" else model
    impl = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[a.optimizer_impl]
    optimizer = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.95), weight_decay=0.1, **impl)

    times, losses = [], []
    for step in range(a.warmup + a.steps):
        start = time.perf_counter()
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(forward(inputs).view(-1, a.vocab), targets)
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ms = (time.perf_counter() - start) * 1000
        if step >= a.warmup:
            times.append(ms)
        losses.append(loss.detach())

    if rank == 0:
        step_ms = statistics.median(times)
        tokens_per_s = 1000.0 * world * a.batch * a.seq / step_ms
        flops_per_token = 6.0 * parameters + 12.0 * a.layers * a.d_model * a.seq
        gpus = min(world, torch.cuda.device_count()) if device.type == "cuda" else 0
        mfu = flops_per_token * tokens_per_s / (gpus * a.peak_tflops * 1e12) if gpus else None
        print(json.dumps({
            "impl": "python", "bench": "gpt", "mode": a.mode, "world": world, "device": str(device),
            "backend": backend, "amp": "bf16" if amp else "off", "layers": a.layers, "d_model": a.d_model,
            "heads": a.heads, "vocab": a.vocab, "seq": a.seq, "batch_per_rank": a.batch, "tied": not a.untied,
            "parameters": parameters, "steps": a.steps, "warmup": a.warmup, "step_ms_median": round(step_ms, 4),
            "tokens_per_s": round(tokens_per_s, 1), "flops_per_token": flops_per_token,
            "flops_formula": "6*parameters + 12*layers*d_model*seq", "gpus": gpus,
            "peak_tflops_per_gpu": a.peak_tflops, "mfu": mfu, "optimizer_impl": a.optimizer_impl,
            "loss_first": round(losses[0].item(), 6), "loss_last": round(losses[-1].item(), 6),
            "step_ms": [round(t, 4) for t in times],
        }), flush=True)
    if a.mode == "ddp":
        dist.barrier()
        # As in python_ddp_bench.py: torch 2.11's gloo teardown occasionally
        # aborts a finished rank; leave without destructors.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
