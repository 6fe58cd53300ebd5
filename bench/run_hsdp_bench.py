"""HSDP against FSDP FULL_SHARD and DDP on an emulated cluster of 2 nodes x 2
ranks (bench/emulated_cluster.py: network namespaces, links rate-limited with
tbf), side by side in one run; writes its section of bench/RESULTS.md
(between markers) and bench/hsdp.json.

    sudo python bench/run_hsdp_bench.py --build-dir build      # needs root

Each node runs ddprun (c10d rendezvous, hosted on node 0) with
bench/hsdp_bench.cpp. Step times are medians over the timed steps of every
round; bytes are what the nodes sent per step, from their interfaces'
counters. Rounds interleave the strategies so each sees the same machine.
"""
import argparse
import json
import os
import re
import statistics
import sys

from emulated_cluster import EmulatedCluster
from run_bench import write_results_section

HERE = os.path.dirname(os.path.abspath(__file__))
BEGIN = "<!-- hsdp across nodes: begin (bench/run_hsdp_bench.py) -->"
END = "<!-- hsdp across nodes: end -->"
STRATEGIES = ["ddp", "ddp-hier", "fsdp", "hsdp"]


def run_once(cluster, build_dir, strategy, port, model_args, steps, warmup, nproc=2):
    ddprun = os.path.join(build_dir, "bin", "ddprun")
    bench = os.path.join(build_dir, "bin", "hsdp_bench")
    procs = []
    for node in range(2):
        argv = [ddprun, "--nnodes", "2", "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint",
                f"{cluster.addresses[0]}:{port}", bench, "--strategy", strategy, "--steps", str(steps),
                "--warmup", str(warmup)] + model_args
        env = dict(os.environ, DDP_TIMEOUT_SECONDS="300")
        procs.append(cluster.popen(node, argv, env=env, stdout=-1, stderr=-1, text=True))
        if node == 0:
            import time
            time.sleep(1.0)  # node 0 hosts the rendezvous store
    outs = [p.communicate(timeout=900) for p in procs]
    for node, (p, (out, err)) in enumerate(zip(procs, outs)):
        if p.returncode != 0:
            sys.exit(f"{strategy}: node {node} failed ({p.returncode}):\n{out}\n{err}")
    match = re.search(r"(\{.*\"bytes_sent_per_step\".*\})", outs[0][0])
    if not match:
        sys.exit(f"{strategy}: no result on node 0:\n{outs[0][0]}\n{outs[0][1]}")
    return json.loads(match.group(1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(os.path.dirname(HERE), "build"))
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run_hsdp_bench.py creates network namespaces: run it as root")
    model_args = ["--width", str(args.width), "--layers", str(args.layers)]
    results = {}
    port = 29600
    for rate in args.rates.split(","):
        with EmulatedCluster(nodes=2, rate=rate) as cluster:
            for _ in range(args.rounds):
                for strategy in STRATEGIES:
                    port += 1
                    r = run_once(cluster, args.build_dir, strategy, port, model_args, args.steps, args.warmup)
                    entry = results.setdefault(rate, {}).setdefault(strategy, {"ms": [], "bytes": [], "model": 0})
                    entry["ms"].append(r["ms_per_step_median"])
                    entry["bytes"].append(r["bytes_sent_per_step"])
                    entry["model"] = r["model_bytes"]
                    print(rate, strategy, r, flush=True)
    with open(os.path.join(HERE, "hsdp.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)

    model_mb = next(iter(next(iter(results.values())).values()))["model"] / 1e6
    lines = [
        "## HSDP and hierarchical all-reduce across nodes (2 nodes x 2 ranks, emulated links)",
        "",
        f"{args.layers} x Linear({args.width}, {args.width}), every Linear an FSDP unit ({model_mb:.1f} MB of "
        "fp32 parameters), SGD, batch 8 per rank, gloo. Each node is a network namespace; its link to the "
        "switch is limited in both directions with tc tbf. Step time: median of each round's median; bytes: "
        "what both nodes sent per step, from the interfaces' counters (TCP/IP headers included). "
        f"{args.rounds} rounds, strategies interleaved. "
        "This machine has 2 cores for the 4 ranks, so at 10 Gbit/s the steps are bound by compute and "
        "the thread hand-offs, not by the link, and the bytes saved do not show in the time.",
        "",
        "| link | strategy | ms per step | / DDP | MB sent between nodes per step | / model size | / FULL_SHARD's |",
        "|---|---|---|---|---|---|---|",
    ]
    for rate, by_strategy in results.items():
        ddp_ms = statistics.median(by_strategy["ddp"]["ms"])
        fsdp_bytes = statistics.median(by_strategy["fsdp"]["bytes"])
        for strategy in STRATEGIES:
            e = by_strategy[strategy]
            ms = statistics.median(e["ms"])
            sent = statistics.median(e["bytes"])
            lines.append(f"| {rate} | {strategy} | {ms:.1f} | {ms / ddp_ms:.2f} | {sent / 1e6:.2f} | "
                         f"{sent / e['model']:.2f} | {sent / fsdp_bytes:.3f} |")
    lines += [
        "",
        "ddp-hier is DDP with `ddp::hierarchical_allreduce_hook` (reduce to the node's first rank, all-reduce "
        "between the two leaders, broadcast in the node). "
        "Theory for ring collectives in rank order on 2 nodes of 2 ranks (two of the four hops cross), for a "
        "model of S bytes: DDP's all-reduce sends 3 S across, ddp-hier 2 S (each leader sends S), FULL_SHARD "
        "4.5 S (two all-gathers and one "
        "reduce-scatter, 1.5 S each), HSDP 2 S (each pair of copies all-reduces an S/2 shard): HSDP / "
        "FULL_SHARD = 0.444, tested within 10% by `TwoNodesC10d.HsdpSendsTheTheoreticalShareOfFullShardsInterNodeBytes`.",
        "",
        f"Command: `sudo python bench/run_hsdp_bench.py --build-dir build --rates {args.rates} --width {args.width} "
        f"--layers {args.layers} --steps {args.steps} --rounds {args.rounds}`",
    ]
    text = "\n".join(lines)
    write_results_section(BEGIN, END, text)
    print(text)


if __name__ == "__main__":
    main()
