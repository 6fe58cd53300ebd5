"""Step time of two builds of ddp side by side: DDP (ddp_bench, the three
models of run_bench.py) and FSDP (memory_bench, FULL_SHARD and SHARD_GRAD_OP),
each against PyTorch's own Python DDP on the same model, 2 ranks, gloo, one
intra-op thread per rank. Runs alternate (before, after, Python) round by
round, so a change in the machine's load hits all three alike; medians.

  # a copy of an older build's bin/ and lib/:
  cp -a build/bin build/lib /tmp/before/
  ... change and rebuild ...
  python bench/compare_builds.py --before /tmp/before --after build --label "issue 16"

The older binaries run against their own libddp.so through LD_LIBRARY_PATH
(which ld.so searches before a binary's RUNPATH). Writes bench/COMPARE.md and
bench/compare.json.
"""
import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DDP_MODELS = {"wine": (300, 30), "mlp2m": (40, 5), "transformer": (12, 3)}  # steps, warmup
FSDP_STRATEGIES = ("fsdp-full", "fsdp-grad-op")


def json_lines(command, env):
    out = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        sys.exit(f"failed ({out.returncode}): {' '.join(command)}\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(line.split("]: ", 1)[-1]) for line in out.stdout.splitlines()
            if line.split("]: ", 1)[-1].startswith("{")]
    if not rows:
        sys.exit(f"no result from: {' '.join(command)}\n{out.stdout}\n{out.stderr}")
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", required=True, help="directory with the older build's bin/ and lib/")
    parser.add_argument("--after", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--label", default="")
    args = parser.parse_args()
    before, after = os.path.abspath(args.before), os.path.abspath(args.after)
    ddprun = [os.path.join(after, "bin", "ddprun"), "--standalone", "--nproc-per-node", "2"]
    torchrun = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    base_env = dict(os.environ, OMP_NUM_THREADS="1")
    builds = {
        "before": (before, dict(base_env, LD_LIBRARY_PATH=os.path.join(before, "lib"))),
        "after": (after, dict(base_env, LD_LIBRARY_PATH=os.path.join(after, "lib"))),
    }

    samples = {}
    for round_index in range(args.rounds):
        for model, (steps, warmup) in DDP_MODELS.items():
            for name, (build, env) in builds.items():
                rows = json_lines(ddprun + [os.path.join(build, "bin", "ddp_bench"), "--model", model, "--mode", "ddp",
                                            "--steps", str(steps), "--warmup", str(warmup)], env)
                samples.setdefault(f"ddp {model} {name}", []).extend(rows[0]["step_ms"])
            rows = json_lines(torchrun + [os.path.join(HERE, "python_ddp_bench.py"), "--model", model, "--mode", "ddp",
                                          "--steps", str(steps), "--warmup", str(warmup)], base_env)
            samples.setdefault(f"ddp {model} python", []).extend(rows[0]["step_ms"])
        for strategy in FSDP_STRATEGIES:
            for name, (build, env) in builds.items():
                rows = json_lines(ddprun + [os.path.join(build, "bin", "memory_bench"), "--strategy", strategy], env)
                # The slowest rank's median step, as run_memory_bench.py reports it.
                samples.setdefault(f"{strategy} {name}", []).append(max(r["step_ms"] for r in rows))
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    med = {key: statistics.median(values) for key, values in samples.items()}
    date = datetime.datetime.now().isoformat(timespec="seconds")
    with open(os.path.join(HERE, "compare.json"), "w") as f:
        json.dump({"date": date, "label": args.label, "rounds": args.rounds, "median_ms": med, "samples": samples}, f,
                  indent=1)
    lines = [
        f"# Step time before and after{(' ' + args.label) if args.label else ''}",
        "",
        f"Measured {date} on this machine ({os.cpu_count()} cores), 2 ranks, gloo, one intra-op thread per rank, "
        f"{args.rounds} rounds alternating the two builds and Python. Reproduce: "
        f"`python bench/compare_builds.py --before DIR --after build` (see the script's docstring).",
        "",
        "## DDP (`ddp_bench --mode ddp`; Python: `python_ddp_bench.py --mode ddp`), median step ms",
        "",
        "| model | before | after | after / before | Python DDP | before / Python | after / Python |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in DDP_MODELS:
        b, a, p = (med[f"ddp {model} {k}"] for k in ("before", "after", "python"))
        lines.append(f"| {model} | {b:.3f} | {a:.3f} | {a / b:.2f} | {p:.3f} | {b / p:.2f} | {a / p:.2f} |")
    lines += [
        "",
        "## FSDP (`memory_bench --strategy S`: 8 x Linear(2560, 2560), Adam, batch 8 per rank), median of the runs' "
        "slowest-rank median step, ms",
        "",
        "| strategy | before | after | after / before |",
        "|---|---|---|---|",
    ]
    for strategy in FSDP_STRATEGIES:
        b, a = med[f"{strategy} before"], med[f"{strategy} after"]
        lines.append(f"| {strategy} | {b:.0f} | {a:.0f} | {a / b:.2f} |")
    with open(os.path.join(HERE, "COMPARE.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
