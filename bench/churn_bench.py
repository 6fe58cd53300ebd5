"""Churn: the transformer benchmark (bench/gpt_bench.cpp) on 4 emulated nodes
at 1 Gbit/s, a random worker SIGKILLed every --kill-every seconds, under
ddprun --fault-tolerance (A), under today's restart mode (B), and without
faults (C). bench/CHURN.md is its page.

    flock /tmp/ddp-build.lock sudo $(cat build/.venv-path)/bin/python bench/churn_bench.py

Needs root (network namespaces) and a build with ddprun, ddp_ft_store and
gpt_bench. Every node runs one ddprun with one worker; the agents meet with
--rdzv-backend c10d at node 0, whose ddprun also keeps the fault-tolerance
store (ddp_ft_store), so node 0 is never killed: the victims are the workers
of nodes 1-3. Writes bench/churn.json (the summary and every node's step
lines) and bench/CHURN.png.
"""
import argparse
import json
import os
import random
import re
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated_cluster import EmulatedCluster  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "bin")
STEP = re.compile(r"gpt_bench: step (\d+) members (\d+) samples (\d+) time ([\d.]+)")
PROCESS = re.compile(r"gpt_bench: process fds (\d+) threads (\d+) rss_kb (\d+) time ([\d.]+)(?: (at_start|at_end))?(?: stats (.*))?")
# One "(N bytes)" per sender: several live members each send a share.
HEALED = re.compile(r"joined at step (\d+), healed from (.*?) in (\d+) ms")
LEFT = re.compile(r"ddp: membership: replica (\S+) left \(([^)]*\)?)\) at step (\d+); recovered in (\d+) ms")
SCENARIOS = {"A": "fault tolerance", "B": "restart mode", "C": "fault-free"}


def model_args(a):
    return ["--device", "cpu", "--layers", str(a.layers), "--d-model", str(a.d_model), "--heads", str(a.heads),
            "--seq", str(a.seq), "--vocab", str(a.vocab), "--batch", str(a.batch), "--threads", "1",
            "--warmup", "0", "--steps", "100000000"]


