"""The Python half of the TorchScript example.

  python script_wine_mlp.py script OUT.pt
      scripts the Wine MLP (13 -> 64 -> 3) with torch.jit.script and saves it:
      what a Python team hands to a C++ trainer.
  python script_wine_mlp.py check SCRIPTED_TRAINED.pt STATE_A.pt [STATE_B.pt]
      loads what the C++ trainer wrote: the trained TorchScript module with
      torch.jit.load, and its state dict with torch.load(weights_only=True)
      into a fresh eager model with strict=True; with STATE_B, prints the
      largest difference between the two state dicts.
"""
import sys

import torch


class WineMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 64)
        self.fc2 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def main():
    if sys.argv[1] == "script":
        torch.manual_seed(0)
        torch.jit.script(WineMLP()).save(sys.argv[2])
        print(f"scripted WineMLP saved to {sys.argv[2]}")
        return
    scripted = torch.jit.load(sys.argv[2])
    state_a = torch.load(sys.argv[3], weights_only=True)
    eager = WineMLP()
    eager.load_state_dict(state_a, strict=True)
    assert list(state_a.keys()) == list(eager.state_dict().keys()), list(state_a.keys())
    x = torch.randn(5, 13)
    with torch.no_grad():
        diff_forward = (scripted(x) - eager(x)).abs().max().item()
    print(f"scripted vs eager forward: {diff_forward:.3g}")
    assert diff_forward < 1e-6
    if len(sys.argv) > 4:
        state_b = torch.load(sys.argv[4], weights_only=True)
        worst = max((state_a[k] - state_b[k]).abs().max().item() for k in state_a)
        print(f"max |a - b| = {worst:.3g}")


if __name__ == "__main__":
    main()
