"""A DDP job where one rank fails at a given step, by raising, by SIGKILL or by SIGABRT.

Usage: paratrain run -n 2 failing_job.py --fail-rank R --fail-step S --how raise|kill|abort --pid-dir D
Each rank writes its pid to D so a test can check that nothing is left running, and the failing rank writes
the wall-clock time it fails at to D/failed_at, so a test can time the failure to the job's exit.
"""

import argparse
import os
import signal
import time

import torch
from torch import nn

import paratrain

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--fail-rank", type=int, default=1)
    p.add_argument("--fail-step", type=int, default=5)
    p.add_argument("--how", choices=["raise", "kill", "abort"], default="raise")
    p.add_argument("--pid-dir", required=True)
    a = p.parse_args()
    with paratrain.Parallel("ddp") as par:
        with open(os.path.join(a.pid_dir, f"{par.rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        model = nn.Linear(4, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = par.prepare(model, opt)
        for step in range(10_000):
            if par.rank == a.fail_rank and step == a.fail_step:
                with open(os.path.join(a.pid_dir, "failed_at"), "w") as f:
                    f.write(repr(time.time()))
                if a.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if a.how == "abort":
                    os.abort()
                raise RuntimeError(f"planted failure at step {step}")
            with par.step(model, opt):
                par.backward(model(torch.randn(8, 4)).pow(2).mean())
            time.sleep(0.01)
