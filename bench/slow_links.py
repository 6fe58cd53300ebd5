"""Training over slow links: DDP against post-local SGD, DiLoCo and Streaming
DiLoCo on the emulated cluster (bench/emulated_cluster.py: network
namespaces joined by a bridge, each node's link limited with tbf in both
directions), N nodes x 1 rank, training examples/lm (a 470K-parameter
byte-level transformer on the pinned Python's standard library) for the
same number of samples with each method. Writes bench/SLOW_LINKS.md,
bench/slow_links.json and bench/SLOW_LINKS.png.

    sudo python bench/slow_links.py --build-dir build            # needs root
    sudo python bench/slow_links.py --rates 1gbit --steps 300    # quicker

Bytes on the wire are what every node's eth0 sent during the whole run
(/sys/class/net/eth0/statistics/tx_bytes, read before and after; TCP/IP
headers, the rendezvous and the start-up broadcasts included). "local"
(every replica trains alone: DiLoCo with H larger than the run) is the
compute-only reference: the same processes on the same cores with no
synchronisation, so compute utilisation = local's wall clock / a method's.
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time

from emulated_cluster import EmulatedCluster

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> (label, lm_train arguments)
METHODS = {
    "ddp": ("DDP", []),
    "ddp-powersgd": ("DDP + PowerSGD (rank 4)", ["--powersgd", "4"]),
    "post-local-sgd": ("post-local SGD (K=100, H=8)", ["--diloco", "8", "--post-local-sgd", "100"]),
    "diloco-50": ("DiLoCo H=50", ["--diloco", "50"]),
    "diloco-100": ("DiLoCo H=100", ["--diloco", "100"]),
    "diloco-500": ("DiLoCo H=500", ["--diloco", "500"]),
    # The paper starts DiLoCo from a trained model; here 100 steps of
    # gradient averaging first (DiLoCoOptions::warmup_steps).
    "diloco-100-warm": ("DiLoCo H=100 after 100 DDP-like steps", ["--diloco", "100", "--warmup", "100"]),
    "streaming": ("Streaming DiLoCo H=100, F=4, tau=5, alpha=0.5, bf16",
                  ["--diloco", "100", "--streaming", "4", "--overlap", "5", "--mixing", "0.5", "--outer-dtype", "bf16"]),
    "local": ("no sync (compute-only reference)", ["--diloco", "1000000"]),
}
ORDER = list(METHODS)
# PyTorch's post-local SGD (bench/python_post_local_sgd.py, under torchrun) on
# the same task, against ddp's: --compare-post-local.
PYTHON_POST_LOCAL = "python-post-local-sgd"
METHODS[PYTHON_POST_LOCAL] = ("PyTorch post-local SGD (K=100, H=8)", ["--warmup", "100", "--period", "8"])


class Runner:
    def __init__(self, args):
        self.args = args
        self.bin = os.path.join(os.path.abspath(args.build_dir), "bin")
        self.port = 29850
        self.commands = {}

    def run(self, cluster, name, steps, workdir, seed=None):
        self.port += 1
        seed = self.args.seed if seed is None else seed
        metrics = os.path.join(workdir, f"{name}_{cluster.rate}_{seed}.jsonl")
        endpoint = f"{cluster.addresses[0]}:{self.port}"
        common = ["--steps", str(steps), "--eval-every", str(self.args.eval_every), "--seed", str(seed),
                  "--metrics", metrics]
        if name == PYTHON_POST_LOCAL:
            stdlib = subprocess.check_output([self.args.python, "-c", "import sysconfig; print(sysconfig.get_path('stdlib'))"],
                                             text=True).strip()
            train = [os.path.join(HERE, "python_post_local_sgd.py"), "--corpus", stdlib] + common + METHODS[name][1]
        else:
            train = [os.path.join(self.bin, "lm_train"), "--backend", "gloo"] + common + METHODS[name][1]
        env = dict(os.environ, GLOO_SOCKET_IFNAME=cluster.interface, OMP_NUM_THREADS="1", DDP_TIMEOUT_SECONDS="600",
                   # The nodes share one kernel: keep ddp's shared-memory
                   # transport off so that every byte crosses the links.
                   DDP_SHM="0")
        before = [cluster.tx_bytes(n) for n in range(cluster.nodes)]
        procs = []
        start = time.time()
        for node in range(cluster.nodes):
            if name == PYTHON_POST_LOCAL:
                argv = [self.args.python, "-m", "torch.distributed.run", "--nnodes", str(cluster.nodes),
                        "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                        "--local-addr", cluster.addresses[node]]
                argv += (["--rdzv-conf", "is_host=true"] if node == 0 else []) + train
            else:
                argv = [os.path.join(self.bin, "ddprun"), "--nnodes", str(cluster.nodes), "--nproc-per-node", "1",
                        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint] + train
            self.commands.setdefault(
                name, "GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 DDP_SHM=0 ip netns exec NODEn " +
                " ".join(shlex.quote(a.replace(ROOT + "/", "")) for a in argv).replace(metrics, "FILE"))
            procs.append(cluster.popen(node, argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                       stderr=subprocess.PIPE, text=True, start_new_session=True))
            if node == 0:
                time.sleep(1.0)  # node 0 hosts the rendezvous store
        outs = [p.communicate(timeout=3000) for p in procs]
        wall = time.time() - start
        after = [cluster.tx_bytes(n) for n in range(cluster.nodes)]
        for node, (p, (out, err)) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"{name}: node {node} failed ({p.returncode}):\n{out}\n{err[-3000:]}")
        curve = [json.loads(line) for line in open(metrics)]
        return {"method": name, "rate": cluster.rate, "steps": steps, "seed": seed, "curve": curve,
                "bytes": sum(a - b for a, b in zip(after, before)),
                "bytes_per_node": [a - b for a, b in zip(after, before)],
                "train_wall_s": curve[-1]["wall_s"], "process_wall_s": wall}


def summarize(results, rates):
    rows = []
    for rate in rates:
        base = next((r for r in results if r["rate"] == rate and r["method"] == "ddp"), None)
        local = next((r for r in results if r["rate"] == rate and r["method"] == "local"), None)
        for r in (r for r in results if r["rate"] == rate):
            final = r["curve"][-1]
            row = {"rate": rate, "method": r["method"], "label": METHODS[r["method"]][0],
                   "samples": final["samples"], "eval_loss": final["eval_loss"], "syncs": final["syncs"],
                   "mb": r["bytes"] / 1e6, "mb_per_step": r["bytes"] / 1e6 / r["steps"],
                   "wall_s": r["train_wall_s"]}
            if local:
                # The no-sync run sends only the start-up (rendezvous, broadcasts).
                row["mb_after_startup"] = (r["bytes"] - local["bytes"]) / 1e6
            if base:
                row["fewer_bytes"] = base["bytes"] / r["bytes"] if r["bytes"] else None
                if local and r["bytes"] > local["bytes"]:
                    row["fewer_bytes_after_startup"] = (base["bytes"] - local["bytes"]) / (r["bytes"] - local["bytes"])
                row["loss_vs_ddp"] = final["eval_loss"] / base["curve"][-1]["eval_loss"] - 1
                target = base["curve"][-1]["eval_loss"]
                reached = next((p for p in r["curve"] if p["eval_loss"] <= target), None)
                row["wall_to_ddp_loss_s"] = reached["wall_s"] if reached else None
                # Against when DDP itself first got there (its curve is noisy).
                ddp_reached = next(p for p in base["curve"] if p["eval_loss"] <= target)
                row["speedup_to_ddp_loss"] = (ddp_reached["wall_s"] / reached["wall_s"]) if reached else None
            if local:
                row["utilisation"] = local["train_wall_s"] / r["train_wall_s"]
            rows.append(row)
    return rows


def chart(results, rates, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 4.2), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for r in (r for r in results if r["rate"] == rate and r["method"] != "local"):
            ax.plot([p["wall_s"] for p in r["curve"]], [p["eval_loss"] for p in r["curve"]], marker=".",
                    label=f"{METHODS[r['method']][0]} ({r['bytes'] / 1e6:.0f} MB)")
        ax.set_title(f"{rate}: held-out loss against wall clock")
        ax.set_xlabel("seconds")
        ax.set_ylabel("held-out loss (nats/byte)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def render(args, rows, rates, runner, elapsed):
    lines = ["# Training over slow links: DDP, post-local SGD, DiLoCo, Streaming DiLoCo", "",
             f"Made by `bench/slow_links.py` ({elapsed / 60:.0f} min, "
             f"`sudo python bench/slow_links.py --nodes {args.nodes} --rates {','.join(rates)} --steps {args.steps}`)."
             f" {args.nodes} emulated nodes x 1 rank (network namespaces on one 2-core machine, tbf on each link), "
             f"examples/lm (470K parameters, context 64, batch 16 per rank, AdamW lr 3e-3 inside every method), "
             f"{args.steps} steps per rank for every method: the same {args.steps * 16 * args.nodes} samples. "
             "One run per method (no repeats: differences of a few % in loss or time are within noise).", "",
             "**Bytes** are everything every node's eth0 sent during the whole run (tx_bytes; the rendezvous, the "
             "start-up broadcasts and TCP/IP headers included). **Held-out loss** is rank 0's model on 8 fixed held-out "
             "batches at the end (after the last sync). **Wall** is training time on rank 0 (after start-up). "
             "**Utilisation** is the no-sync run's wall clock over the method's (same processes, same cores). "
             "**Saving after start-up** subtracts the no-sync run's bytes (rendezvous and start-up broadcasts, "
             "which every method pays once) from both sides: the steady-state ratio per training step.", ""]
    for rate in rates:
        lines += [f"## {rate}", "",
                  "| method | syncs | MB sent (all nodes) | saving | saving after start-up | held-out loss | vs DDP | wall s | to DDP's final loss | utilisation |",
                  "|---|---:|---:|---|---|---:|---:|---:|---:|---:|"]
        for row in (r for r in rows if r["rate"] == rate):
            fewer = row.get("fewer_bytes")
            saving = "—" if row["method"] == "ddp" else (f"{fewer:.0f}× fewer bytes than DDP" if fewer else "—")
            to_loss = row.get("wall_to_ddp_loss_s")
            to_loss_text = "not reached" if to_loss is None else f"{to_loss:.1f} s ({row['speedup_to_ddp_loss']:.1f}×)"
            after = row.get("fewer_bytes_after_startup")
            saving_after = "—" if row["method"] == "ddp" or not after else f"{after:.0f}× fewer bytes than DDP"
            lines.append(f"| {row['label']} | {row['syncs']} | {row['mb']:.1f} | {saving} | {saving_after} | "
                         f"{row['eval_loss']:.4f} | "
                         f"{row.get('loss_vs_ddp', 0) * 100:+.1f}% | {row['wall_s']:.1f} | {to_loss_text} | "
                         f"{row.get('utilisation', 0) * 100:.0f}% |")
        lines.append("")
    lines += ["## Commands", ""] + [f"- {name}: `{cmd}`" for name, cmd in runner.commands.items()] + [""]
    return "\n".join(lines)


def compare_post_local(args, runner, rate):
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        with EmulatedCluster(nodes=args.nodes, rate=rate, prefix="ddpsl") as cluster:
            for seed in (0, 1, 2):
                for name in ("post-local-sgd", PYTHON_POST_LOCAL):
                    r = runner.run(cluster, name, args.steps, workdir, seed)
                    print(f"{rate} {name} seed {seed}: {r['bytes'] / 1e6:.1f} MB, "
                          f"loss {r['curve'][-1]['eval_loss']:.4f}, {r['train_wall_s']:.1f} s", flush=True)
                    results.append(r)
    with open(os.path.join(args.out_dir, "slow_links_post_local.json"), "w") as f:
        json.dump({"args": vars(args), "raw": results, "commands": runner.commands}, f, indent=1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--rates", default="1gbit,100mbit")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--methods", default=",".join(ORDER))
    parser.add_argument("--out-dir", default=HERE)
    parser.add_argument("--python", default=sys.executable, help="the Python with torch, for torchrun")
    parser.add_argument("--compare-post-local", action="store_true",
                        help="only ddp's and PyTorch's post-local SGD, seeds 0, 1, 2, at the first rate; "
                             "writes slow_links_post_local.json")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("slow_links.py creates network namespaces: run it as root")
    rates = args.rates.split(",")
    methods = args.methods.split(",")
    runner = Runner(args)
    if args.compare_post_local:
        compare_post_local(args, runner, rates[0])
        return
    results = []
    start = time.time()
    with tempfile.TemporaryDirectory() as workdir:
        for rate in rates:
            with EmulatedCluster(nodes=args.nodes, rate=rate, prefix="ddpsl") as cluster:
                for name in methods:
                    r = runner.run(cluster, name, args.steps, workdir)
                    print(f"{rate} {name}: {r['bytes'] / 1e6:.1f} MB, loss {r['curve'][-1]['eval_loss']:.4f}, "
                          f"{r['train_wall_s']:.1f} s", flush=True)
                    results.append(r)
    elapsed = time.time() - start
    rows = summarize(results, rates)
    with open(os.path.join(args.out_dir, "slow_links.json"), "w") as f:
        json.dump({"args": vars(args), "raw": results, "summary": rows, "commands": runner.commands,
                   "elapsed_s": elapsed}, f, indent=1)
    chart(results, rates, os.path.join(args.out_dir, "SLOW_LINKS.png"))
    with open(os.path.join(args.out_dir, "SLOW_LINKS.md"), "w") as f:
        f.write(render(args, rows, rates, runner, elapsed))


if __name__ == "__main__":
    main()
