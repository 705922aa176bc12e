"""A tiny DDP training job that records where each rank ran and the final parameters.

Usage: paratrain run [--nnodes 2 …] -n 1 multinode_train.py OUT_DIR [--steps N] [--step-sleep S]
Each rank writes OUT_DIR/rank{R}.json (rank, world size, node rank, master address, the inode of its network
namespace); rank 0 also writes OUT_DIR/params.pt. The data and the model are seeded, so the parameters depend
only on the global batch, not on how the ranks are spread over nodes.
"""

import argparse
import json
import os
import time

import torch
from torch import nn

import paratrain

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=60.0)
    a = p.parse_args()
    with paratrain.Parallel("ddp", seed=0, job=paratrain.JobConfig(timeout_s=a.timeout)) as par:
        info = {
            "rank": par.rank,
            "world": par.world_size,
            "node_rank": int(os.environ["GROUP_RANK"]),
            "master_addr": os.environ["MASTER_ADDR"],
            "netns": os.stat("/proc/self/ns/net").st_ino,
            "pid": os.getpid(),
        }
        with open(os.path.join(a.out_dir, f"rank{par.rank}.json"), "w") as f:
            json.dump(info, f)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(a.steps, 16, 8, generator=g), torch.randn(a.steps, 16, 1, generator=g)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = par.prepare(model, opt)
        half = x.shape[1] // par.world_size
        for step in range(a.steps):
            xb = x[step, par.rank * half : (par.rank + 1) * half]
            yb = y[step, par.rank * half : (par.rank + 1) * half]
            with par.step(model, opt):
                par.backward(nn.functional.mse_loss(model(xb), yb))
            time.sleep(a.step_sleep)
        state = par.full_state_dict(model)
        if par.rank == 0:
            torch.save(state, os.path.join(a.out_dir, "params.pt"))
