"""ddp against PyTorch's Python DDP on an emulated cluster of 2 (or, with
--nodes, N) nodes, one rank per node (bench/emulated_cluster.py: network
namespaces joined by a bridge, each node's link limited with tbf in both
directions), at 1 Gbit/s and 10 Gbit/s. Writes bench/NETWORK.md,
bench/network.json, bench/NETWORK.png.

    sudo python bench/run_net_bench.py --build-dir build      # needs root
    make bench-net                                            # the same
    sudo python bench/run_net_bench.py --nodes 4 --variants python,ddp,ddp-mpi --out-dir /tmp/net4
    sudo python bench/run_net_bench.py --nproc-per-node 2 --rates 1gbit --models transformer \
        --variants python,flat-gloo,hier-shm,hier-gloo,ddp-auto        # NETWORK_2X2.md

ddp runs under ddprun's c10d rendezvous, Python DDP under torchrun's, both
hosted on node 0; backend gloo, GLOO_SOCKET_IFNAME=eth0 and OMP_NUM_THREADS=1
on every node for both. Variants (rounds interleave them, so each sees the
same machine): ddp, Python DDP, ddp without overlap, ddp over MPI (one
mpirun in node 0's namespace, starting the other nodes' ranks through a
launch agent that enters their namespaces, as ssh would enter a host; only
where mpirun exists and ddp was built with MPI), ddp's compute-only step
(--mode local: no process group), the bucket-size sweep, and the comm hooks.

Bytes on the wire per step come from the interfaces' tx_bytes counters of
all nodes, read before and after each run: every variant is run twice, with
S and with 2 S timed steps (same warm-up), and the difference of the two
runs' bytes is divided by S, so that start-up (rendezvous, DDP's parameter
broadcast, warm-up steps, teardown) cancels out. Step times are the median
over rounds of each run's median (both runs of a pair count).
"""
import argparse
import json
import os
import platform
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from emulated_cluster import SUBNET, EmulatedCluster

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# name -> (implementation, ddp_bench / python_ddp_bench arguments)
VARIANTS = {
    "ddp": ("cpp", ["--mode", "ddp"]),
    "python": ("py", ["--mode", "ddp"]),
    "no-overlap": ("cpp", ["--mode", "no-overlap"]),
    "bucket-1": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "1"]),
    "bucket-2": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "2"]),
    "bucket-3": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "3"]),
    "bucket-5": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "5"]),
    "bucket-8": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "8"]),
    "bucket-100": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "100"]),
    # PyTorch's fixed default, set explicitly (the "ddp" variant fits buckets to the link).
    "bucket-25": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "25"]),
    "fp16": ("cpp", ["--mode", "ddp", "--comm-hook", "fp16"]),
    "bf16": ("cpp", ["--mode", "ddp", "--comm-hook", "bf16"]),
    "powersgd-4": ("cpp", ["--mode", "ddp", "--comm-hook", "powersgd", "--powersgd-rank", "4"]),
    "python-bf16": ("py", ["--mode", "ddp", "--comm-hook", "bf16"]),
    "python-powersgd-4": ("py", ["--mode", "ddp", "--comm-hook", "powersgd", "--powersgd-rank", "4"]),
    "ddp-mpi": ("mpi", ["--mode", "ddp", "--backend", "mpi"]),
    # The optimizer stepped bucket by bucket as each all-reduce completes
    # (opt-in on both sides: ddp's step_in_backward, DDP._register_fused_optim).
    "step-in-backward": ("cpp", ["--mode", "ddp", "--step-in-backward"]),
    "bucket-5-step-in-backward": ("cpp", ["--mode", "ddp", "--bucket-cap-mb", "5", "--step-in-backward"]),
    "python-bucket-5": ("py", ["--mode", "ddp", "--bucket-cap-mb", "5"]),
    "python-bucket-5-fused-optim": ("py", ["--mode", "ddp", "--bucket-cap-mb", "5", "--optimizer-in-backward"]),
    # Several ranks per node (--nproc-per-node): which transport carries what.
    # --backend auto leaves the choice to ddp (ddp_bench's own default pins gloo).
    "flat-gloo": ("cpp", ["--mode", "ddp", "--backend", "auto"]),  # DDP_SHM=0 DDP_HIERARCHICAL=0 (VARIANT_ENV)
    "hier-shm": ("cpp", ["--mode", "ddp", "--backend", "auto", "--comm-hook", "hierarchical"]),
    "hier-gloo": ("cpp", ["--mode", "ddp", "--backend", "auto", "--comm-hook", "hierarchical"]),  # DDP_SHM=0
    "ddp-auto": ("cpp", ["--mode", "ddp", "--backend", "auto"]),
}
# What a variant adds to the environment of every rank.
# flat-gloo: DDP_HIERARCHICAL=0 too, since ddp's default across hosts is now hierarchical.
VARIANT_ENV = {"flat-gloo": {"DDP_SHM": "0", "DDP_HIERARCHICAL": "0"}, "hier-gloo": {"DDP_SHM": "0"}}
# Run in every round; the others only in the first `extra_rounds`.
CORE = ["ddp", "python", "no-overlap", "ddp-mpi"]
LABELS = {"python": "Python DDP (torchrun)", "ddp": "ddp defaults (link-fitted buckets)",
          "bucket-25": "ddp, 25 MB buckets (bucket_cap_mb(25))",
          "no-overlap": "ddp, no overlap", "ddp-mpi": "ddp, mpi backend (mpirun, btl tcp)",
          "bucket-1": "ddp, 1 MB buckets", "bucket-2": "ddp, 2 MB buckets", "bucket-3": "ddp, 3 MB buckets",
          "bucket-8": "ddp, 8 MB buckets", "bucket-5": "ddp, 5 MB buckets", "bucket-100": "ddp, 100 MB buckets",
          "fp16": "ddp, fp16_compress_hook", "bf16": "ddp, bf16_compress_hook",
          "powersgd-4": "ddp, powersgd_hook rank 4", "python-bf16": "Python DDP, bf16_compress_hook",
          "python-powersgd-4": "Python DDP, powerSGD_hook rank 4",
          "step-in-backward": "ddp, optimizer stepped in backward",
          "bucket-5-step-in-backward": "ddp, 5 MB buckets, optimizer stepped in backward",
          "python-bucket-5": "Python DDP, 5 MB buckets",
          "python-bucket-5-fused-optim": "Python DDP, 5 MB buckets, _register_fused_optim",
          "flat-gloo": "(a) ddp, flat Gloo over all ranks (DDP_SHM=0 DDP_HIERARCHICAL=0)",
          "hier-shm": "(b) ddp, hierarchical_allreduce_hook: shared memory in the node, Gloo between leaders",
          "hier-gloo": "ddp, hierarchical_allreduce_hook, Gloo in the node too (DDP_SHM=0)",
          "ddp-auto": "(c) ddp's default (--backend auto, no hook, no flag)"}
