"""A two-rank job whose collectives stall in one chosen way, for the flight recorder's report.

Usage: paratrain run -n 2 hang_job.py CASE OUT_DIR
Each rank writes its pid to OUT_DIR/<rank>.pid first, so a test can check that nothing is left running.

Cases: ``skip_forward`` (zero3; rank 1 skips the forward of its second step), ``sizes`` (a user's all-reduce of 4
numbers on rank 0 and 8 on rank 1), ``loader`` (rank 1 stuck in its data loader), ``dcp_save`` (only rank 0 saves a
distributed checkpoint). Every timeout is a few seconds, so each hang ends quickly.
"""

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.utils.data import DataLoader, Dataset

import paratrain

TIMEOUT_S = 2.0


class _Stuck(Dataset):
    """Rank 1 hangs fetching its third sample (a network file system that stopped answering)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if os.environ["RANK"] == "1" and i >= 2:
            time.sleep(60)
        return torch.full((4,), float(i)), torch.ones(2)


def _parallel(strategy: str) -> paratrain.Parallel:
    return paratrain.Parallel(strategy, job=paratrain.JobConfig(timeout_s=TIMEOUT_S, wait_report_s=0.5), monitor=False)


def _prepared(par: paratrain.Parallel):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    return par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def skip_forward(rank: int) -> None:
    par = _parallel("zero3")
    model, opt = _prepared(par)
    for step in range(3):
        with par.step(model, opt):
            if rank == 0 or step != 1:  # a data-dependent branch taken on one rank only
                par.backward(model(torch.full((2, 4), float(rank))).sum())


def sizes(rank: int) -> None:
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(3))
    dist.all_reduce(torch.ones(4 if rank == 0 else 8))


def loader(rank: int) -> None:
    par = _parallel("ddp")
    model, opt = _prepared(par)
    for x, _ in par.prepare(DataLoader(_Stuck(), batch_size=1, shuffle=False)):
        with par.step(model, opt):
            par.backward(model(x).sum())


def dcp_save(rank: int, out: str) -> None:
    import torch.distributed.checkpoint as dcp

    par = _parallel("ddp")
    model, opt = _prepared(par)
    with par.step(model, opt):
        par.backward(model(torch.full((2, 4), float(rank))).sum())
    if rank == 0:
        dcp.save({"model": model.state_dict()}, checkpoint_id=os.path.join(out, "ckpt"))
    time.sleep(60)  # rank 1 goes on to work of its own


def _all_started() -> None:
    """Both ranks here before a group with a 2 s timeout starts (on a busy machine their imports end seconds
    apart)."""
    store = TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    store.add("hang_job/started", 1)
    while store.add("hang_job/started", 0) < 2:
        time.sleep(0.05)


def main(case: str, out: str) -> None:
    rank = int(os.environ["RANK"])
    with open(os.path.join(out, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    _all_started()
    if case == "dcp_save":
        dcp_save(rank, out)
    else:
        {"skip_forward": skip_forward, "sizes": sizes, "loader": loader}[case](rank)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
