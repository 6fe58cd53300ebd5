"""Churn: the transformer benchmark (bench/gpt_bench.cpp) on 4 emulated nodes
at 1 Gbit/s, a random node killed every --kill-every seconds, under
ddprun --fault-tolerance (A), under today's restart mode (B), and without
faults (C). bench/CHURN.md is its page.

    flock /tmp/ddp-build.lock $(cat build/.venv-path)/bin/python bench/churn_bench.py

Needs root (network namespaces), etcd 3.4 and curl, and a build with ddprun,
ddp_ft_store and gpt_bench. Every node runs one ddprun with one worker.

- A meets through --rdzv-backend etcd-v2: a 3-member etcd cluster, one member
  on each of nodes 0-2 (on the node's own address, behind its 1 Gbit/s link).
  Any node may be the victim, node 0 included. With --kill node (the default)
  the victim's ddprun, its worker and its etcd member are SIGKILLed together,
  and all three are started again --rejoin-after seconds later (the ddprun
  joins the running job as a late node, its worker heals from live peers).
  --rdzv-backend c10d instead meets at node 0, whose ddprun keeps the FT
  store, so node 0 is spared and only workers are killed.
- B and C are restart mode over c10d, today's default; B's kill is the
  victim's worker (any node), after which ddprun restarts the whole job.

Writes bench/churn.json (the summary, every kill, the job's step lines and
/proc samples of every worker) and bench/CHURN.png.
"""
import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from emulated_cluster import EmulatedCluster  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "bin")
STEP = re.compile(r"gpt_bench: step (\d+) members (\d+) samples (\d+) time ([\d.]+)")
PROCESS = re.compile(r"gpt_bench: process fds (\d+) threads (\d+) rss_kb (\d+) time ([\d.]+)(?: (at_start|at_end))?(?: stats (.*))?")
# One "(N bytes)" per sender: several live members each send a share.
HEALED = re.compile(r"joined at step (\d+), healed from (.*?) in (\d+) ms")
# One line per membership change; several replicas may leave in one ("replica X left (cause);
# replica Y left (cause) at step N; ..."), and a cause may hold one parenthesis of its own.
LEFT_LINE = re.compile(r"ddp: membership: (.*) at step (\d+); recovered in (\d+) ms")
LEFT_ONE = re.compile(r"replica (\S+) left \(((?:[^()]|\([^()]*\))*)\)")
SCENARIOS = {"A": "fault tolerance", "B": "restart mode", "C": "fault-free",
             "D": "fault tolerance, no kills"}


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


def LEFT_MATCHES(path):
    with open(path, errors="replace") as f:
        return [line for line in f if "ddp: membership:" in line and " left (" in line]


def steps_of(path):
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            m = STEP.search(line)
            if m:
                rows.append((int(m[1]), int(m[2]), int(m[3]), float(m[4])))
    return rows


ETCD_CLIENT_PORT, ETCD_PEER_PORT = 2379, 2380


def start_etcd(cluster, a, logdir, name):
    """A 3-member etcd cluster (v2 API), one member on each of nodes 0, 1 and 2, on the
    node's own address, so its traffic crosses the same 1 Gbit/s links as the job's.
    Data on /dev/shm: etcd fsyncs every write. Returns (processes, "h:p,h:p,h:p")."""
    members = list(range(min(3, a.nodes)))
    initial = ",".join(f"m{i}=http://{cluster.addresses[i]}:{ETCD_PEER_PORT}" for i in members)
    data = tempfile.mkdtemp(prefix=f"churn_etcd_{name}_", dir="/dev/shm" if os.access("/dev/shm", os.W_OK) else None)
    procs, argvs = {}, {}
    for i in members:
        client = f"http://{cluster.addresses[i]}:{ETCD_CLIENT_PORT}"
        peer = f"http://{cluster.addresses[i]}:{ETCD_PEER_PORT}"
        argv = ["etcd", "--name", f"m{i}", "--data-dir", os.path.join(data, f"m{i}"),
                "--listen-client-urls", client, "--advertise-client-urls", client,
                "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                "--initial-cluster", initial, "--initial-cluster-state", "new",
                "--initial-cluster-token", f"churn{name}", "--enable-v2=true",
                "--heartbeat-interval", "50", "--election-timeout", "500",
                "--logger", "zap", "--log-level", "error"]
        log = open(os.path.join(logdir, f"{name}_etcd{i}.log"), "w")
        procs[i] = cluster.popen(i, argv, stdout=log, stderr=subprocess.STDOUT)
        argvs[i] = argv
    endpoints = ",".join(f"{cluster.addresses[i]}:{ETCD_CLIENT_PORT}" for i in members)
    # Ready once a write through each member succeeds, asked from node 3's side.
    asker = a.nodes - 1
    deadline = time.time() + 30
    for i in members:
        url = f"http://{cluster.addresses[i]}:{ETCD_CLIENT_PORT}/v2/keys/churn-ready"
        while True:
            done = subprocess.run(cluster.command(asker, ["curl", "-s", "-m", "1", "-XPUT", url, "-d", "value=1"]),
                                  capture_output=True, text=True, timeout=10)
            if '"action"' in done.stdout:
                break
            if time.time() > deadline:
                raise RuntimeError(f"etcd member m{i} never served; see {logdir}/{name}_etcd{i}.log")
            time.sleep(0.1)
    return procs, argvs, endpoints, data


