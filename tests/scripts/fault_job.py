"""A two-rank job that goes wrong in one chosen way, for the fault suite (tests/test_faults_*.py).

Usage: paratrain run -n 2 fault_job.py CASE OUT_DIR
Each rank writes its pid to OUT_DIR/<rank>.pid first, so a test can check that nothing is left running.

Cases: ``sleep`` (waits to be signalled or killed), ``user_error`` (ValueError on every rank),
``paratrain_error`` (accumulate=0 on every rank), ``disagree`` (rank 0 ddp, rank 1 zero3), ``mismatch`` (only
rank 0 calls par.mean), ``exit_early`` (rank 1 calls sys.exit(0) while rank 0 calls par.mean),
``zero_steps`` (a drop_last loader with fewer samples than ranks), ``misuse`` (many API mistakes, each caught
and recorded in OUT_DIR/misuse-<rank>.txt as ``case<TAB>exception class<TAB>message``).
"""

import os
import sys
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain


def _pid(out: str) -> None:
    with open(os.path.join(out, f"{os.environ['RANK']}.pid"), "w") as f:
        f.write(str(os.getpid()))


def _model(par: paratrain.Parallel):
    model = nn.Linear(4, 2)
    return par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def main(case: str, out: str) -> None:
    _pid(out)
    rank = int(os.environ["RANK"])
    fast = {"job": paratrain.JobConfig(timeout_s=6.0, wait_report_s=2.0), "monitor": False}
    if case == "sleep":
        par = paratrain.Parallel("ddp", monitor=False)
        open(os.path.join(out, f"ready-{rank}"), "w").close()
        time.sleep(300)
    elif case == "user_error":
        paratrain.Parallel("ddp", monitor=False)
        raise ValueError("planted user error")
    elif case == "paratrain_error":
        paratrain.Parallel("ddp", accumulate=0)
    elif case == "disagree":
        paratrain.Parallel("ddp" if rank == 0 else "zero3", **fast)
    elif case == "mismatch":
        par = paratrain.Parallel("ddp", **fast)
        if rank == 0:
            par.mean(1.0)
        par.close()
    elif case == "exit_early":
        par = paratrain.Parallel("ddp", **fast)
        model, opt = _model(par)
        if rank == 1:
            sys.exit(0)
        time.sleep(0.5)
        par.mean(1.0)
    elif case == "zero_steps":
        par = paratrain.Parallel("ddp", monitor=False)
        model, opt = _model(par)
        data = TensorDataset(torch.randn(1, 4), torch.randn(1, 2))
        par.prepare(DataLoader(data, batch_size=1, drop_last=True))
    elif case == "misuse":
        from misuse_cases import run_all

        run_all(out, rank)
    else:
        raise SystemExit(f"unknown case {case!r}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
