"""The Wine classifier with PyTorch's own DDP under torchrun: the Python
program our C++ wine_ddp is compared with (end-to-end wall time in
bench/run_bench.py, and the training trajectory in tests/test_wine.cpp).

  torchrun --standalone --nproc-per-node 2 bench/wine_tutorial.py 100 50 \
      --data examples/wine/data/wine_data.csv --checkpoint-dir /tmp/py

It follows the same recipe as examples/wine/wine_ddp.cpp: a seeded 80/20
split, standardisation fitted on the training split, SimpleNN, Adam(1e-3),
DistributedSampler with set_epoch, and rank 0 printing the epoch loss
averaged over ranks.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


class SimpleNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(13, 64)
        self.fc2 = torch.nn.Linear(64, 3)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def load_split(path):
    rows = []
    with open(path) as f:
        for n, line in enumerate(f):
            fields = line.strip().split(",")
            try:
                rows.append([float(v) for v in fields])
            except ValueError:
                if n == 0:
                    continue  # header
                raise
    data = torch.tensor(rows, dtype=torch.float32)
    features, labels = data[:, :13], data[:, 13].long()
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(42))
    n_test = -(-len(data) * 2 // 10)  # ceil(0.2 * n)
    test, train = order[:n_test], order[n_test:]
    x_train, x_test = features[train], features[test]
    mean, std = x_train.mean(0), x_train.std(0, unbiased=False)
    std = torch.where(std > 0, std, torch.ones_like(std))
    return (x_train - mean) / std, labels[train], (x_test - mean) / std, labels[test]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("save_every", type=int)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--data", default="examples/wine/data/wine_data.csv")
    parser.add_argument("--checkpoint-dir", default=".")
    parser.add_argument("--init-out", help="save the initial state dict here (rank 0)")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x_train, y_train, x_test, y_test = load_split(args.data)

    torch.manual_seed(42)
    model = SimpleNN()
    if rank == 0 and args.init_out:
        torch.save(model.state_dict(), args.init_out)
    ddp_model = DistributedDataParallel(model)
    optimizer = torch.optim.Adam(ddp_model.parameters(), lr=1e-3)
    sampler = DistributedSampler(TensorDataset(x_train, y_train), num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=args.batch_size, sampler=sampler)

    for epoch in range(args.total_epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for source, targets in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp_model(source), targets)
            loss.backward()
            optimizer.step()
            total += loss.item()
            batches += 1
        mean_loss = torch.tensor([total / batches], dtype=torch.float64)
        dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"Epoch {epoch}, Loss: {mean_loss.item() / world:.4f}", flush=True)
            if epoch % args.save_every == 0:
                torch.save(model.state_dict(), os.path.join(args.checkpoint_dir, f"model_{epoch}.pt"))
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(args.checkpoint_dir, "model_final.pt"))
        with torch.no_grad():
            accuracy = (model(x_test).argmax(1) == y_test).double().mean().item()
        print(f"Test accuracy: {accuracy:.4f}", flush=True)
    dist.barrier()
    # torch 2.11's gloo teardown occasionally aborts a rank here
    # ("terminate called without an active exception") after all work is
    # done; leave without running destructors so the run's result stands.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
