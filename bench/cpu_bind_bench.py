"""ddp's C++ DDP at 2 ranks under ddprun, workers pinned (--cpu-bind cores) against unpinned,
side by side in one run; writes its section of bench/RESULTS.md (between markers, which
run_bench.py keeps).

  python bench/cpu_bind_bench.py --build-dir build   # --quick for a smoke test

Rounds interleave the two sides so both see the same machine state; medians are over all
measured steps of all rounds. Both sides run one intra-op thread per rank (ddp_bench sets it).
"""
import argparse
import datetime
import os
import statistics
import sys

from run_bench import HERE, ROOT, machine, run_json, write_results_section

BEGIN = "<!-- cpu binding: begin (bench/cpu_bind_bench.py) -->"
END = "<!-- cpu binding: end -->"
MODELS = {
    # name: (steps, warmup, rounds, description)
    "wine": (300, 30, 5, "(a) Wine MLP 13-64-3, batch 32 per rank"),
    "mlp2m": (40, 5, 5, "(b) MLP 512-1024-1024-512-10 (2.1M parameters), batch 64 per rank"),
}
SIDES = {"unpinned": [], "pinned": ["--cpu-bind", "cores"]}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (smoke test)")
    args = parser.parse_args()
    bin_dir = os.path.join(os.path.abspath(args.build_dir), "bin")
    ddprun = [os.path.join(bin_dir, "ddprun"), "--standalone", "--nproc-per-node", "2"]
    bench = os.path.join(bin_dir, "ddp_bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    load_before = os.getloadavg()[0]

    medians = {}
    for model, (steps, warmup, rounds, _) in MODELS.items():
        if args.quick:
            steps, warmup, rounds = max(3, steps // 10), 1, 1
        samples = {side: [] for side in SIDES}
        for round_index in range(rounds):
            for side, flags in SIDES.items():
                command = ddprun + flags + [bench, "--model", model, "--mode", "ddp", "--steps", str(steps),
                                            "--warmup", str(warmup)]
                result = run_json(command, env)
                samples[side].extend(result["step_ms"])
                print(f"{model} round {round_index + 1}/{rounds} {side}: {result['step_ms_median']:.3f} ms",
                      file=sys.stderr, flush=True)
        medians[model] = {side: statistics.median(values) for side, values in samples.items()}
        medians[model]["steps"] = len(samples["pinned"])

    load_after = os.getloadavg()[0]
    m = machine()
    lines = [
        "### Pinned against unpinned workers (ddprun --cpu-bind cores)",
        "",
        f"{datetime.date.today().isoformat()}, {m['cpu']}, {m['cores']} cores, 2 ranks, gloo, one intra-op thread "
        f"per rank; load average {load_before:.2f} before the run, {load_after:.2f} after. Median step time over all "
        f"measured steps of "
        f"{1 if args.quick else MODELS['wine'][2]} interleaved rounds per side.",
        "",
        "| model | unpinned ms | pinned ms | pinned / unpinned |",
        "|---|---|---|---|",
    ]
    for model, (_, _, _, description) in MODELS.items():
        med = medians[model]
        lines.append(f"| {description} | {med['unpinned']:.3f} | {med['pinned']:.3f} | "
                     f"{med['pinned'] / med['unpinned']:.2f} |")
    lines += [
        "",
        "Pinned: each rank on its own contiguous share of ddprun's CPUs, as `--cpu-bind cores` cuts them. "
        "Command: `python bench/cpu_bind_bench.py --build-dir build`, which runs "
        "`ddprun --standalone --nproc-per-node 2 [--cpu-bind cores] build/bin/ddp_bench --model MODEL --mode ddp`.",
    ]
    if max(load_before, load_after) > m["cores"] / 2:
        lines += ["", "The machine was busy during this run (load average above half its cores): other processes "
                      "competed for the cores, so this measures pinning under contention, where a pinned rank cannot "
                      "move to an idle core. Rerun on a quiet machine for the pinning alone."]
    write_results_section(BEGIN, END, "\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
