"""An emulated cluster on one machine, for benchmarks across "nodes".

Each node is a network namespace with its own address, joined to the others
through a bridge in a namespace of its own (the switch). Each node's link is
rate-limited in both directions with tc's tbf (this machine's kernel has tbf
and htb, not netem): egress on the node's end and on the switch's end.

    with EmulatedCluster(nodes=2, rate="1gbit") as cluster:
        p = cluster.popen(0, ["ddprun", ...])          # runs inside node 0
        cluster.tx_bytes(0)                             # what node 0 has sent

Needs root and iproute2. Every namespace (and with it every veth and qdisc)
is deleted on exit, on an exception, and on SIGINT or SIGTERM, after the
processes still running in it are ended.
"""
import os
import signal
import subprocess
import time

SUBNET = "10.213.90"


def _run(argv):
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def _running(pid):
    """Whether `pid` still runs (a zombie, waiting to be reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _burst(rate):
    """A tbf bucket that holds a few of veth's 64 KB GSO packets and about
    1 ms of traffic at `rate`, whichever is larger."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for suffix, scale in units.items():
        if rate.endswith(suffix):
            bits = float(rate[: -len(suffix)]) * scale
            return max(256 * 1024, int(bits / 8 / 1000))
    raise ValueError(f"rate must end in kbit, mbit or gbit, not {rate!r}")


class EmulatedCluster:
    def __init__(self, nodes=2, rate=None, prefix="ddpb"):
        tag = f"{prefix}{os.getpid()}"
        self.nodes = nodes
        self.rate = rate
        self.switch = f"{tag}sw"
        self.namespaces = [f"{tag}n{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.interface = "eth0"  # every node's end of its link
        self._previous = {}

    # --- set-up and teardown ---------------------------------------------

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc):
        self.remove()
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _on_signal(self, signum, frame):
        self.remove()
        raise KeyboardInterrupt(f"signal {signum}")

    def _build(self):
        _run(["ip", "netns", "add", self.switch])
        _run(["ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge"])
        _run(["ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up"])
        for i, ns in enumerate(self.namespaces):
            port = f"p{i}"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "link", "add", f"{ns}e", "type", "veth", "peer", "name", f"{ns}p"])
            _run(["ip", "link", "set", f"{ns}e", "netns", ns])
            _run(["ip", "link", "set", f"{ns}p", "netns", self.switch])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", f"{ns}e", "name", self.interface])
            _run(["ip", "netns", "exec", self.switch, "ip", "link", "set", f"{ns}p", "name", port])
            _run(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.addresses[i]}/24", "dev", self.interface])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", self.interface, "up"])
            _run(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])
            _run(["ip", "netns", "exec", self.switch, "ip", "link", "set", port, "master", "br0"])
            _run(["ip", "netns", "exec", self.switch, "ip", "link", "set", port, "up"])
            if self.rate:
                tbf = ["tbf", "rate", self.rate, "burst", str(_burst(self.rate)), "latency", "100ms"]
                _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", self.interface, "root"] + tbf)
                _run(["ip", "netns", "exec", self.switch, "tc", "qdisc", "add", "dev", port, "root"] + tbf)

    def remove(self):
        self._end_processes()
        for ns in self.namespaces + [self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)

    def _end_processes(self, grace=3.0):
        """Ends what still runs inside the nodes (SIGTERM, then SIGKILL after
        `grace` seconds): a namespace outlives its name while a process is in
        it, and launchers' workers can run in sessions of their own."""
        pids = set()
        for ns in self.namespaces + [self.switch]:
            done = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=30)
            pids.update(int(p) for p in done.stdout.split() if p.isdigit())
        pids.discard(os.getpid())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in list(pids):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pids.discard(pid)
            deadline = time.time() + grace
            while pids and time.time() < deadline:
                pids = {pid for pid in pids if _running(pid)}
                time.sleep(0.05)
            if not pids:
                return

    # --- use --------------------------------------------------------------

    def command(self, node, argv):
        return ["ip", "netns", "exec", self.namespaces[node]] + list(argv)

    def popen(self, node, argv, env=None, **kwargs):
        return subprocess.Popen(self.command(node, argv), env=env, **kwargs)

    def tx_bytes(self, node):
        out = _run(self.command(node, ["cat", f"/sys/class/net/{self.interface}/statistics/tx_bytes"]))
        return int(out.strip())
