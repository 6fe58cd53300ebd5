"""Python's side of the Wine example tests.

usage:
  wine_checks.py load CHECKPOINT        print keys and shapes (weights_only=True)
  wine_checks.py init OUT.pt            write a SimpleNN state dict with a huge fc2
  wine_checks.py badinit OUT.pt         write a state dict with a wrong key
"""
import sys

import torch


class SimpleNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 64)
        self.fc2 = torch.nn.Linear(64, 3)


command, path = sys.argv[1], sys.argv[2]
if command == "load":
    state = torch.load(path)
    model = SimpleNN()
    model.load_state_dict(state)  # same keys and shapes as Python's own model
    for key, value in state.items():
        print(f"{key} {list(value.shape)} {str(value.dtype)}")
elif command == "init":
    torch.manual_seed(0)
    model = SimpleNN()
    with torch.no_grad():
        model.fc2.weight.fill_(50.0)
        model.fc2.weight[0].fill_(-50.0)
    torch.save(model.state_dict(), path)
elif command == "badinit":
    torch.save({"fc1.weight": torch.zeros(64, 13), "layer2.weight": torch.zeros(3, 64)}, path)