def worker_pids(ddprun_pid):
    """The gpt_bench children of a ddprun (not its ddp_ft_store)."""
    pids = []
    try:
        for task in os.listdir(f"/proc/{ddprun_pid}/task"):
            with open(f"/proc/{ddprun_pid}/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
    except OSError:
        return []
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            # Skip zombies: ddprun --fault-tolerance has been seen to leave a
            # killed worker unreaped while its next incarnation runs.
            if stat.split(" (", 1)[1].startswith("gpt_bench)") and stat.rsplit(")", 1)[1].split()[0] != "Z":
                out.append(pid)
        except (OSError, IndexError):
            pass
    return out


def steps_of(path):
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            m = STEP.search(line)
            if m:
                rows.append((int(m[1]), int(m[2]), int(m[3]), float(m[4])))
    return rows


def run_scenario(name, a, logdir):
    ft = name == "A"
    kills = []
    with EmulatedCluster(nodes=a.nodes, rate=a.rate, prefix=f"ch{name}") as cluster:
        endpoint = f"{cluster.addresses[0]}:29400"
        procs, logs = [], []
        for node in range(a.nodes):
            argv = [os.path.join(BIN, "ddprun"), "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                    "--rdzv-id", f"churn{name}", "--nnodes", str(a.nodes), "--nproc-per-node", "1",
                    "--local-addr", cluster.addresses[node], "--max-restarts", "1000", "--no-prefix"]
            if ft:
                argv += ["--fault-tolerance", "--ft-deadline", str(a.deadline)]
            argv += [os.path.join(BIN, "gpt_bench")] + model_args(a) + ([] if ft else ["--log-steps"])
            path = os.path.join(logdir, f"{name}_node{node}.log")
            log = open(path, "w")
            env = dict(os.environ, OMP_NUM_THREADS="1")
            procs.append(cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(path)
            time.sleep(0.3 if node == 0 else 0.05)
        # The clock starts at node 0's first committed step.
        deadline = time.time() + 120
        while not steps_of(logs[0]):
            if time.time() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"scenario {name}: no step within 120 s; see {logs[0]}")
            time.sleep(0.1)
        t0 = steps_of(logs[0])[0][3]
        rng = random.Random(a.seed)
        next_kill = t0 + a.kill_every
        end = t0 + a.duration
        while time.time() < end:
            if name != "C" and time.time() >= next_kill:
                node = rng.randrange(1, a.nodes)
                pids = worker_pids(procs[node].pid)
                if pids:
                    t = time.time()
                    os.kill(pids[0], 9)
                    kills.append({"time": t, "node": node, "pid": pids[0]})
                    print(f"  {name}: killed node {node}'s worker (pid {pids[0]}) at +{t - t0:.1f} s", flush=True)
                else:
                    print(f"  {name}: node {node} has no worker right now; kill skipped", flush=True)
                next_kill += a.kill_every
            time.sleep(0.05)
        # The cluster's exit ends every process; the logs stay.
    for p in procs:
        p.wait(timeout=30)
    return analyse(name, a, logs, kills, t0)


def analyse(name, a, logs, kills, t0):
    end = t0 + a.duration
    rows = [r for r in steps_of(logs[0]) if r[3] <= end]
    # What the model holds at the end: under restart mode only the last
    # incarnation's samples (without snapshots each restart starts at step 0).
    held = rows[-1][2] if rows else 0
    processed = 0
    prev = 0
    for r in rows:
        processed += r[2] - prev if r[2] >= prev else r[2]
        prev = r[2]
    recov, full, lost_steps = [], [], []
    for k in kills:
        after = [r for r in rows if r[3] > k["time"]]
        before = [r for r in rows if r[3] <= k["time"]]
        if name == "A":
            first = next((r for r in after if r[1] < a.nodes), None)
            back = next((r for r in after if r[1] == a.nodes and first and r[3] > first[3]), None)
        else:
            # The first step of the restarted job (its counter starts again).
            first = next((r for r in after if before and r[0] <= before[-1][0] and r[0] < 5), None)
            back = first
            if before:
                lost_steps.append(before[-1][0])
        recov.append(round(first[3] - k["time"], 3) if first else None)
        full.append(round(back[3] - k["time"], 3) if back else None)
    text = open(logs[0], errors="replace").read()
    procs = []
    for m in PROCESS.finditer(text):
        procs.append({"fds": int(m[1]), "threads": int(m[2]), "rss_kb": int(m[3]), "time": float(m[4])})
    stats = [json.loads(m[6]) for m in PROCESS.finditer(text) if m[6]]
    left = [{"replica": m[1], "cause": m[2], "step": int(m[3]), "recovered_ms": int(m[4])}
            for m in LEFT.finditer(text)]
    healed = []
    for path in logs[1:]:
        for m in HEALED.finditer(open(path, errors="replace").read()):
            shares = [int(b) for b in re.findall(r"\((\d+) bytes\)", m[2])]
            healed.append({"step": int(m[1]), "bytes": sum(shares), "senders": len(shares), "ms": int(m[3])})
    return {
        "scenario": name,
        "label": SCENARIOS[name],
        "duration_s": a.duration,
        "kills": [{"at_s": round(k["time"] - t0, 2), "node": k["node"]} for k in kills],
        "samples_held_at_end": held,
        "samples_processed": processed,
        "committed_samples_per_s": round(held / a.duration, 2),
        "processed_samples_per_s": round(processed / a.duration, 2),
        "steps_at_end": rows[-1][0] if rows else 0,
        "recovery_s": recov,
        "back_to_full_size_s": full,
        "restart_mode_steps_lost": lost_steps,
        "membership_left_lines": left,
        "heals": healed,
        "ft_stats_last": stats[-1] if stats else None,
        "survivor_process_first": procs[0] if procs else None,
        "survivor_process_last": procs[-1] if procs else None,
        "survivor_process_all": procs,
        "node0_steps": [[round(r[3] - t0, 3), r[0], r[1], r[2]] for r in rows],
    }


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def chart(results, path, a):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"A": "tab:blue", "B": "tab:red", "C": "tab:green"}
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    for name, r in results.items():
        t = [s[0] for s in r["node0_steps"]]
        held = [s[3] for s in r["node0_steps"]]
        axes[0].plot(t, held, color=colors[name], label=f"{name}: {r['label']}", linewidth=1.2)
        # Committed samples per second in bins of `bin` seconds.
        b = a.bin
        bins = [0.0] * int(-(-a.duration // b))  # the last bin ends at the run's end
        prev = 0
        for s in r["node0_steps"]:
            gained = s[3] - prev if s[3] >= prev else s[3]
            prev = s[3]
            i = int(max(s[0], 0) // b)
            if i < len(bins):
                bins[i] += gained / b
        axes[1].step([i * b for i in range(len(bins))], bins, where="post", color=colors[name],
                     label=f"{name}: {r['label']}", linewidth=1.2)
        for k in r["kills"]:
            for ax in axes:
                ax.axvline(k["at_s"], color=colors[name], linestyle=":", linewidth=0.8)
    axes[0].set_ylabel("samples the model holds (node 0)")
    axes[0].set_title(f"gpt_bench, {a.nodes} nodes x 1 rank at {a.rate}/s, a worker SIGKILLed every "
                      f"{a.kill_every} s (dotted)", fontsize=10)
    axes[1].set_ylabel(f"samples/s ({a.bin} s bins; B: work done, later lost)")
    axes[1].set_xlabel("seconds since node 0's first step")
    for ax in axes:
        ax.legend(fontsize=8, loc="upper left")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write_json(path, data):
    """Readable at the top, one compact line per run (their step lines are long)."""
    runs = data["runs"]
    head = {k: v for k, v in data.items() if k != "runs"}
    with open(path, "w") as f:
        f.write(json.dumps(head, indent=1)[:-2] + ',\n "runs": {\n')
        f.write(",\n".join(f"  {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in runs.items()))
        f.write("\n }\n}\n")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenarios", default="CAB")
    p.add_argument("--duration", type=float, default=150.0, help="seconds per scenario from the first step")
    p.add_argument("--kill-every", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--deadline", type=float, default=5.0, help="--ft-deadline")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--bin", type=float, default=5.0)
    p.add_argument("--logdir", default="/tmp/churn_logs")
    p.add_argument("--json", default=os.path.join(ROOT, "bench", "churn.json"))
    p.add_argument("--plot", default=os.path.join(ROOT, "bench", "CHURN.png"))
    p.add_argument("--merge", action="store_true",
                   help="keep the runs of the scenarios not run now from the existing --json")
    a = p.parse_args()
    os.makedirs(a.logdir, exist_ok=True)
    results = {}
    if a.merge and os.path.exists(a.json):
        with open(a.json) as f:
            old = json.load(f)
        results = {k: v for k, v in old["runs"].items() if k not in a.scenarios}
    for name in a.scenarios:
        print(f"scenario {name} ({SCENARIOS[name]}), {a.duration:.0f} s", flush=True)
        results[name] = run_scenario(name, a, a.logdir)
        r = results[name]
        print(f"  {r['committed_samples_per_s']} committed samples/s, recovery {r['recovery_s']}", flush=True)
    results = {k: results[k] for k in sorted(results)}
    base = results.get("C", {}).get("committed_samples_per_s")
    summary = {}
    for name, r in results.items():
        summary[name] = {
            "label": r["label"],
            "committed_samples_per_s": r["committed_samples_per_s"],
            "kept_vs_fault_free": round(r["committed_samples_per_s"] / base, 4) if base else None,
            "kills": len(r["kills"]),
            "recovery_median_s": median(r["recovery_s"]),
            "recovery_worst_s": max((x for x in r["recovery_s"] if x is not None), default=None),
            "back_to_full_median_s": median(r["back_to_full_size_s"]),
        }
    print(json.dumps(summary, indent=1))
    argv = [os.path.basename(sys.argv[0])] + sys.argv[1:]
    write_json(a.json, {"command": " ".join(argv), "args": vars(a), "summary": summary, "runs": results})
    chart(results, a.plot, a)


if __name__ == "__main__":
    main()
