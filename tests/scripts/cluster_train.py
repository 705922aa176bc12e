"""A tiny training job, the same under every launcher: ``paratrain run``, Kubeflow's ``PET_*`` variables, Ray Train.

Usage: paratrain run -n 2 cluster_train.py OUT_DIR [--strategy ddp|zero3] [--steps N]
Each rank writes OUT_DIR/rank{R}.json (rank, world size, local rank, whether a process group existed before
``Parallel``, as Ray Train makes one, and whether MASTER_ADDR was set); rank 0 also writes OUT_DIR/params.pt. The
data and the model are seeded and each rank trains on its slice of one global batch, so the parameters depend only
on the world size, not on the launcher.
"""

import argparse
import json
import os

import torch
import torch.distributed as dist
from torch import nn

import paratrain

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--strategy", default="ddp")
    p.add_argument("--steps", type=int, default=4)
    a = p.parse_args()
    group_before = dist.is_initialized()
    with paratrain.Parallel(a.strategy, seed=0, monitor=False, job=paratrain.JobConfig(timeout_s=60)) as par:
        info = {
            "rank": par.rank,
            "world": par.world_size,
            "local_rank": par.local_rank,
            "group_before": group_before,
            "master_addr_set": "MASTER_ADDR" in os.environ,
        }
        with open(os.path.join(a.out_dir, f"rank{par.rank}.json"), "w") as f:
            json.dump(info, f)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(a.steps, 16, 8, generator=g), torch.randn(a.steps, 16, 1, generator=g)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = par.prepare(model, opt)
        part = x.shape[1] // par.world_size
        for step in range(a.steps):
            rows = slice(par.rank * part, (par.rank + 1) * part)
            with par.step(model, opt):
                par.backward(nn.functional.mse_loss(model(x[step, rows]), y[step, rows]))
        state = par.full_state_dict(model)
        if par.rank == 0:
            torch.save(state, os.path.join(a.out_dir, "params.pt"))
