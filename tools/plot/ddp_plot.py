#!/usr/bin/env python3
"""Draws the loss and test-accuracy curves of one or more --metrics files.

  python tools/plot/ddp_plot.py runs/a/metrics.jsonl runs/b/metrics.jsonl -o curves.png
  make plot METRICS="runs/a/metrics.jsonl runs/b/metrics.jsonl" OUT=curves.svg

Each metrics file holds one JSON object per line with at least "epoch" and
"loss"; "test_accuracy" is drawn where present. The output format follows the
file name (.png or .svg).
"""
import argparse
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")  # no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_metrics(path):
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{number}: not a JSON object: {e}")
            if "epoch" not in row or "loss" not in row:
                sys.exit(f"{path}:{number}: needs 'epoch' and 'loss'")
            rows.append(row)
    if not rows:
        sys.exit(f"{path}: holds no metrics")
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics files written with --metrics")
    parser.add_argument("-o", "--output", default="curves.png", help="output image, .png or .svg (default curves.png)")
    parser.add_argument("--title", default="", help="figure title (default none)")
    args = parser.parse_args()
    if os.path.splitext(args.output)[1].lower() not in (".png", ".svg"):
        sys.exit(f"{args.output}: the output must end in .png or .svg")

    runs = [(path, read_metrics(path)) for path in args.metrics]
    has_accuracy = any(r.get("test_accuracy") is not None for _, rows in runs for r in rows)
    fig, axes = plt.subplots(1, 2 if has_accuracy else 1, figsize=(11 if has_accuracy else 6, 4), squeeze=False)
    loss_ax = axes[0][0]
    for path, rows in runs:
        label = os.path.basename(os.path.dirname(os.path.abspath(path))) + "/" + os.path.basename(path)
        loss_ax.plot([r["epoch"] for r in rows], [r["loss"] for r in rows], label=label)
        if has_accuracy:
            points = [(r["epoch"], r["test_accuracy"]) for r in rows if r.get("test_accuracy") is not None]
            if points:
                axes[0][1].plot(*zip(*points), marker=".", label=label)
    loss_ax.set_xlabel("epoch")
    loss_ax.set_ylabel("training loss")
    loss_ax.set_yscale("log")
    loss_ax.grid(True, alpha=0.3)
    loss_ax.legend()
    if has_accuracy:
        acc_ax = axes[0][1]
        acc_ax.set_xlabel("epoch")
        acc_ax.set_ylabel("test accuracy")
        acc_ax.grid(True, alpha=0.3)
        acc_ax.legend()
    if args.title:
        fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
