"""API misuse inside a launched job: every case must raise a paratrain error with a one-line message.

``run_all`` (called by ``fault_job.py misuse OUT``) runs each case on every rank in the same order (so the
collective ones stay in step) and writes ``case<TAB>exception class<TAB>message`` per case to
OUT/misuse-<rank>.txt; "-" as the class means nothing was raised.
"""

from __future__ import annotations

import os

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain


def _prepared(par: paratrain.Parallel):
    model = nn.Linear(4, 2)
    return par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _trained(par: paratrain.Parallel):
    model, opt = _prepared(par)
    with par.step(model, opt):
        par.backward(model(torch.randn(3, 4)).sum())
    return model, opt


def cases(out: str, par: paratrain.Parallel) -> dict:
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    a_file = os.path.join(out, "a_file")
    ckpt = os.path.join(out, "ckpt")

    def damaged():
        own = paratrain.Parallel("ddp", monitor=False)
        _trained(own)
        folder = own.save(ckpt)
        own.barrier()
        if own.rank == 0:
            shard = next(p for p in sorted(os.listdir(folder)) if p.endswith(".distcp"))
            with open(os.path.join(folder, shard), "r+b") as f:
                f.write(b"\x00garbage" * 4)
        own.barrier()
        own.load(ckpt)

    def other_model():
        model = nn.Linear(4, 3)
        par2 = paratrain.Parallel("ddp", monitor=False)
        par2.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        par2.load(ckpt)

    def in_window():
        par2 = paratrain.Parallel("ddp", accumulate=2, monitor=False)
        model, opt = _prepared(par2)
        with par2.step(model, opt):
            par2.backward(model(torch.randn(3, 4)).sum())
        par2.save(ckpt)

    def foreign_scheduler():
        model, opt = _prepared(par)
        other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
        par.prepare(torch.optim.lr_scheduler.StepLR(other, 1))

    def foreign_optimizer():
        model, other = nn.Linear(4, 2), nn.Linear(4, 2)
        paratrain.Parallel("ddp", monitor=False).prepare(model, torch.optim.SGD(other.parameters(), lr=0.1))

    return {
        "unknown strategy": lambda: paratrain.Parallel("nope"),
        "strategy of a wrong type": lambda: paratrain.Parallel(123),
        "unknown strategy option": lambda: paratrain.Parallel("ddp", no_such_option=1),
        "accumulate=0": lambda: paratrain.Parallel("ddp", accumulate=0),
        "timeout_s=0": lambda: paratrain.Parallel("ddp", job=paratrain.JobConfig(timeout_s=0)),
        "negative clip_grad_norm": lambda: paratrain.Parallel("ddp", clip_grad_norm=-1.0),
        "unknown precision": lambda: paratrain.Parallel("ddp", precision="fp12"),
        "fp16-mixed on CPU": lambda: paratrain.Parallel("ddp", precision="fp16-mixed"),
        "dp with 2 processes": lambda: paratrain.Parallel("dp"),
        "hybrid with 2 processes": lambda: paratrain.Parallel("hybrid"),
        "optimizer of another model": foreign_optimizer,
        "optimizer before model": lambda: par.prepare(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
        "prepare of a string": lambda: par.prepare("model"),
        "scheduler on another optimizer": foreign_scheduler,
        "empty loader (drop_last, fewer samples than ranks)": lambda: par.prepare(
            DataLoader(TensorDataset(torch.randn(1, 4)), batch_size=1, drop_last=True)
        ),
        "custom batch sampler": lambda: par.prepare(DataLoader(data, batch_sampler=[[0, 1], [2, 3]])),
        "save into a file": lambda: par.save(a_file),
        "save without a path": lambda: par.save(),
        "load of a missing path": lambda: par.load(os.path.join(out, "missing")),
        "save inside an accumulation window": in_window,
        "load of a damaged checkpoint": damaged,
        "load into another model": other_model,
    }


def run_all(out: str, rank: int) -> None:
    par = paratrain.Parallel("ddp", monitor=False)
    if rank == 0:
        open(os.path.join(out, "a_file"), "w").close()
    par.barrier()
    lines = []
    for name, case in cases(out, par).items():
        try:
            case()
            lines.append(f"{name}\t-\t")
        except Exception as e:  # noqa: BLE001 - recorded for the test
            lines.append(
                f"{name}\t{type(e).__module__}.{type(e).__name__}\t{str(e).replace(chr(10), ' / ')}"
                f"{' (MULTI-LINE)' if chr(10) in str(e) else ''}"
            )
        par.barrier()
    with open(os.path.join(out, f"misuse-{rank}.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    par.close()
