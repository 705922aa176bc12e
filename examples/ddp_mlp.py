"""A single-device training loop made parallel with paratrain: four lines change.

python examples/ddp_mlp.py                   # one process ("auto" picks the single strategy)
paratrain run -n 2 examples/ddp_mlp.py       # two processes, DDP over gloo (or NCCL on GPUs)
torchrun --nproc-per-node 2 examples/ddp_mlp.py   # plain torchrun works the same
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

# test-launch: python | paratrain run -n 2


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args()

    par = paratrain.Parallel(strategy="auto", accumulate=args.accumulate, seed=0)  # 1. who am I, which device
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, 32, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(x, y), batch_size=64, shuffle=True)
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, loader = par.prepare(model, optimizer, loader)  # 2. wrap and shard

    for epoch in par.epochs(args.epochs):  # 3. reshuffle per epoch
        for xb, yb in loader:
            xb, yb = xb.to(par.device), yb.to(par.device)
            with par.step(model, optimizer):  # 4. sync/step/zero_grad
                loss = nn.functional.cross_entropy(model(xb), yb)
                par.backward(loss)
        par.print(f"epoch {epoch}: loss {par.mean(loss.detach()):.4f}")
    par.close()


if __name__ == "__main__":
    main()