def proc_sample(pid):
    """fds, threads and RSS (kB) of a process, from /proc; None if it is gone."""
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        threads = rss = 0
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Threads:"):
                    threads = int(line.split()[1])
                elif line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
        return fds, threads, rss
    except (OSError, ValueError, IndexError):
        return None


def run_scenario(name, a, logdir):
    # D is A's job without kills: what the fault-tolerance layer and its store cost per step.
    ft = name in "AD"
    duration = a.d_duration if name == "D" else a.duration
    etcd = ft and a.rdzv_backend == "etcd-v2"
    kills = []
    samples = {}  # worker pid -> [(time, fds, threads, rss_kb)], sampled from outside
    with EmulatedCluster(nodes=a.nodes, rate=a.rate, prefix=f"ch{name}") as cluster:
        etcd_data, etcd_procs = None, {}
        if etcd:
            etcd_procs, etcd_argvs, endpoint, etcd_data = start_etcd(cluster, a, logdir, name)
            backend = "etcd-v2"
        else:
            endpoint = f"{cluster.addresses[0]}:29400"
            backend = "c10d"
        run_id = f"churn{name}{os.getpid()}"
        procs, logs, argvs = [], [], []
        env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=cluster.interface)
        for node in range(a.nodes):
            argv = [os.path.join(BIN, "ddprun"), "--rdzv-backend", backend, "--rdzv-endpoint", endpoint,
                    "--rdzv-id", run_id, "--nnodes", str(a.nodes), "--nproc-per-node", "1",
                    "--local-addr", cluster.addresses[node], "--max-restarts", "1000", "--no-prefix"]
            if ft:
                argv += ["--fault-tolerance", "--ft-deadline", str(a.deadline)]
            argv += [os.path.join(BIN, "gpt_bench")] + model_args(a) + ([] if ft else ["--log-steps"])
            path = os.path.join(logdir, f"{name}_node{node}.log")
            log = open(path, "w")
            procs.append(cluster.popen(node, argv, env=env, stdout=log, stderr=subprocess.STDOUT))
            logs.append(path)
            argvs.append(argv)
            time.sleep(0.3 if node == 0 else 0.05)
        # The clock starts at the job's first committed step.
        deadline = time.time() + 180
        while not any(steps_of(p) for p in logs):
            if time.time() > deadline or procs[0].poll() is not None:
                raise RuntimeError(f"scenario {name}: no step within 180 s; see {logs[0]}")
            time.sleep(0.1)
        t0 = min(steps_of(p)[0][3] for p in logs if steps_of(p))
        rng = random.Random(a.seed)
        # Under c10d the rendezvous host (node 0's ddprun) also keeps the fault-tolerance
        # store, so a fault-tolerant job spares node 0; etcd-v2 lets any node go.
        first_victim = 1 if (ft and not etcd) else 0
        whole_node = ft and etcd and a.kill == "node"
        next_kill = t0 + a.kill_every
        next_sample = t0
        restarts = []  # (time, node): ddpruns to start again
        end = t0 + duration
        while time.time() < end:
            now = time.time()
            if now >= next_sample:
                for node in range(a.nodes):
                    for pid in worker_pids(procs[node].pid):
                        s = proc_sample(pid)
                        if s:
                            samples.setdefault(pid, {"node": node, "rows": []})["rows"].append(
                                [round(now - t0, 2)] + list(s))
                next_sample += a.sample_every
            for r in [r for r in restarts if now >= r[0]]:
                restarts.remove(r)
                node = r[1]
                if node in etcd_procs and etcd_procs[node].poll() is not None:
                    # The member comes back on its own data directory and catches up from the others.
                    log = open(os.path.join(logdir, f"{name}_etcd{node}.log"), "a")
                    etcd_procs[node] = cluster.popen(node, etcd_argvs[node], stdout=log, stderr=subprocess.STDOUT)
                log = open(logs[node], "a")
                procs[node] = cluster.popen(node, argvs[node], env=env, stdout=log, stderr=subprocess.STDOUT)
                print(f"  {name}: node {node}'s ddprun{' and etcd member' if node in etcd_procs else ''} "
                      f"started again at +{now - t0:.1f} s", flush=True)
            if name in "AB" and now >= next_kill:
                node = rng.randrange(first_victim, a.nodes)
                if whole_node:
                    t = time.time()
                    pids = worker_pids(procs[node].pid)
                    # ddprun and its worker (which has a parent-death signal, and dies at once anyway).
                    member = [etcd_procs[node].pid] if node in etcd_procs else []
                    for pid in [procs[node].pid] + pids + member:
                        try:
                            os.kill(pid, 9)
                        except ProcessLookupError:
                            pass
                    procs[node].wait(timeout=10)
                    if member:
                        etcd_procs[node].wait(timeout=10)
                    kills.append({"time": t, "node": node, "pid": pids[0] if pids else None,
                                  "what": "node" + (" and its etcd member" if member else "")})
                    restarts.append((t + a.rejoin_after, node))
                    print(f"  {name}: killed node {node} (ddprun {procs[node].pid}, worker {pids}, etcd {member}) "
                          f"at +{t - t0:.1f} s", flush=True)
                else:
                    pids = worker_pids(procs[node].pid)
                    if pids:
                        t = time.time()
                        os.kill(pids[0], 9)
                        kills.append({"time": t, "node": node, "pid": pids[0], "what": "worker"})
                        print(f"  {name}: killed node {node}'s worker (pid {pids[0]}) at +{t - t0:.1f} s", flush=True)
                    else:
                        print(f"  {name}: node {node} has no worker right now; kill skipped", flush=True)
                next_kill += a.kill_every
            time.sleep(0.05)
        # The cluster's exit ends every process; the logs stay.
    for p in procs:
        p.wait(timeout=30)
    if etcd_data:
        shutil.rmtree(etcd_data, ignore_errors=True)
    result = analyse(name, a, logs, kills, t0, duration)
    result["rdzv_backend"] = backend
    result["kill_what"] = ("none" if name in "CD" else
                           "node: its ddprun, worker and etcd member (if it has one), all started again "
                           f"{a.rejoin_after} s later" if whole_node else "worker")
    result["process_samples"] = samples
    result["survivor"] = survivor_summary(samples)
    return result