ORDER = ["flat-gloo", "hier-shm", "hier-gloo", "ddp-auto", "python", "ddp", "no-overlap", "ddp-mpi", "bucket-1", "bucket-2", "bucket-3", "bucket-5", "bucket-8", "bucket-25", "bucket-100", "fp16", "bf16",
         "python-bf16", "powersgd-4", "python-powersgd-4", "step-in-backward", "python-bucket-5",
         "bucket-5-step-in-backward", "python-bucket-5-fused-optim"]
MODELS = {"mlp2m": "2M MLP", "transformer": "10.5M transformer"}
MODELS_ALL = list(MODELS)  # MODELS loses what --models leaves out

_children = []  # process groups this script started, killed on interrupt


def _kill_children():
    """SIGTERM to each launcher's process group (ddprun and torchrun then end
    their workers), SIGKILL to what is left after 5 s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in _children:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
        for p in _children:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    _children.clear()


def _rate_bits(rate):
    for suffix, scale in (("kbit", 1e3), ("mbit", 1e6), ("gbit", 1e9)):
        if rate.endswith(suffix):
            return float(rate[: -len(suffix)]) * scale
    raise ValueError(rate)


def mpi_missing(bin_dir):
    """Why ddp-mpi cannot run here, or None."""
    if shutil.which("mpirun") is None:
        return "mpirun is not on PATH (openmpi-bin)"
    if not os.path.exists(os.path.join(bin_dir, "plain_mpi_allreduce")):
        return f"this build of ddp has no MPI ({os.path.join(bin_dir, 'plain_mpi_allreduce')} is missing)"
    if shutil.which("unshare") is None:
        return "unshare is not on PATH (util-linux)"
    return None


# Open MPI's launch agent: HOST COMMAND..., run inside HOST's namespace. Each
# node gets a host name of its own, since Open MPI groups ranks into nodes by
# host name and all namespaces share the machine's.
AGENT = """#!/bin/sh
host=$1; shift
case $host in
{cases}
  *) echo "unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $name; $*"
