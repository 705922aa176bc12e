"""Pipeline parallelism with micro-batches (GPipe, 1F1B, interleaved 1F1B), and data x pipeline hybrids.

paratrain run -n 2 examples/pipeline_mlp.py --schedule 1f1b
paratrain run -n 2 examples/pipeline_mlp.py --schedule interleaved-1f1b
paratrain run -n 4 examples/pipeline_mlp.py --strategy hybrid            # 2 replicas x 2 stages
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

# test-launch: paratrain run -n 2 --schedule gpipe --epochs 1 |paratrain run -n 2 --schedule interleaved-1f1b --epochs 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--strategy", default="pipeline", choices=["pipeline", "hybrid"])
    p.add_argument("--schedule", default="1f1b")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    args = p.parse_args()
    par = paratrain.Parallel(args.strategy, schedule=args.schedule, microbatches=args.microbatches, seed=0)
    # an nn.Sequential: the pipeline cuts it into stages, balanced by parameter count
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(64, 64), nn.GELU())], nn.Linear(64, 10))
    x = torch.randn(4096, 64)
    y = (x @ torch.randn(64, 10)).argmax(1)
    # the ranks of one pipeline read the same batches: prepare shards by data-parallel replica only
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True, drop_last=True)
    model, optimizer, loader = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-3), loader)
    for epoch in par.epochs(args.epochs):
        for xb, yb in loader:
            with par.step(model, optimizer):
                loss = par.forward_backward(model, xb.to(par.device), yb.to(par.device), nn.functional.cross_entropy)
        with torch.no_grad():
            accuracy = (model(x[:512].to(par.device)).argmax(1) == y[:512].to(par.device)).float().mean()
        par.print(f"epoch {epoch}: loss {par.mean(loss):.4f}  accuracy {accuracy:.2%}  ({par.strategy.describe()})")
    par.close()


if __name__ == "__main__":
    main()
