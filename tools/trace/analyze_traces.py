"""Finds where the ranks of a failed job went apart, from their collective traces.

usage: analyze_traces.py DIR_OR_FILES...

Reads trace_rank*.jsonl files (written by ddp on a collective failure or
timeout: see docs/troubleshooting.md, "Debugging a hang"), lines up every
rank's collectives by sequence number, and prints the first one where the
ranks differ: a rank that never issued it, or ranks that issued different
collectives (op, dtype, shape or tag). Exits 0 when it found a divergence or
a stall, 1 when the traces agree everywhere, 2 on bad input.
"""
import glob
import json
import os
import sys


def load(paths):
    traces = {}
    for path in paths:
        records = {}
        rank = None
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    r = json.loads(line)
                except json.JSONDecodeError as e:
                    sys.exit(f"{path}:{number}: not a JSON line: {e}")
                rank = r["rank"]
                records[r["seq"]] = r
        if rank is None:
            print(f"{path}: empty trace", file=sys.stderr)
            continue
        traces[rank] = records
    return traces


def fingerprint(r):
    return (r["op"], r["dtype"], tuple(r["shape"]), r["tag"])


def text(r):
    shape = "x".join(str(d) for d in r["shape"]) or "-"
    tag = f", {r['tag']}" if r["tag"] else ""
    return f"#{r['seq']} {r['op']} {r['dtype']} [{shape}]{tag} ({r['state']})"


def main():
    args = sys.argv[1:]
    if not args:
        print(__doc__, file=sys.stderr)
        return 2
    paths = []
    for a in args:
        paths += sorted(glob.glob(os.path.join(a, "trace_rank*.jsonl"))) if os.path.isdir(a) else [a]
    traces = load(paths)
    if len(traces) < 1:
        print("no traces found", file=sys.stderr)
        return 2
    ranks = sorted(traces)
    first = max(min(t) for t in traces.values() if t)  # every rank still holds records from here
    last = max(max(t) for t in traces.values() if t)
    print(f"{len(ranks)} rank(s): " + ", ".join(f"rank {r}: #{min(traces[r])}..#{max(traces[r])}" for r in ranks))
    for seq in range(first, last + 1):
        present = {r: traces[r].get(seq) for r in ranks}
        missing = [r for r, rec in present.items() if rec is None]
        have = {r: rec for r, rec in present.items() if rec is not None}
        kinds = {fingerprint(rec) for rec in have.values()}
        if missing or len(kinds) > 1:
            print(f"first divergence at collective #{seq}:")
            for r in ranks:
                rec = present[r]
                print(f"  rank {r}: " + (text(rec) if rec else f"never issued #{seq} "
                                         f"(its last is #{max(traces[r])})"))
            return 0
    stuck = {r: next((s for s in sorted(traces[r]) if traces[r][s]["state"] != "completed"), None) for r in ranks}
    stuck = {r: s for r, s in stuck.items() if s is not None}
    if stuck:
        seq = min(stuck.values())
        print(f"the ranks issued the same collectives; the first unfinished one is #{seq}:")
        for r in ranks:
            rec = traces[r].get(seq)
            print(f"  rank {r}: " + (text(rec) if rec else "-"))
        return 0
    print("the traces agree: every rank issued and completed the same collectives")
    return 1


if __name__ == "__main__":
    sys.exit(main())
