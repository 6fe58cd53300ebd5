"""Per-rank memory and step time of DDP, ZeRO-1 and FSDP (FULL_SHARD and
SHARD_GRAD_OP) at 1, 2 and 4 ranks, measured side by side, with the ZeRO
paper's per-rank model-state formulas projected to 8 and 64 ranks, and the
cost of Gloo's reduce-scatter and all-gather against our ring versions, and
FULL_SHARD with bf16 parameters (FSDPOptions::param_dtype) at 2 and 4 ranks.
Writes bench/MEMORY.md, bench/memory.json and the memory section of
bench/RESULTS.md.

  python bench/run_memory_bench.py --build-dir build
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
MiB = 1024 * 1024


STRATEGIES = ("ddp", "zero1", "fsdp-full", "fsdp-grad-op")
# Extra runs: label -> (strategy, memory_bench flags), at MIXED_WORLDS ranks.
MIXED = {"fsdp-full-bf16": ("fsdp-full", ["--param-dtype", "bf16"])}
MIXED_WORLDS = (2, 4)
RESULTS_BEGIN = "<!-- memory benchmark: begin (bench/run_memory_bench.py) -->"
RESULTS_END = "<!-- memory benchmark: end -->"


def run(build_dir, strategy, world, flags=(), label=None):
    cmd = [os.path.join(build_dir, "bin", "ddprun"), "--standalone", "--nproc-per-node", str(world),
           os.path.join(build_dir, "bin", "memory_bench"), "--strategy", strategy, *flags]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         timeout=900)
    if out.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{out.stdout}\n{out.stderr}")
    rows = [json.loads(line.split("]: ", 1)[-1]) for line in out.stdout.splitlines() if '"strategy"' in line]
    if strategy == "collectives":
        return {k: (statistics.median(r[k] for r in rows) if k.endswith("_ms") else rows[0][k]) for k in rows[0]}
    worst = {k: max(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
    worst["strategy"] = label or strategy
    return worst


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--render-only", action="store_true", help="rewrite MEMORY.md from memory.json")
    args = parser.parse_args()
    if args.render_only:
        with open(os.path.join(HERE, "memory.json")) as f:
            saved = json.load(f)
        lines = render(saved["runs"], saved["collectives"], saved["date"])
        write_memory_md(lines)
        update_results_md(lines)
        return
    build_dir = os.path.abspath(args.build_dir)
    results = []
    for world in (1, 2, 4):
        for strategy in STRATEGIES:
            r = run(build_dir, strategy, world)
            results.append(r)
            print(f"{strategy} x{world}: model states {states_of(r) / MiB:.0f} MiB, "
                  f"peak {r['peak_rss_bytes'] / MiB:.0f} MiB, step {r['step_ms']:.0f} ms", file=sys.stderr)
    for world in MIXED_WORLDS:
        for label, (strategy, flags) in MIXED.items():
            r = run(build_dir, strategy, world, flags, label)
            results.append(r)
            print(f"{label} x{world}: parameters {r['param_bytes'] / MiB:.0f} MiB, "
                  f"peak parameters {r['peak_param_bytes'] / MiB:.0f} MiB, step {r['step_ms']:.0f} ms", file=sys.stderr)
    collectives = [run(build_dir, "collectives", world) for world in (2, 4)]
    date = datetime.datetime.now().isoformat(timespec="seconds")
    with open(os.path.join(HERE, "memory.json"), "w") as f:
        json.dump({"date": date, "runs": results, "collectives": collectives}, f, indent=1)
    lines = render(results, collectives, date)
    write_memory_md(lines)
    update_results_md(lines)
    print("\n".join(lines))


def states_of(r):
    return r["param_bytes"] + r["grad_bytes"] + r["optimizer_bytes"]


KEPT_MARKER = "<!-- Below: notes written by hand, kept as they are by bench/run_memory_bench.py -->"


def write_memory_md(lines):
    """MEMORY.md is the rendered tables, then whatever follows KEPT_MARKER in
    the current file (measurements and notes that are not re-run)."""
    path = os.path.join(HERE, "MEMORY.md")
    kept = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
        if KEPT_MARKER in text:
            kept = text[text.index(KEPT_MARKER):]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
        if kept:
            f.write("\n" + kept)


def render(results, collectives, date):
    psi = results[0]["parameters"]
    find = {(r["world"], r["strategy"]): r for r in results}
    lines = [
        "# Memory per rank: DDP, ZeRO-1 and FSDP",
        "",
        f"Measured {date}: an MLP of 8 Linear(2560, 2560) layers ({psi:,} parameters, fp32), Adam, batch 8 per "
        "rank, gloo, one thread per rank, 5 steps (step time: median of the last 4). FSDP wraps each layer as a "
        "unit. Bytes are what a rank holds between steps, the largest over the ranks; `buckets` is DDP's "
        "communication buffers (a second copy of the gradients unless `gradient_as_bucket_view`), not counted in "
        "model states. Reproduce: `python bench/run_memory_bench.py`.",
        "",
        "| ranks | strategy | parameters MiB | gradients MiB | buckets MiB | optimizer MiB | model states MiB | "
        "vs DDP | peak RSS MiB | step ms | vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if r["strategy"] not in STRATEGIES:
            continue  # the mixed-precision runs have a section of their own
        ddp = find[(r["world"], "ddp")]
        lines.append(f"| {r['world']} | {r['strategy']} | {r['param_bytes'] / MiB:.0f} | {r['grad_bytes'] / MiB:.0f} | "
                     f"{r['bucket_bytes'] / MiB:.0f} | {r['optimizer_bytes'] / MiB:.0f} | {states_of(r) / MiB:.0f} | "
                     f"{states_of(r) / states_of(ddp):.3f} | {r['peak_rss_bytes'] / MiB:.0f} | {r['step_ms']:.0f} | "
                     f"{r['step_ms'] / ddp['step_ms']:.2f} |")
    lines += ["", "Goals (issue 5):", ""]
    for n in (2, 4):
        full = find[(n, "fsdp-full")]
        ratio = states_of(full) / states_of(find[(n, "ddp")])
        goal = 1 / n + 0.05
        lines.append(f"- FULL_SHARD model states at {n} ranks: {ratio:.3f} of DDP's; goal <= {goal:.2f}: "
                     f"{'met' if ratio <= goal else 'missed'}.")
    step = find[(2, "fsdp-full")]["step_ms"] / find[(2, "ddp")]["step_ms"]
    lines.append(f"- FULL_SHARD step time at 2 ranks: {step:.2f}x DDP's; goal <= 1.5x: {'met' if step <= 1.5 else 'missed'}. "
                 f"SHARD_GRAD_OP: {find[(2, 'fsdp-grad-op')]['step_ms'] / find[(2, 'ddp')]['step_ms']:.2f}x; "
                 f"ZeRO-1: {find[(2, 'zero1')]['step_ms'] / find[(2, 'ddp')]['step_ms']:.2f}x.")
    lines += [
        "",
        "FSDP's steps are not slower than DDP's here although it communicates half as much again (two "
        "all-gathers and a reduce-scatter per layer against one all-reduce): on this machine the step is "
        "dominated by Adam, which FSDP runs only on this rank's shard (1/N of the elements), and DDP also copies "
        "every gradient into and out of its buckets. With more compute per parameter (larger batches, GPUs) the "
        "extra communication shows.",
        "",
        "Peak RSS also counts what every strategy holds transiently (the autograd graph, a unit's gathered "
        "parameters and full gradients while it runs, the allocator's cache) and torch itself (~300 MiB), so it "
        "shrinks less than model states do.",
    ]
    lines += render_mixed(find)
    lines += [
        "",
        "## Gloo's collectives against ring versions built from send/recv",
        "",
        "One layer's worth of floats (reduce-scatter input and all-gather output of "
        f"{collectives[0]['numel']:,} elements), median of 11, the slowest rank. FSDP on Gloo uses the rings "
        "(`src/comm/ring_collectives.h`); with NCCL it uses NCCL's own.",
        "",
        "| ranks | all-reduce ms | Gloo reduce-scatter ms | ring reduce-scatter ms | Gloo all-gather ms | ring all-gather ms |",
        "|---|---|---|---|---|---|",
    ]
    for c in collectives:
        lines.append(f"| {c['world']} | {c['all_reduce_ms']:.1f} | {c['reduce_scatter_ms']:.1f} | "
                     f"{c['ring_reduce_scatter_ms']:.1f} | {c['all_gather_ms']:.1f} | {c['ring_all_gather_ms']:.1f} |")
    lines += [
        "",
        "## Projection (the ZeRO paper's model-state formulas, fp32 Adam: 4 bytes of weights, 4 of gradients and "
        "8 of optimizer state per parameter)",
        "",
        "| ranks | DDP 16Ψ | ZeRO-1 (8 + 8/N)Ψ | ZeRO-2 (4 + 12/N)Ψ | ZeRO-3 / FSDP FULL_SHARD 16Ψ/N | "
        "measured ZeRO-1 | measured FULL_SHARD |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in (1, 2, 4, 8, 64):
        def mib(bytes_per_param):
            return f"{bytes_per_param * psi / MiB:.0f} MiB"

        def got(strategy):
            m = find.get((n, strategy))
            return f"{states_of(m) / MiB:.0f} MiB" if m else "not measured (2 cores)"
        lines.append(f"| {n} | {mib(16)} | {mib(8 + 8 / n)} | {mib(4 + 12 / n)} | {mib(16 / n)} | {got('zero1')} | "
                     f"{got('fsdp-full')} |")
    lines += [
        "",
        "SHARD_GRAD_OP here holds what FULL_SHARD does between steps (16Ψ/N): our ZeRO-2 frees the gathered "
        "parameters after backward, and keeps them only from forward to backward. The paper's ZeRO-2 keeps "
        "full fp16 weights on every rank; its column is the paper's formula.",
    ]
    return lines


def render_mixed(find):
    """FULL_SHARD with bf16 parameters against float32, when memory.json has
    those runs (older ones do not: then nothing)."""
    worlds = [n for n in MIXED_WORLDS if (n, "fsdp-full-bf16") in find and (n, "fsdp-full") in find]
    if not worlds:
        return []

    def mib(r, key):
        return f"{r[key] / MiB:.0f}" if key in r else "not measured"

    lines = [
        "",
        "## Mixed precision: FULL_SHARD with bf16 parameters",
        "",
        "`memory_bench --strategy fsdp-full --param-dtype bf16`: `FSDPOptions().param_dtype(at::kBFloat16)"
        ".output_dtype(at::kFloat)`. The shards stay float32 master weights (what Adam steps), so parameters "
        "between steps do not change; each unit is cast to bfloat16 before its all-gather, so the gathered "
        "units take half the bytes and the all-gathers send half as much. Peak parameters: the most parameter "
        "bytes held at any moment during the steps (shards plus every unit gathered at once, "
        "`ShardedMemory::peak_parameter_bytes`), the largest over the ranks.",
        "",
        "| ranks | param dtype | parameters MiB between steps | peak parameters MiB | gathered at peak MiB | "
        "step ms | vs fp32 |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in worlds:
        fp32, bf16 = find[(n, "fsdp-full")], find[(n, "fsdp-full-bf16")]
        for dtype, r in (("fp32", fp32), ("bf16", bf16)):
            gathered = (f"{(r['peak_param_bytes'] - r['param_bytes']) / MiB:.0f}" if "peak_param_bytes" in r
                        else "not measured")
            lines.append(f"| {n} | {dtype} | {mib(r, 'param_bytes')} | {mib(r, 'peak_param_bytes')} | {gathered} | "
                         f"{r['step_ms']:.0f} | {r['step_ms'] / fp32['step_ms']:.2f} |")
    lines += [
        "",
        "Gathered at peak: peak parameters less parameters between steps (the shards). The step time includes "
        "the casts (float32 shard to bfloat16 before each all-gather, bfloat16 gradients to float32 for the "
        "reduce-scatter); on CPUs without native bfloat16 arithmetic the bf16 matrix multiplies can be slower "
        "than float32 ones, so only the memory columns carry over to GPUs.",
    ]
    return lines


def update_results_md(lines):
    """Puts the memory tables into bench/RESULTS.md between markers, which
    run_bench.py keeps when it rewrites the rest."""
    path = os.path.join(HERE, "RESULTS.md")
    text = open(path).read() if os.path.exists(path) else ""
    section = "\n".join([RESULTS_BEGIN, "## Memory and sharding (ZeRO-1, FSDP)", ""] +
                        ["#" + l if l.startswith("## ") else l for l in lines[1:]] + [RESULTS_END])
    if RESULTS_BEGIN in text and RESULTS_END in text:
        before = text[:text.index(RESULTS_BEGIN)]
        after = text[text.index(RESULTS_END) + len(RESULTS_END):]
        text = before + section + after
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
