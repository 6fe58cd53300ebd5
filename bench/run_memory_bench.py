"""Per-rank memory of DDP and ZeRO-1 at 1, 2 and 4 ranks, measured side by
side, with the ZeRO paper's per-rank model-state formulas projected to 8 and
64 ranks. Writes bench/MEMORY.md and bench/memory.json.

  python bench/run_memory_bench.py --build-dir build

FullyShardedDataParallel (ZeRO-2/3) is not implemented yet; its columns are
the formula alone.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1024 * 1024


def run(build_dir, strategy, world):
    cmd = [os.path.join(build_dir, "bin", "ddprun"), "--standalone", "--nproc-per-node", str(world),
           os.path.join(build_dir, "bin", "memory_bench"), "--strategy", strategy]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         timeout=900)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(line.split("]: ", 1)[-1]) for line in out.stdout.splitlines() if '"strategy"' in line]
    worst = {k: max(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
    worst["strategy"] = strategy
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    args = parser.parse_args()
    results = []
    for world in (1, 2, 4):
        for strategy in ("ddp", "zero1"):
            r = run(os.path.abspath(args.build_dir), strategy, world)
            results.append(r)
            print(f"{strategy} x{world}: optimizer {r['optimizer_bytes'] / MiB:.0f} MiB, "
                  f"peak {r['peak_rss_bytes'] / MiB:.0f} MiB", file=sys.stderr)
    psi = results[0]["parameters"]
    with open(os.path.join(HERE, "memory.json"), "w") as f:
        json.dump({"date": datetime.datetime.now().isoformat(timespec="seconds"), "runs": results}, f, indent=1)

    lines = [
        "# Memory per rank: DDP against ZeRO-1",
        "",
        f"Measured {datetime.datetime.now().isoformat(timespec='seconds')}: an MLP of 8 Linear(2560, 2560) layers "
        f"({psi:,} parameters, fp32), Adam, batch 8 per rank, gloo, one thread per rank, 3 steps. The largest "
        "value over the ranks; `bucket` is DDP's communication buffers (a second copy of the gradients unless "
        "`gradient_as_bucket_view`). Reproduce: `python bench/run_memory_bench.py`.",
        "",
        "| ranks | strategy | parameters MiB | gradients MiB | buckets MiB | optimizer MiB | model states MiB | peak RSS MiB | step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        states = r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]
        lines.append(f"| {r['world']} | {r['strategy']} | {r['param_bytes'] / MiB:.0f} | {r['grad_bytes'] / MiB:.0f} | "
                     f"{r['bucket_bytes'] / MiB:.0f} | {r['optimizer_bytes'] / MiB:.0f} | {states / MiB:.0f} | "
                     f"{r['peak_rss_bytes'] / MiB:.0f} | {r['last_step_ms']:.0f} |")
    ddp2 = next(r for r in results if r["world"] == 2 and r["strategy"] == "ddp")
    zero2 = next(r for r in results if r["world"] == 2 and r["strategy"] == "zero1")
    lines += [
        "",
        f"ZeRO-1 step time at 2 ranks: {zero2['last_step_ms'] / ddp2['last_step_ms']:.2f}x DDP's.",
        "",
        "## Projection (the ZeRO paper's model-state formulas, fp32 Adam: 4 bytes of weights, 4 of gradients and "
        "8 of optimizer state per parameter)",
        "",
        "| ranks | DDP 16Ψ | ZeRO-1 (8 + 8/N)Ψ | ZeRO-2 (4 + 12/N)Ψ | ZeRO-3 / FSDP FULL_SHARD 16Ψ/N | ZeRO-1 measured |",
        "|---|---|---|---|---|---|",
    ]
    measured = {r["world"]: r for r in results if r["strategy"] == "zero1"}
    for n in (1, 2, 4, 8, 64):
        def gib(bytes_per_param):
            return f"{bytes_per_param * psi / MiB:.0f} MiB"
        m = measured.get(n)
        got = f"{(m['param_bytes'] + m['grad_bytes'] + m['optimizer_bytes']) / MiB:.0f} MiB" if m else "-"
        lines.append(f"| {n} | {gib(16)} | {gib(8 + 8 / n)} | {gib(4 + 12 / n)} | {gib(16 / n)} | {got} |")
    lines += ["", "FullyShardedDataParallel is not implemented yet, so its columns are projections only."]
    with open(os.path.join(HERE, "MEMORY.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
