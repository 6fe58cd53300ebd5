"""PyTorch's side of LmExample.PythonReadsADiLoCoSnapshot (tests/test_lm_example.cpp).

  dcp_read_diloco.py DIR REPLICAS

Loads every tensor of the DiLoCo job's sharded snapshot DIR (written by C++,
examples/lm/lm_train with --diloco and --snapshot-dir) with DCP's
HuggingFaceStorageReader in one process, and checks what the C++ side
promises: "model.*" holds the global copy, and right after a sync with no
mixing every replica's local weights ("diloco.replica_<r>.model.*") equal it.
Exits non-zero, saying why, when not.
"""

import sys

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner


def main():
    path, replicas = sys.argv[1], int(sys.argv[2])
    metadata = HuggingFaceStorageReader(path).read_metadata()
    state = {
        key: torch.empty(entry.size, dtype=entry.properties.dtype)
        for key, entry in metadata.state_dict_metadata.items()
    }
    dcp.load(state, storage_reader=HuggingFaceStorageReader(path), planner=DefaultLoadPlanner(allow_partial_load=True))

    def under(prefix):
        return {key[len(prefix):]: value for key, value in state.items() if key.startswith(prefix)}

    model = under("model.")
    if not model:
        sys.exit("no model.* tensors in " + path)
    outer = under("diloco.outer.state.")
    if not outer:
        sys.exit("no outer optimizer state in " + path)
    worst = 0.0
    for r in range(replicas):
        local = under(f"diloco.replica_{r}.model.")
        if local.keys() != model.keys():
            sys.exit(f"replica {r}'s tensors differ from model.*: {sorted(local.keys() ^ model.keys())}")
        worst = max(worst, max((local[k] - model[k]).abs().max().item() for k in model))
    print(f"{len(state)} tensors, {len(model)} under model., {len(outer)} outer entries; "
          f"max |global - local| after the sync: {worst}")
    if worst != 0.0:
        sys.exit("the replicas' local weights differ from the global copy right after a sync")


if __name__ == "__main__":
    main()
