"""A ddp job that trains until it is stopped: for ``paratrain run --checkpoint-dir D`` receiving SIGTERM.

Rank 0 touches ``$PREEMPT_STARTED`` after its first optimizer step; the job then trains on (a few milliseconds a
step) until a stop signal makes every rank save at the step they agree on and leave with exit code 75. Each rank
reads through a DataLoader worker process, which the launcher's SIGTERM reaches too (its process group): it must
outlive the signal until its rank has saved.
"""

import os
import pathlib
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

if __name__ == "__main__":
    par = paratrain.Parallel("ddp", seed=0, monitor=False)
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    loader = DataLoader(data, batch_size=4, num_workers=1, persistent_workers=True)
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    for _ in par.epochs(10_000):
        for x, y in loader:
            with par.step(model, optimizer):
                par.backward(nn.functional.mse_loss(model(x), y))
            if par.optimizer_steps == 1 and par.is_main:
                pathlib.Path(os.environ["PREEMPT_STARTED"]).touch()
            time.sleep(0.005)
    par.close()
