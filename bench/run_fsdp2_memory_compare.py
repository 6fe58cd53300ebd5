"""Per-rank training memory of ddp's FSDP FULL_SHARD against PyTorch's FSDP2
on one model, side by side: memory_bench --strategy fsdp-full and
bench/python_fsdp_memory_bench.py, run in turn (ddp, then Python, REPEATS
times), each under the same torchrun-style launch at WORLD ranks, both with
glibc's mmap threshold at 1 MiB (MALLOC_MMAP_THRESHOLD_=1048576, so what a
tensor frees goes back at once; bench/MEMORY.md, "Deferred construction")
and one intra-op thread. A run's figure is its largest rank's peak resident
memory over the steps less its resident memory before the model was built;
the table gives the median over the runs, in MiB.

  python bench/run_fsdp2_memory_compare.py --build-dir build --width 1024 --layers 32 --repeats 5
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MiB = 1024 * 1024


def rows_of(stdout):
    rows = []
    for line in stdout.splitlines():
        line = line.split("]: ", 1)[-1]
        if line.startswith("{") and '"strategy"' in line:
            rows.append(json.loads(line))
    return rows


def run(cmd, env):
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    rows = rows_of(out.stdout)
    if not rows:
        sys.exit(f"no results from: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    training = max(r["training_peak_rss_bytes"] - r["rss_before_model_bytes"] for r in rows)
    return {"training_mib": training / MiB, "step_ms": max(r["step_ms"] for r in rows),
            "parameters": rows[0]["parameters"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", default=os.environ.get("DDP_PYTHON", sys.executable))
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="1048576")
    model = ["--width", str(args.width), "--layers", str(args.layers), "--steps", str(args.steps)]
    ours_cmd = [os.path.join(args.build_dir, "bin", "ddprun"), "--standalone", "--nproc-per-node", str(args.world),
                os.path.join(args.build_dir, "bin", "memory_bench"), "--strategy", "fsdp-full", *model]
    theirs_cmd = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.world),
                  os.path.join(HERE, "python_fsdp_memory_bench.py"), *model]
    ours, theirs = [], []
    for i in range(args.repeats):
        ours.append(run(ours_cmd, env))
        theirs.append(run(theirs_cmd, env))
        print(f"run {i + 1}: ddp {ours[-1]['training_mib']:.1f} MiB, FSDP2 {theirs[-1]['training_mib']:.1f} MiB",
              file=sys.stderr)
    params = ours[0]["parameters"]
    ours_mib = statistics.median(r["training_mib"] for r in ours)
    theirs_mib = statistics.median(r["training_mib"] for r in theirs)
    print(f"{args.layers} x Linear({args.width}, {args.width}), {params:,} parameters, Adam, {args.world} ranks, "
          f"median of {args.repeats}")
    print("| | training peak MiB (largest rank) | bytes per parameter | runs MiB | step ms |")
    print("|---|---|---|---|---|")
    for name, runs, mib in (("ddp FSDP FULL_SHARD", ours, ours_mib), ("PyTorch FSDP2", theirs, theirs_mib)):
        each = ", ".join(f"{r['training_mib']:.0f}" for r in runs)
        step = statistics.median(r["step_ms"] for r in runs)
        print(f"| {name} | {mib:.0f} | {mib * MiB / params:.2f} | {each} | {step:.0f} |")
    print(f"ddp / FSDP2: {ours_mib / theirs_mib:.3f}")


if __name__ == "__main__":
    main()