"""


class Runner:
    def __init__(self, args):
        self.args = args
        self.port = 29700
        self.bin = os.path.join(os.path.abspath(args.build_dir), "bin")
        self.commands = {}
        self.agent = None  # the launch agent of the current cluster, for ddp-mpi

    def write_agent(self, cluster, directory):
        def cases(namespaces):
            return "\n".join(f"  {a}) ns={ns}; name=node{i} ;;" for i, (a, ns) in
                             enumerate(zip(cluster.addresses, namespaces)))

        self.agent = os.path.join(directory, "enter_node.sh")
        with open(self.agent, "w") as f:
            f.write(AGENT.format(cases=cases(cluster.namespaces)))
        os.chmod(self.agent, 0o700)
        self.commands.setdefault("ddp-mpi AGENT", AGENT.format(
            cases=cases([f"NODE{i}" for i in range(cluster.nodes)])))

    def argv(self, cluster, node, impl, model, extra, steps, warmup):
        endpoint = f"{cluster.addresses[0]}:{self.port}"
        nnodes = str(cluster.nodes)
        nproc = str(self.args.nproc_per_node)
        bench = ["--model", model, "--steps", str(steps), "--warmup", str(warmup)] + extra
        if impl == "cpp":
            return [os.path.join(self.bin, "ddprun"), "--nnodes", nnodes, "--nproc-per-node", nproc, "--rdzv-backend",
                    "c10d", "--rdzv-endpoint", endpoint, os.path.join(self.bin, "ddp_bench")] + bench
        if impl == "mpi":
            return self.mpirun_argv(cluster, self.agent, os.path.join(self.bin, "ddp_bench"), bench)
        argv = [self.args.python, "-m", "torch.distributed.run", "--nnodes", nnodes, "--nproc-per-node", nproc,
                "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--local-addr", cluster.addresses[node]]
        if node == 0:
            argv += ["--rdzv-conf", "is_host=true"]
        return argv + [os.path.join(HERE, "python_ddp_bench.py")] + bench

    @staticmethod
    def mpirun_argv(cluster, agent, program, bench):
        """One mpirun for all nodes, to run in node 0's namespace. btl tcp,self
        and pml ob1: no shared memory between the "nodes" (one machine) and
        no UCX, which would pick its own transports, so every byte crosses
        the links. --bind-to none: each namespace looks like the whole
        machine to Open MPI, which would bind every node's rank to core 0.
        mpi_yield_when_idle: a rank waiting on the network yields its core
        instead of spinning; on a real node it would spin on a core of its
        own, here it would spin on the one core the other node's rank
        computes on (measured: 262 against 222 ms per step on 4 nodes)."""
        subnet = f"{SUBNET}.0/24"
        mpirun = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(cluster.nodes),
                  "--host", ",".join(f"{a}:1" for a in cluster.addresses),
                  "--mca", "plm_rsh_agent", agent, "--mca", "plm_rsh_no_tree_spawn", "1",
                  "--mca", "btl", "tcp,self", "--mca", "pml", "ob1",
                  "--mca", "btl_tcp_if_include", subnet, "--mca", "oob_tcp_if_include", subnet,
                  "--bind-to", "none", "--mca", "mpi_yield_when_idle", "1", "-x", "OMP_NUM_THREADS=1", "-x", "DDP_TIMEOUT_SECONDS=300", program] + bench
        return ["unshare", "--uts", "/bin/sh", "-c", "hostname node0; exec " + shlex.join(mpirun)]

    def env(self, cluster, name=None):
        return dict(os.environ, GLOO_SOCKET_IFNAME=cluster.interface, OMP_NUM_THREADS="1", DDP_TIMEOUT_SECONDS="300",
                    **VARIANT_ENV.get(name, {}))

    def _record(self, key, prefix, argv):
        def short(a):
            a = a.replace(self.agent, "AGENT") if self.agent else a
            a = "VENV/bin/python" if a == self.args.python else a
            return re.sub(re.escape(ROOT) + "/", "", a)

        self.commands.setdefault(key, " ".join([prefix] + [shlex.quote(short(a)) for a in argv]))

    def run(self, cluster, name, model, steps, warmup):
        """One run of a variant on every node: (rank 0's JSON, [bytes sent by node 0, 1, ...])."""
        impl, extra = VARIANTS[name]
        self.port += 1
        before = [cluster.tx_bytes(n) for n in range(cluster.nodes)]
        procs = []
        # mpirun starts every node's rank itself; the launchers run one per node.
        for node in range(1 if impl == "mpi" else cluster.nodes):
            argv = self.argv(cluster, node, impl, model, extra, steps, warmup)
            if impl == "mpi":
                self._record(f"{name} {model}", "ip netns exec NODE0", argv)
            else:
                added = "".join(f"{k}={v} " for k, v in VARIANT_ENV.get(name, {}).items())
                self._record(f"{name} {model} node {node}",
                             f"GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 {added}ip netns exec NODE{node}", argv)
            p = cluster.popen(node, argv, env=self.env(cluster, name), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True)
            _children.append(p)
            procs.append(p)
            if node == 0 and impl != "mpi":
                time.sleep(1.0)  # node 0 hosts the rendezvous store
            elif 0 < node < cluster.nodes - 1:
                # ddprun's store ranks the other nodes by arrival: in node
                # order, the same in the run of S and of 2 S steps, so that
                # each node's start-up traffic (rank 0's broadcast) cancels.
                time.sleep(0.3)
        outs = [p.communicate(timeout=600) for p in procs]
        _children.clear()
        after = [cluster.tx_bytes(n) for n in range(cluster.nodes)]
        for node, (p, (out, err)) in enumerate(zip(procs, outs)):
            if p.returncode != 0:
                raise RuntimeError(f"{name} {model}: node {node} failed ({p.returncode}):\n{out}\n{err[-3000:]}")
        # ddp's fitted buckets, with the figures they were fitted to (DDP_LOG_BUCKETS=1 in the environment),
        # and the transport rank 0 announces for the whole group.
        transport = allreduce = None
        for _, err in outs:
            for line in err.splitlines():
                if "buckets fitted to the link" in line:
                    print(f"  {name} {model}: {line.strip()}", flush=True)
                found = re.search(r"ddp: transport (\S+ \(.*\))", line)
                if found:
                    transport = found.group(1)
                chosen = re.search(r"ddp: all-reduce (.*)$", line)
                if chosen:
                    allreduce = chosen.group(1)
        # Rank 0 prints it: the c10d rendezvous need not make node 0 rank 0.
        for out, _ in outs:
            match = re.search(r"(\{.*\"step_ms_median\".*\})", out)
            if match:
                result = json.loads(match.group(1))
                if transport:
                    result["transport"] = transport
                if allreduce:
                    result["allreduce"] = allreduce  # DDP's own choice, when it printed one
                return result, [a - b for a, b in zip(after, before)]
        raise RuntimeError(f"{name} {model}: no result on any node:\n" +
                           "\n".join(f"{out}\n{err[-3000:]}" for out, err in outs))

    def local(self, model, steps, warmup):
        """ddp_bench --mode local: the compute-only step, no process group (on the host)."""
        argv = [os.path.join(self.bin, "ddp_bench"), "--model", model, "--mode", "local", "--steps", str(steps),
                "--warmup", str(warmup)]
        self.commands.setdefault(f"local {model}", " ".join(["OMP_NUM_THREADS=1", os.path.relpath(argv[0], ROOT)]
                                                           + argv[1:]))
        p = subprocess.Popen(argv, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
        _children.append(p)
        out, err = p.communicate(timeout=600)
        _children.clear()
        if p.returncode != 0:
            raise RuntimeError(f"local {model} failed:\n{out}\n{err}")
        return json.loads(re.search(r"^(\{.*\})$", out, re.M).group(1))


def run_retrying(runner, results, cluster, name, model, steps, warmup):
    """runner.run, once more if a node fails: torch 2.11's gloo now and then
    aborts a Python rank (SIGABRT, the peer then reads "Connection reset by
    peer"). Each retry is recorded and reported; a second failure ends the run."""
    try:
        return runner.run(cluster, name, model, steps, warmup)
    except RuntimeError as error:
        first_line = str(error).splitlines()[0]
        print(f"retrying after a failed run: {first_line}", flush=True)
        results.setdefault("retries", []).append(f"{cluster.rate} {first_line}, {steps} steps")
        _kill_children()
        return runner.run(cluster, name, model, steps, warmup)


def machine_facts():
    facts = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                facts["cpu"] = line.split(":", 1)[1].strip()
                break
        facts["memory_gb"] = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (OSError, ValueError):
        pass
    try:
        import torch
        facts["torch"] = torch.__version__
    except ImportError:
        pass
    return facts


def measure(args, runner, selected):
    rates = args.rates.split(",")
    results = {"rates": {}, "local": {}}
    for model in MODELS:
        s, w = (args.transformer_steps, args.transformer_warmup) if model == "transformer" else (args.steps, args.warmup)
        locals_ = [runner.local(model, 2 * s, w) for _ in range(args.rounds)]
        results["local"][model] = {"ms": [r["step_ms_median"] for r in locals_], "parameters": locals_[0]["parameters"]}
        print("local", model, results["local"][model], flush=True)
    for rate in rates:
        with EmulatedCluster(nodes=args.nodes, rate=rate) as cluster:
            agent_dir = tempfile.mkdtemp(prefix="ddp_net_mpi_")
            try:
                runner.write_agent(cluster, agent_dir)
                for model in MODELS:
                    s, w = ((args.transformer_steps, args.transformer_warmup) if model == "transformer"
                            else (args.steps, args.warmup))
                    for rnd in range(args.rounds):
                        # Sweep and hooks only in the first `extra_rounds` rounds; the core in every round.
                        names = [n for n in (VARIANTS if rnd < args.extra_rounds else CORE) if n in selected]
                        for name in names:
                            t0 = time.time()
                            short, bs = run_retrying(runner, results, cluster, name, model, s, w)
                            long_, bl = run_retrying(runner, results, cluster, name, model, 2 * s, w)
                            e = results["rates"].setdefault(rate, {}).setdefault(model, {}).setdefault(
                                name, {"ms": [], **{f"bytes_node{n}": [] for n in range(cluster.nodes)},
                                       "buckets": None})
                            e["ms"] += [short["step_ms_median"], long_["step_ms_median"]]
                            for n in range(cluster.nodes):
                                e[f"bytes_node{n}"].append((bl[n] - bs[n]) / s)
                            e["buckets"] = long_.get("buckets")
                            if long_.get("transport"):
                                e["transport"] = long_["transport"]
                            if long_.get("allreduce"):
                                e["allreduce"] = long_["allreduce"]
                            per_node = [(l - b) / s / 1e6 for l, b in zip(bl, bs)]
                            print(f"{rate} {model} {name}: {short['step_ms_median']:.1f} / {long_['step_ms_median']:.1f}"
                                  f" ms, {sum(per_node):.2f} MB/step, busiest node {max(per_node):.2f}"
                                  f" ({time.time() - t0:.0f} s)", flush=True)
            finally:
                _kill_children()  # before the namespaces go, so none outlives them
                shutil.rmtree(agent_dir, ignore_errors=True)
    return results


def ring_mb_per_node(parameters, nodes):
    """What each rank sends per all-reduce of fp32 gradients in a ring:
    2 (N - 1) / N of them (reduce-scatter, then all-gather)."""
    return 2 * (nodes - 1) / nodes * parameters * 4 / 1e6


def summarize(results, rates, nodes=2):
    """Medians, ratios and the bound, per rate and model."""
    summary = {}
    for rate in rates:
        for model in MODELS:
            by = results["rates"][rate][model]
            compute = statistics.median(results["local"][model]["ms"])
            ring_mb = ring_mb_per_node(results["local"][model]["parameters"], nodes)
            rows = {}
            for name, e in by.items():
                per_node = [statistics.median(v) for k, v in e.items() if k.startswith("bytes_node")]
                rows[name] = {"ms": statistics.median(e["ms"]), "mb_per_step": sum(per_node) / 1e6,
                              "mb_per_node": max(per_node) / 1e6, "buckets": e["buckets"],
                              "runs": len(e["ms"]), "transport": e.get("transport"),
                              "allreduce": e.get("allreduce")}
            # Every node sends its share of the ring on its own link, all at
            # once: the wire time is the busiest link's bytes / rate. ddp's
            # measured bytes (2 (N - 1) / N of the gradients plus TCP/IP
            # headers); the ring's volume alone where ddp was not run.
            wire_mb = rows["ddp"]["mb_per_node"] if "ddp" in rows else ring_mb
            wire_ms = wire_mb * 1e6 * 8 / _rate_bits(rate) * 1000
            bound = max(compute, wire_ms)

            def ratio(a, b):
                return rows[a]["ms"] / rows[b]["ms"] if a in rows and b in rows else None

            summary.setdefault(rate, {})[model] = {
                "rows": rows, "compute_ms": compute, "wire_ms": wire_ms, "bound_ms": bound,
                "ring_mb_per_node": ring_mb,
                "ddp_over_python": ratio("ddp", "python"),
                "no_overlap_over_overlap": ratio("no-overlap", "ddp"),
                "ddp_over_bound": rows["ddp"]["ms"] / bound if "ddp" in rows else None,
                "powersgd_over_ddp": ratio("powersgd-4", "ddp"),
                "powersgd_over_python_powersgd": ratio("powersgd-4", "python-powersgd-4"),
                "bf16_over_python_bf16": ratio("bf16", "python-bf16"),
                "mpi_over_gloo": ratio("ddp-mpi", "ddp"),
                # The opt-ins for a slow link: 5 MB buckets, optimizer stepped in backward.
                "tuned_over_python": ratio("bucket-5-step-in-backward", "python"),
                "tuned_over_python_tuned": ratio("bucket-5-step-in-backward", "python-bucket-5-fused-optim"),
                "tuned_over_bound": (rows["bucket-5-step-in-backward"]["ms"] / bound
                                     if "bucket-5-step-in-backward" in rows else None),
                "no_overlap_over_tuned": ratio("no-overlap", "bucket-5-step-in-backward"),
                "step_in_backward_gain": ratio("bucket-5-step-in-backward", "bucket-5"),
            }
    return summary


def chart(summary, rates, path, nodes=2, nproc=1):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(rates), len(MODELS), figsize=(13, 4.2 * len(rates)), squeeze=False)
    for i, rate in enumerate(rates):
        for j, model in enumerate(MODELS):
            ax = axes[i][j]
            s = summary[rate][model]
            shown = [n for n in ORDER if n in s["rows"]]
            values = [s["rows"][n]["ms"] for n in shown]
            colors = ["tab:orange" if n.startswith("python") else "tab:purple" if n == "ddp-mpi" else "tab:blue"
                      for n in shown]
            bars = ax.bar(range(len(shown)), values, color=colors)
            ax.bar_label(bars, labels=[f"{v:.0f} ms\n{s['rows'][n]['mb_per_step']:.1f} MB" for n, v in
                                       zip(shown, values)], fontsize=7)
            ax.axhline(s["compute_ms"], color="green", linestyle="--", linewidth=1,
                       label=f"compute only {s['compute_ms']:.0f} ms")
            ax.axhline(s["bound_ms"], color="red", linestyle=":", linewidth=1,
                       label=f"bound {s['bound_ms']:.0f} ms (wire {s['wire_ms']:.0f} ms)")
            serial = s["compute_ms"] + s["wire_ms"]
            ax.axhline(serial, color="gray", linestyle="-.", linewidth=1,
                       label=f"compute + wire, nothing overlapped {serial:.0f} ms")
            ax.set_xticks(range(len(shown)), shown, rotation=30, fontsize=8)
            ax.set_ylabel("median ms per step (labels: MB on the wire per step)")
            ax.set_ylim(0, max(values + [serial]) * 1.3)
            ax.set_title(f"{MODELS[model]}, {rate}/s links, {nodes} nodes x {nproc} rank{'s' if nproc > 1 else ''}"
                         + (", gloo" if nproc == 1 else "")
                         + (" (ddp-mpi: mpi)" if "ddp-mpi" in shown else ""), fontsize=10)
            ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def noise_note(results, rates):
    """How far apart ddp's own runs (or the first core variant's) were: what a difference must exceed to mean
    something."""
    spreads = []
    for rate in rates:
        for model in MODELS:
            by = results["rates"][rate][model]
            name = next((n for n in CORE + list(VARIANTS) if n in by), None)
            if name:
                ms = by[name]["ms"]
                spreads.append((max(ms) / min(ms) - 1, rate, model, len(ms), name))
    if not spreads:
        return ""
    worst = max(spreads)
    return (f"Noise: {worst[4]}'s own runs (same settings, {worst[3]} per cell) spread by up to {worst[0] * 100:.0f}% "
            f"(max / min, {worst[2]} at {worst[1]}); the sweep and the hooks have one round, so differences "
            "of that size between them are not significant.")


def verdict(ok):
    return "**met**" if ok else "**missed**"


def render(args, results, summary, rates, facts, runner, elapsed):
    n = args.nodes
    nodes = ", ".join(str(i) for i in range(n))
    all_nodes = "both nodes" if n == 2 else f"all {n} nodes"
    measured = [name for name in ORDER if any(name in by for r in rates for by in results["rates"][r].values())]
    mpi = "ddp-mpi" in measured
    ring = " ".join(f"{MODELS[m]} {ring_mb_per_node(results['local'][m]['parameters'], n):.1f} MB;" for m in MODELS)
    lines = [
        "# ddp on an emulated cluster network",
        "",
        "Written by `bench/run_net_bench.py` (`make bench-net`, as root); the figures below are one run's. "
        "Issue 25, items 1 and 2.",
        "",
        "## Set-up",
        "",
        f"- {n} nodes, one rank each. Each node is a network namespace with address 10.213.90.N on `eth0`, a veth "
        "whose other end is a port of a bridge in a namespace of its own (the switch). Each link is limited in both "
        "directions with `tc qdisc ... tbf rate R burst max(256 KB, 1 ms of R) latency 100ms` (this kernel has tbf, "
        "not netem: no added delay). Everything is deleted on exit, on an exception, on SIGINT and SIGTERM "
        "(bench/emulated_cluster.py); the benchmark's processes are killed first.",
        f"- ddp: `ddprun --nnodes {n} --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.213.90.1:PORT "
        f"build/bin/ddp_bench ...`. Python DDP: `python -m torch.distributed.run --nnodes {n} --nproc-per-node 1 "
        "--rdzv-backend c10d --rdzv-endpoint 10.213.90.1:PORT --local-addr 10.213.90.N [--rdzv-conf is_host=true on "
        "node 0] bench/python_ddp_bench.py ...`. Both with `GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1`, backend gloo, "
        "the same model, data, seeds, batch (mlp2m 64, transformer 8 per rank) and Adam; one intra-op thread per rank."
        + (" ddp-mpi: the same `ddp_bench` with `--backend mpi`, one rank per node started by one `mpirun` in node "
           "0's namespace (under `unshare --uts`, host name node0) whose launch agent enters the other nodes' "
           "namespaces, each with a host name of its own; `--mca btl tcp,self --mca pml ob1` so that no shared "
           "memory or UCX carries bytes between the nodes, `--bind-to none` (each namespace looks like the whole "
           "machine to Open MPI), `--mca mpi_yield_when_idle 1` (a waiting rank yields the core it shares with "
           "another node's rank here, where on a real node it would spin on a core of its own) and `-x OMP_NUM_THREADS=1` (commands below)." if mpi else ""),
        f"- Steps: mlp2m {args.warmup} warm-up + S = {args.steps} (and 2 S) timed; transformer "
        f"{args.transformer_warmup} warm-up + S = {args.transformer_steps} (and 2 S) timed, fewer to keep the "
        f"whole run near 15 minutes. {args.rounds} rounds for ddp, Python DDP"
        + (", no-overlap and ddp-mpi" if mpi else " and no-overlap") + ", interleaved; "
        f"{args.extra_rounds} for the sweep and the hooks (interleaved with the others in that round).",
        "- **ms per step**: the median over runs of each run's median step (rank 0's clock). "
        + noise_note(results, rates),
        f"- **MB per step**: what {all_nodes} sent (`/sys/class/net/eth0/statistics/tx_bytes`, so TCP/IP headers "
        "included, read in each node's namespace before and after each run), as the difference between a run of "
        "2 S steps and a run of S steps, divided by S: start-up (rendezvous, the parameter broadcast, warm-up, "
        "teardown) cancels out. Median over rounds. **per node** is the "
        + ("larger" if n == 2 else "largest") + " node's share.",
        "- **compute only**: `ddp_bench --mode local` (no process group, no communication), on the host, same "
        "threads. **wire**: ddp's measured bytes per node per step ÷ link rate (each node's link carries its own "
        f"share at the same time; a ring all-reduce over {n} ranks sends 2 ({n} - 1) / {n} = {2 * (n - 1) / n:g} "
        "times the gradients from "
        f"each rank: {ring} the measured bytes add TCP/IP headers). **bound** = max(compute only, wire).",
        f"- Machine: {facts.get('cpus')} CPUs ({facts.get('cpu', '?')}), {facts.get('memory_gb', '?')} GB, "
        f"Linux {facts.get('kernel')}, torch {facts.get('torch', '?')}, Python {facts.get('python')}. "
        + ("Both ranks share" if n == 2 else f"All {n} ranks share")
        + f" these {facts.get('cpus')} cores, so compute-only is one rank alone; "
        + ("with two ranks the cores are shared with the other rank" if n == 2 else
           f"with {n} ranks the cores are shared with the other ranks") + " and with gloo's threads. "
        f"The whole run took {elapsed / 60:.1f} min.",
        "",
    ]
    for name, why in results.get("skipped", {}).items():
        lines[-1:-1] = [f"- {name} was not run: {why}."]
    if results.get("retries"):
        lines[-1:-1] = [f"- Runs retried once after a node failed (torch's gloo aborting a rank now and then; "
                        f"the retry's figures are the ones shown): {'; '.join(results['retries'])}."]
    for rate in rates:
        lines += [f"## {rate}/s links" if n == 2 else f"## {n} nodes, {rate}/s links", ""]
        for model in MODELS:
            s = summary[rate][model]
            params = results["local"][model]["parameters"]
            lines += [
                f"### {MODELS[model]} ({params / 1e6:.2f} M parameters, {params * 4 / 1e6:.1f} MB of fp32 gradients)",
                "",
                f"compute only {s['compute_ms']:.1f} ms; wire {s['wire_ms']:.1f} ms; bound {s['bound_ms']:.1f} ms.",
                "",
                f"| variant | ms per step | / ddp | / Python DDP | / bound | MB per step ({all_nodes}) | MB per node "
                "| buckets |",
                "|---|---|---|---|---|---|---|---|",
            ]
            rows = s["rows"]

            def over(r, base):
                return f"{r['ms'] / rows[base]['ms']:.2f}" if base in rows else ""

            for name in ORDER:
                if name not in rows:
                    continue
                r = rows[name]
                lines.append(f"| {LABELS[name]} | {r['ms']:.1f} | {over(r, 'ddp')} | {over(r, 'python')} | "
                             f"{r['ms'] / s['bound_ms']:.2f} | {r['mb_per_step']:.2f} | {r['mb_per_node']:.2f} | "
                             f"{r['buckets'] or ''} |")
            ratios = [(label, s[key]) for label, key in (
                ("ddp / Python DDP", "ddp_over_python"), ("no-overlap / overlap", "no_overlap_over_overlap"),
                ("ddp / bound", "ddp_over_bound"), ("PowerSGD rank 4 / ddp", "powersgd_over_ddp"),
                ("PowerSGD rank 4, ddp / Python", "powersgd_over_python_powersgd"),
                ("bf16 hook, ddp / Python", "bf16_over_python_bf16"),
                ("ddp-mpi / ddp (gloo)", "mpi_over_gloo"),
                ("5 MB buckets + optimizer in backward, ddp / Python DDP", "tuned_over_python"),
                ("the same opt-ins on both sides, ddp / Python", "tuned_over_python_tuned"),
                ("5 MB buckets, optimizer in backward / after backward", "step_in_backward_gain")) if s.get(key)]
            lines += ["", "; ".join(f"{label} {value:.2f}" for label, value in ratios) + ".", ""]
    g = summary.get("1gbit")
    lines += ["## Issue 25's goals that this benchmark measures" + ("" if n == 2 else f" ({n} nodes)"), ""]
    if g and "transformer" in g and "mlp2m" in g and all(
            g["transformer"][k] for k in ("ddp_over_python", "ddp_over_bound", "no_overlap_over_overlap")):
        t, m = g["transformer"], g["mlp2m"]
        lines += [
            "| goal | figure | |",
            "|---|---|---|",
            f"| transformer, 1 Gbit/s: ddp / Python DDP ≤ 0.9 | {t['ddp_over_python']:.2f} "
            f"({t['rows']['ddp']['ms']:.0f} / {t['rows']['python']['ms']:.0f} ms) | {verdict(t['ddp_over_python'] <= 0.9)} |",
            f"| transformer, 1 Gbit/s: ddp step ≤ 1.3 × max(compute only, wire) | {t['ddp_over_bound']:.2f} × "
            f"({t['rows']['ddp']['ms']:.0f} ms vs max({t['compute_ms']:.0f}, {t['wire_ms']:.0f}) ms) | "
            f"{verdict(t['ddp_over_bound'] <= 1.3)} |",
            f"| transformer, 1 Gbit/s: no-overlap / overlap ≥ 1.25 | {t['no_overlap_over_overlap']:.2f} | "
            f"{verdict(t['no_overlap_over_overlap'] >= 1.25)} |",
        ]
        if t.get("tuned_over_python") and t.get("tuned_over_bound") and t.get("no_overlap_over_tuned"):
            tuned = t["rows"]["bucket-5-step-in-backward"]["ms"]
            lines += [
                f"| the same three with two opt-ins for a slow link, `DDPOptions().bucket_cap_mb(5)` and "
                f"`model.step_in_backward(optimizer)`: ddp / Python DDP ≤ 0.9 | {t['tuned_over_python']:.2f} "
                f"({tuned:.0f} / {t['rows']['python']['ms']:.0f} ms) | {verdict(t['tuned_over_python'] <= 0.9)} |",
                f"| … ddp step ≤ 1.3 × bound | {t['tuned_over_bound']:.2f} × ({tuned:.0f} ms vs "
                f"{t['bound_ms']:.0f} ms) | {verdict(t['tuned_over_bound'] <= 1.3)} |",
                f"| … no-overlap / overlap ≥ 1.25 | {t['no_overlap_over_tuned']:.2f} ({t['rows']['no-overlap']['ms']:.0f}"
                f" / {tuned:.0f} ms) | {verdict(t['no_overlap_over_tuned'] >= 1.25)} |",
            ]
            if t.get("tuned_over_python_tuned"):
                lines.append(
                    f"| (not a goal) the same opt-ins on both sides: ddp / Python DDP with 5 MB buckets and "
                    f"`_register_fused_optim` | {t['tuned_over_python_tuned']:.2f} ({tuned:.0f} / "
                    f"{t['rows']['python-bucket-5-fused-optim']['ms']:.0f} ms) | |")
        if m["powersgd_over_ddp"]:
            lines.append(
                f"| 2M MLP, 1 Gbit/s: PowerSGD rank 4 step ≤ 0.4 × uncompressed ddp | {m['powersgd_over_ddp']:.2f} "
                f"({m['rows']['powersgd-4']['ms']:.0f} / {m['rows']['ddp']['ms']:.0f} ms) | "
                f"{verdict(m['powersgd_over_ddp'] <= 0.4)} (step time only; accuracy is the PowerSGD tests' part) |")
        lines.append("")
    else:
        lines += ["Not all of them: they need ddp, Python DDP and no-overlap on both models at 1gbit.", ""]
    buckets = [name for name in ("bucket-1", "bucket-5", "bucket-25", "bucket-100") if g and name in g.get("transformer", {}).get(
        "rows", {})]
    if buckets and "ddp" in g["transformer"]["rows"]:
        t = g["transformer"]
        serial = t["compute_ms"] + t["wire_ms"]
        best = min(buckets, key=lambda name: t["rows"][name]["ms"])
        lines += [
            "Where the transformer's step goes at 1 Gbit/s: compute only plus wire, with nothing overlapped, is "
            f"{t['compute_ms']:.0f} + {t['wire_ms']:.0f} = {serial:.0f} ms, and ddp takes {t['rows']['ddp']['ms']:.0f} ms "
            f"({t['rows']['ddp']['ms'] / serial:.2f} of that sum), with its default buckets ({t['rows']['ddp']['buckets']} "
            f"buckets for {results['local']['transformer']['parameters'] * 4 / 1e6:.0f} MB); whatever of the "
            "all-reduce runs after backward has ended is exposed (the figures suggest; not traced here). "
            f"The smallest step of the sweep is {best} ({t['rows'][best]['ms']:.0f} ms, "
            f"{t['rows'][best]['ms'] / t['rows']['ddp']['ms']:.2f} of ddp's), more buckets starting earlier. "
            f"{'Both' if n == 2 else f'All {n}'} ranks share the {facts.get('cpus')} cores with gloo's threads, so "
            "the compute-only step (one rank alone) is itself optimistic for a step with communication in flight.",
            "",
        ]
    missing = ["the wine_ddp per-epoch goal and the MPI small-message goals (other items of issue 25: "
               "`bench/PROFILE.md`, `bench/RESULTS.md`)"]
    if n == 2:
        four = output_paths(".", 4)[0]
        missing.append(f"4 nodes: [{os.path.basename(four)}]({os.path.basename(four)}) "
                       "(`--nodes 4`, a run and a page of its own)")
    if not mpi:
        missing.append("MPI on the emulated network (variant ddp-mpi)")
    two_by_two = output_paths(".", 2, 2)
    missing.append(f"several ranks per node, hierarchical shared memory + Gloo against flat Gloo: "
                   f"[{os.path.basename(two_by_two[0])}]({os.path.basename(two_by_two[0])}) (`--nproc-per-node 2`)")
    lines += four_ranks_section(args) if n == 4 else []
    options = "".join(f" --{key.replace('_', '-')} {getattr(args, key)}" for key, default in (
        ("nodes", 2), ("variants", "all"), ("models", ",".join(MODELS_ALL))) if getattr(args, key) != default)
    lines += [
        "Not measured here: " + "; ".join(missing) + ".",
        "",
        f"![step times]({os.path.basename(output_paths('.', n)[2])})",
        "",
        "## Commands",
        "",
        f"`sudo python bench/run_net_bench.py --build-dir build --rates {args.rates} --steps {args.steps} "
        f"--warmup {args.warmup} --transformer-steps {args.transformer_steps} --transformer-warmup "
        f"{args.transformer_warmup} --rounds {args.rounds} --extra-rounds {args.extra_rounds}{options}` "
        + ("(what `make bench-net` runs, with the venv's python)" if not options else "(with the venv's python)")
        + ". Each run, node 0 started first and given 1 s to host the store (NODEn: the "
        "node's namespace; STEPS: S, then 2 S; WARMUP: 3 for mlp2m, 2 for the transformer; PORT: a fresh one per run; "
        "VENV: the torch venv of build/.venv-path):",
        "",
        "```",
        "# compute only, on the host",
        "OMP_NUM_THREADS=1 build/bin/ddp_bench --model MODEL --mode local --steps STEPS --warmup WARMUP",
        f"# ddp, on node n = {nodes}",
        "GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec NODEn build/bin/ddprun "
        f"--nnodes {n} --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.213.90.1:PORT build/bin/ddp_bench "
        "--model MODEL --steps STEPS --warmup WARMUP VARIANT",
        f"# Python DDP, on node n = {nodes} (10.213.90.<n+1> is node n)",
        "GLOO_SOCKET_IFNAME=eth0 OMP_NUM_THREADS=1 ip netns exec NODEn VENV/bin/python -m torch.distributed.run "
        f"--nnodes {n} --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint 10.213.90.1:PORT --local-addr "
        "10.213.90.<n+1> [--rdzv-conf is_host=true: node 0 only] bench/python_ddp_bench.py --model MODEL --steps "
        "STEPS --warmup WARMUP --mode ddp",
    ]
    if mpi:
        example = next((c for key, c in runner.commands.items()
                        if key.startswith("ddp-mpi ") and key != "ddp-mpi AGENT"), None)
        lines += ["# ddp-mpi: one mpirun, in node 0's namespace, for every node's rank (this run's mlp2m or "
                  "transformer command; AGENT below)", example or "(not recorded)",
                  "# AGENT: Open MPI's launch agent, HOST COMMAND...",
                  runner.commands.get("ddp-mpi AGENT", "").rstrip()]
    lines += [
        "```",
        "",
        "| variant | VARIANT |",
        "|---|---|",
    ]
    for name in [name for name in VARIANTS if name in measured]:
        impl, extra = VARIANTS[name]
        lines.append(f"| {name} | `{' '.join(extra)}`" + {"py": " (python_ddp_bench.py)", "mpi": " (under mpirun)"}.get(
            impl, "") + " |")
    lines += [""]
    return "\n".join(lines)


def render_ranks(args, results, summary, rates, facts, runner, elapsed):
    """The page for several ranks per node (--nproc-per-node > 1): which
    transport carries the gradients inside a node and between nodes."""
    n, k = args.nodes, args.nproc_per_node
    ranks = n * k
    lines = [
        f"# ddp on an emulated cluster: {n} nodes × {k} ranks",
        "",
        f"Written by `bench/run_net_bench.py --nproc-per-node {k}` (as root); the figures below are one run's. "
        "Issue 37: hierarchical shared memory + Gloo against flat Gloo.",
        "",
        "## Set-up",
        "",
        f"- {n} nodes of {k} ranks. Each node is a network namespace with address 10.213.90.N on `eth0`, a veth to a "
        "bridge in a namespace of its own (the switch), limited in both directions with `tc qdisc ... tbf rate R burst "
        "max(256 KB, 1 ms of R) latency 100ms` (bench/emulated_cluster.py). The ranks of one node share its namespace, "
        "so what they send each other goes over the namespace's loopback (Gloo) or shared memory, and only what "
        "crosses between nodes is counted and rate-limited on `eth0`. ddp treats each network namespace as a host "
        "(`shm_host_identity`), so shared memory is used only inside a node.",
        f"- ddp: one `ddprun --nnodes {n} --nproc-per-node {k} --rdzv-backend c10d` per node running "
        "`build/bin/ddp_bench --model MODEL --mode ddp --backend auto ...` (ddp_bench pins `--backend gloo` unless "
        "told otherwise; `auto` is what a program gets that does not choose). Python DDP: one torchrun per node, "
        "`bench/python_ddp_bench.py`, backend gloo, PyTorch's defaults. Every rank: `GLOO_SOCKET_IFNAME=eth0 "
        "OMP_NUM_THREADS=1`, one intra-op thread, the same model, data, seeds, batch (transformer 8 per rank) and Adam.",
        "- Variants: **(a) flat-gloo**: DDP over all ranks with `DDP_SHM=0 DDP_HIERARCHICAL=0`, so every group is Gloo and the all-reduce flat; "
        "**(b) hier-shm**: DDP with `ddp::hierarchical_allreduce_hook(DeviceMesh::from_launcher(group))` "
        "(`--comm-hook hierarchical`): each bucket is reduced to the node's first rank over the node's group, "
        "all-reduced between the node leaders, broadcast back in the node; the node groups are shared memory "
        "(ddp's automatic choice for a group on one host) and the leaders' group Gloo; **hier-gloo**: the same "
        "hook with `DDP_SHM=0` (Gloo over loopback in the node), to tell the hook's gain from shared memory's; "
        "**(c) ddp-auto**: ddp's default, no hook; **python**: PyTorch's DDP. Buckets are ddp's default "
        "(fitted to the link after the first step) in every ddp variant; the transport column is the line "
        "rank 0 prints for DDP's own group (`ddp: transport ...`).",
        f"- Steps: transformer {args.transformer_warmup} warm-up + S = {args.transformer_steps} (and 2 S) timed, "
        f"mlp2m {args.warmup} + {args.steps}; {args.rounds} rounds, the variants interleaved in each. "
        "**ms per step**: the median over runs of each run's median step (rank 0's clock). **MB per node**: what "
        "the busiest node sent on `eth0` per step (tx_bytes, the run of 2 S steps minus the run of S, divided by S), "
        "i.e. only what crosses between nodes. **wire** = MB per node ÷ link rate. **compute only**: one rank alone "
        "(`ddp_bench --mode local`) on the host.",
        f"- Machine: {facts.get('cpus')} CPUs ({facts.get('cpu', '?')}), {facts.get('memory_gb', '?')} GB, "
        f"Linux {facts.get('kernel')}, torch {facts.get('torch', '?')}. All {ranks} ranks share these "
        f"{facts.get('cpus')} cores, so a step is at least about {ranks / max(1, facts.get('cpus') or 1):g}× "
        f"the compute-only step. The whole run took {elapsed / 60:.1f} min.",
        "",
    ]
    if results.get("retries"):
        lines[-1:-1] = [f"- Runs retried once after a node failed: {'; '.join(results['retries'])}."]
    for rate in rates:
        for model in MODELS:
            s = summary[rate][model]
            rows = s["rows"]
            rate_bytes = _rate_bits(rate) / 8
            params = results["local"][model]["parameters"]
            lines += [f"## {MODELS[model]}, {rate}/s links ({params / 1e6:.2f} M parameters, "
                      f"{params * 4 / 1e6:.1f} MB of fp32 gradients)", "",
                      f"compute only (one rank alone) {s['compute_ms']:.1f} ms.", "",
                      "| variant | ms per step | / (a) flat Gloo | / Python DDP | MB per node per step (crossing) "
                      "| wire ms | buckets | transport of DDP's group | runs (spread) |",
                      "|---|---|---|---|---|---|---|---|---|"]

            def over(name, base):
                return f"{rows[name]['ms'] / rows[base]['ms']:.2f}" if base in rows else ""

            for name in ORDER:
                if name not in rows:
                    continue
                r = rows[name]
                ms = results["rates"][rate][model][name]["ms"]
                lines.append(f"| {LABELS[name]} | {r['ms']:.1f} | {over(name, 'flat-gloo')} | {over(name, 'python')} | "
                             f"{r['mb_per_node']:.2f} | {r['mb_per_node'] * 1e6 / rate_bytes * 1000:.0f} | "
                             f"{r['buckets'] or ''} | {r.get('transport') or ''} | {r['runs']} "
                             f"({max(ms) / min(ms) - 1:.0%}) |")
            ratios = []
            for label, a, b in (("(b) hierarchical shm + Gloo / (a) flat Gloo", "hier-shm", "flat-gloo"),
                                ("(c) ddp's default / (a) flat Gloo", "ddp-auto", "flat-gloo"),
                                ("hierarchical, Gloo in the node / (a) flat Gloo", "hier-gloo", "flat-gloo"),
                                ("hierarchical: shared memory / Gloo in the node", "hier-shm", "hier-gloo"),
                                ("(b) / Python DDP", "hier-shm", "python"),
                                ("(a) / Python DDP", "flat-gloo", "python")):
                if a in rows and b in rows:
                    ratios.append(f"{label} **{rows[a]['ms'] / rows[b]['ms']:.2f}**")
            lines += ["", "; ".join(ratios) + ".", ""]
    lines += ["## Commands", "",
              f"`sudo python bench/run_net_bench.py --build-dir build --nproc-per-node {k} --nodes {n} --rates "
              f"{args.rates} --models {args.models} --variants {args.variants} --steps {args.steps} --warmup "
              f"{args.warmup} --transformer-steps {args.transformer_steps} --transformer-warmup "
              f"{args.transformer_warmup} --rounds {args.rounds} --extra-rounds {args.extra_rounds} --out-dir bench` "
              "(with the venv's python, under `flock /tmp/ddp-build.lock`). Each run, per node (NODEn: the node's "
              "namespace; STEPS: S, then 2 S; PORT: a fresh one per run); the exact lines of this run:", "", "```"]
    for key, command in sorted(runner.commands.items()):
        if key.endswith("node 0") or key.startswith("local"):
            lines.append(f"# {key}")
            lines.append(command)
    lines += ["```", "", f"The json: `bench/{os.path.basename(output_paths('.', n, k)[1])}`.", ""]
    return "\n".join(lines)


def four_ranks_section(args):
    """For the 4-node page: 4 ranks as 2 nodes x 2 ranks instead, from the
    2x2 run's json (bench/network_2x2.json) when there is one."""
    path = output_paths(args.out_dir, 2, 2)[1]
    if not os.path.exists(path):
        return []
    saved = json.load(open(path))
    lines = ["## 4 ranks as 2 nodes × 2 ranks: hierarchical shared memory + Gloo against flat Gloo (issue 37)", "",
             f"From [{os.path.basename(output_paths('.', 2, 2)[0])}]({os.path.basename(output_paths('.', 2, 2)[0])}) "
             "(its set-up, noise and commands are there):", "",
             "| rate | model | variant | ms per step | / (a) flat Gloo | MB per node per step (crossing) |",
             "|---|---|---|---|---|---|"]
    for rate, by_model in saved["summary"].items():
        for model, s in by_model.items():
            rows = s["rows"]
            for name in ORDER:
                if name in rows:
                    ratio = f"{rows[name]['ms'] / rows['flat-gloo']['ms']:.2f}" if "flat-gloo" in rows else ""
                    lines.append(f"| {rate} | {model} | {LABELS[name]} | {rows[name]['ms']:.1f} | {ratio} | "
                                 f"{rows[name]['mb_per_node']:.2f} |")
    return lines + [""]


def output_paths(out_dir, nodes, nproc=1):
    """NETWORK.md, network.json and NETWORK.png for 2 nodes; other sizes get
    files of their own (NETWORK_4NODES.md, NETWORK_2X2.md for 2 nodes of 2
    ranks, ...), so all can stand."""
    suffix = "" if nodes == 2 and nproc == 1 else f"_{nodes}nodes" if nproc == 1 else f"_{nodes}x{nproc}"
    return (os.path.join(out_dir, f"NETWORK{suffix.upper()}.md"), os.path.join(out_dir, f"network{suffix}.json"),
            os.path.join(out_dir, f"NETWORK{suffix.upper()}.png"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", default=sys.executable, help="the Python with torch, for torchrun")
    parser.add_argument("--rates", default="1gbit,10gbit")
    parser.add_argument("--steps", type=int, default=10, help="S for mlp2m (runs of S and 2 S)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--transformer-steps", type=int, default=4)
    parser.add_argument("--transformer-warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of ddp, Python DDP, no-overlap and ddp-mpi")
    parser.add_argument("--extra-rounds", type=int, default=1, help="rounds of the sweep and the hooks")
    parser.add_argument("--models", default=",".join(MODELS), help="a subset, for quick checks")
    parser.add_argument("--variants", default="all", help="a subset of " + ",".join(VARIANTS) + ", for quick checks")
    parser.add_argument("--nodes", type=int, default=2, help="nodes of the emulated cluster")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks per node (> 1: the page NETWORK_<nodes>X<n>.md, transports in and between nodes)")
    parser.add_argument("--out-dir", default=HERE)
    parser.add_argument("--from-json", help="re-render NETWORK.md and NETWORK.png from a network.json, no run")
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.from_json:
        saved = json.load(open(args.from_json))
        for key, value in saved["args"].items():
            if key not in ("out_dir", "from_json"):
                setattr(args, key, value)
        rates = args.rates.split(",")
        for name in list(MODELS):
            if name not in args.models.split(","):
                del MODELS[name]
        runner = Runner(args)
        runner.commands = saved["commands"]
        nproc = getattr(args, "nproc_per_node", 1)
        args.nproc_per_node = nproc
        summary = summarize(saved["raw"], rates, args.nodes)
        md_path, _, png_path = output_paths(args.out_dir, args.nodes, nproc)
        chart(summary, rates, png_path, args.nodes, nproc)
        page = render_ranks if nproc > 1 else render
        with open(md_path, "w") as f:
            f.write(page(args, saved["raw"], summary, rates, saved["machine"], runner, saved["elapsed_s"]))
        return
    if os.geteuid() != 0:
        sys.exit("run_net_bench.py creates network namespaces: run it as root (sudo make bench-net)")
    if args.nodes < 2:
        parser.error("--nodes: at least 2")
    selected = list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    if set(selected) - set(VARIANTS):
        parser.error(f"--variants: unknown {','.join(sorted(set(selected) - set(VARIANTS)))}; "
                     f"known: {','.join(VARIANTS)}")
    skipped = {}
    why = mpi_missing(os.path.join(os.path.abspath(args.build_dir), "bin")) if "ddp-mpi" in selected else None
    if why:
        print(f"ddp-mpi skipped: {why}", flush=True)
        selected.remove("ddp-mpi")
        skipped["ddp-mpi"] = why
    rates = args.rates.split(",")
    for name in list(MODELS):
        if name not in args.models.split(","):
            del MODELS[name]
    runner = Runner(args)
    start = time.time()
    try:
        results = measure(args, runner, selected)
    except KeyboardInterrupt:
        _kill_children()
        sys.exit("interrupted; namespaces removed")
    finally:
        _kill_children()
    elapsed = time.time() - start
    if skipped:
        results["skipped"] = skipped
    summary = summarize(results, rates, args.nodes)
    facts = machine_facts()
    md_path, json_path, png_path = output_paths(args.out_dir, args.nodes, args.nproc_per_node)
    with open(json_path, "w") as f:
        json.dump({"args": vars(args), "machine": facts, "elapsed_s": round(elapsed, 1), "raw": results,
                   "summary": summary, "commands": runner.commands}, f, indent=1)
    chart(summary, rates, png_path, args.nodes, args.nproc_per_node)
    text = (render_ranks if args.nproc_per_node > 1 else render)(args, results, summary, rates, facts, runner, elapsed)
    with open(md_path, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
