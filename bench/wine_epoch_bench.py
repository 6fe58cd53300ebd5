"""Per-epoch time of the main job, wine_ddp at 2 ranks under ddprun (make
run's path: shared memory, which ddp picks on one host, and Gloo with
DDP_SHM=0), against PyTorch's DDP running the same recipe
(bench/wine_tutorial.py), side by side:
start-up is removed by differencing a long run and a 1-epoch run, each the
best of several rounds, interleaved.

    python bench/wine_epoch_bench.py --build-dir build [--epochs 400] [--rounds 3]

Prints one JSON line and a markdown row; bench/PROFILE.md quotes it.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# ddp as make run starts it (shared memory on one host), ddp over Gloo, Python.
SIDES = ("ddp", "ddp-gloo", "python")
ROOT = os.path.dirname(HERE)


def wall(cmd, env=None):
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, **(env or {})))
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--build-dir", default=os.path.join(ROOT, "build"))
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--epochs", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    ddprun = os.path.join(args.build_dir, "bin", "ddprun")
    wine_ddp = os.path.join(args.build_dir, "bin", "wine_ddp")
    torchrun = [args.python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    best = {}
    with tempfile.TemporaryDirectory() as tmp:
        def command(side, epochs):
            out = os.path.join(tmp, f"{side}-{epochs}-{time.monotonic_ns()}")
            os.makedirs(out)
            # Saving every 100000 epochs: the figure is training, not checkpoints.
            if side in ("ddp", "ddp-gloo"):
                return [ddprun, "--standalone", "--nproc-per-node", "2", wine_ddp, str(epochs), "100000",
                        "--checkpoint-dir", out]
            return torchrun + [os.path.join(HERE, "wine_tutorial.py"), str(epochs), "100000", "--checkpoint-dir", out]
        for _ in range(args.rounds):
            for side in SIDES:
                for epochs in (1, args.epochs):
                    key = (side, epochs)
                    env = {"DDP_SHM": "0"} if side == "ddp-gloo" else None
                    best[key] = min(best.get(key, float("inf")), wall(command(side, epochs), env))
    per_epoch = {side: (best[(side, args.epochs)] - best[(side, 1)]) / (args.epochs - 1) * 1000 for side in SIDES}
    result = {"epochs": args.epochs, "rounds": args.rounds, "ms_per_epoch": per_epoch,
              "ratio": per_epoch["ddp"] / per_epoch["python"],
              "ratio_gloo": per_epoch["ddp-gloo"] / per_epoch["python"]}
    print(json.dumps(result))
    print(f"| wine_ddp (shared memory, ddp's choice) | {per_epoch['ddp']:.2f} | {result['ratio']:.2f}x |")
    print(f"| wine_ddp, DDP_SHM=0 (gloo) | {per_epoch['ddp-gloo']:.2f} | {result['ratio_gloo']:.2f}x |")
    print(f"| Python DDP (bench/wine_tutorial.py) | {per_epoch['python']:.2f} | 1 |")


if __name__ == "__main__":
    main()
