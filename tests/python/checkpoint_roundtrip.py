"""Checkpoint interchange with C++.

usage: checkpoint_roundtrip.py FROM_CPP OUT_DIR

Loads FROM_CPP (written by ddp::save_state_dict) with torch.load's default
weights_only=True, prints its keys, dtypes and sums, then writes into OUT_DIR:
  doubled.pt  -- {k: v * 2 + 1} as a plain dict
  module.pt   -- an nn.Module's state_dict() (an OrderedDict with _metadata)
  evil.pt     -- a pickle naming a non-tensor global (must be refused)
"""
import os
import sys

import torch

src, out_dir = sys.argv[1], sys.argv[2]
state = torch.load(src)  # weights_only=True is the default since torch 2.6
for key, value in state.items():
    print(f"{key} {str(value.dtype).replace('torch.', '')} {list(value.shape)} {value.double().sum().item():.6f}")

torch.save({k: v * 2 + 1 for k, v in state.items()}, os.path.join(out_dir, "doubled.pt"))

torch.manual_seed(0)
module = torch.nn.Sequential()
module.add_module("fc1", torch.nn.Linear(3, 2))
module.add_module("norm", torch.nn.BatchNorm1d(2))
torch.save(module.state_dict(), os.path.join(out_dir, "module.pt"))
with open(os.path.join(out_dir, "module.txt"), "w") as f:
    for key, value in module.state_dict().items():
        f.write(f"{key} {value.double().sum().item():.8f}\n")

torch.save({"w": torch.ones(2), "config": os.path.join}, os.path.join(out_dir, "evil.pt"))
