"""DDP's static_graph in the network-bound regime: 2 emulated nodes x 1 rank
(bench/emulated_cluster.py) on a tbf-limited link, DDP without
find_unused_parameters, with it, and with it plus static_graph, side by side
in interleaved rounds (bench/hsdp_bench.cpp's ddp, ddp-unused, ddp-static).

    sudo python bench/run_static_graph_bench.py --build-dir build   # root: namespaces

Prints a markdown table of median step times; bench/PROFILE.md records it.
"""
import argparse
import os
import statistics

from emulated_cluster import EmulatedCluster
from run_hsdp_bench import run_once

HERE = os.path.dirname(os.path.abspath(__file__))
STRATEGIES = ["ddp", "ddp-unused", "ddp-static"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(os.path.dirname(HERE), "build"))
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_args = ["--width", str(args.width), "--layers", str(args.layers)]
    ms = {s: [] for s in STRATEGIES}
    port = 29700
    with EmulatedCluster(nodes=2, rate=args.rate) as cluster:
        for _ in range(args.rounds):
            for strategy in STRATEGIES:
                port += 1
                r = run_once(cluster, args.build_dir, strategy, port, model_args, args.steps, 2, nproc=1)
                ms[strategy].append(r["ms_per_step_median"])
                print(strategy, r, flush=True)
    base = statistics.median(ms["ddp-unused"])
    print(f"| strategy | ms per step (median of {args.rounds} rounds' medians) | / find_unused without static_graph |")
    print("|---|---|---|")
    for strategy in STRATEGIES:
        m = statistics.median(ms[strategy])
        print(f"| {strategy} | {m:.1f} | {m / base:.3f} |")


if __name__ == "__main__":
    main()
