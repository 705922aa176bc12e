"""nn.DataParallel (`dp`): one process drives every local GPU. On the CPU or one GPU it runs as one device
and says why `ddp` is the better choice; prefer `paratrain run -n <gpus>` with strategy `ddp`.

    python examples/data_parallel_dp.py
"""

import torch
from torch import nn

import paratrain

# test-launch: python

if __name__ == "__main__":
    par = paratrain.Parallel("dp", accumulate=2, seed=0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))
    model, optimizer = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    for _ in range(40):
        x = torch.randn(64, 8).to(par.device)
        with par.step(model, optimizer):
            loss = par.forward_backward(model, x, x.pow(2).sum(1, keepdim=True), nn.functional.mse_loss)
    par.print(f"final loss {loss:.4f}")