def survivor_summary(samples):
    """The worker process that lived longest (through the most membership changes):
    its fds, threads and RSS at its first sample, after a minute, and at its last."""
    if not samples:
        return None
    pid, s = max(samples.items(), key=lambda kv: kv[1]["rows"][-1][0] - kv[1]["rows"][0][0])
    rows = s["rows"]
    minute = next((r for r in rows if r[0] - rows[0][0] >= 60), rows[-1])
    return {"pid": pid, "node": s["node"], "from_s": rows[0][0], "to_s": rows[-1][0],
            "first": rows[0][1:], "after_60_s": minute[1:], "last": rows[-1][1:],
            "fds_min_max": [min(r[1] for r in rows), max(r[1] for r in rows)],
            "threads_min_max": [min(r[2] for r in rows), max(r[2] for r in rows)],
            "rss_kb_min_max": [min(r[3] for r in rows), max(r[3] for r in rows)]}


def analyse(name, a, logs, kills, t0, duration):
    end = t0 + duration
    if name in "AD":
        # Every node prints each committed step it took part in (same step, members and
        # samples everywhere); any node may have been killed, so the job's timeline is the
        # union of the nodes' lines, each step at the first time a node printed it.
        by_step = {}
        for path in logs:
            for r in steps_of(path):
                if r[0] not in by_step or r[3] < by_step[r[0]][3]:
                    by_step[r[0]] = r
        rows = [by_step[k] for k in sorted(by_step) if by_step[k][3] <= end]
    else:
        # Restart mode: node 0's ddprun runs through every restart, and all workers restart together.
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
        if name in "AD":
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
    # The FT layer's counters of the incarnation that committed the most steps (the longest-lived
    # survivor): the victims' restarted incarnations count from their join.
    stats = []
    for path in logs:
        stats += [json.loads(m[6]) for m in PROCESS.finditer(open(path, errors="replace").read()) if m[6]]
    stats.sort(key=lambda x: x.get("ft_committed_steps", 0))
    left, seen = [], set()
    for path in logs:
        for line in LEFT_MATCHES(path):
            m = LEFT_LINE.search(line)
            for one in LEFT_ONE.finditer(m[1]) if m else []:
                if (one[1], m[2]) not in seen:  # every survivor prints it; the first node's figure is kept
                    seen.add((one[1], m[2]))
                    left.append({"replica": one[1], "cause": one[2], "step": int(m[2]), "recovered_ms": int(m[3])})
    healed = []
    for path in logs:
        for m in HEALED.finditer(open(path, errors="replace").read()):
            shares = [int(b) for b in re.findall(r"\((\d+) bytes\)", m[2])]
            healed.append({"step": int(m[1]), "bytes": sum(shares), "senders": len(shares), "ms": int(m[3])})
    return {
        "scenario": name,
        "label": SCENARIOS[name],
        "duration_s": duration,
        "kills": [{"at_s": round(k["time"] - t0, 2), "node": k["node"]} for k in kills],
        "samples_held_at_end": held,
        "samples_processed": processed,
        "committed_samples_per_s": round(held / duration, 2),
        "processed_samples_per_s": round(processed / duration, 2),
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

    colors = {"A": "tab:blue", "B": "tab:red", "C": "tab:green", "D": "tab:gray"}
    fig, axes = plt.subplots(2, 1, figsize=(11, 7.5), sharex=True)
    for name, r in results.items():
        t = [s[0] for s in r["node0_steps"]]
        held = [s[3] for s in r["node0_steps"]]
        axes[0].plot(t, held, color=colors[name], label=f"{name}: {r['label']}", linewidth=1.2)
        # Committed samples per second in bins of `bin` seconds.
        b = a.bin
        bins = [0.0] * int(-(-r["duration_s"] // b))  # the last bin ends at the run's end
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
    axes[0].set_ylabel("samples the model holds")
    axes[0].set_title(f"gpt_bench ({a.layers} layers, d_model {a.d_model}), {a.nodes} nodes x 1 rank at {a.rate}/s; "
                      f"every {a.kill_every:.0f} s (dotted) A loses a whole node, B a worker", fontsize=10)
    axes[1].set_ylabel(f"samples/s ({a.bin} s bins; B: work done, later lost)")
    axes[1].set_xlabel("seconds since the job's first step")
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
    p.add_argument("--scenarios", default="CADB")
    p.add_argument("--duration", type=float, default=300.0, help="seconds per scenario from the first step")
    p.add_argument("--d-duration", type=float, default=90.0, help="seconds of scenario D (A without kills)")
    p.add_argument("--kill-every", type=float, default=30.0)
    p.add_argument("--nodes", type=int, default=4)
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--deadline", type=float, default=5.0, help="--ft-deadline")
    p.add_argument("--seed", type=int, default=36)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--bin", type=float, default=5.0)
    p.add_argument("--rdzv-backend", default="etcd-v2", choices=["etcd-v2", "c10d"],
                   help="A's backend (B and C, restart mode, use c10d, today's default); "
                        "etcd-v2 starts 3 etcd members on nodes 0-2 and lets node 0 be killed")
    p.add_argument("--kill", default="node", choices=["worker", "node"],
                   help="what A kills under etcd-v2: the node (its ddprun, worker and etcd member, "
                        "all started again --rejoin-after s later; the ddprun joins as a late node), or its worker")
    p.add_argument("--rejoin-after", type=float, default=1.0)
    p.add_argument("--sample-every", type=float, default=5.0, help="seconds between /proc samples of the workers")
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
        print(f"scenario {name} ({SCENARIOS[name]}), {a.d_duration if name == 'D' else a.duration:.0f} s", flush=True)
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
