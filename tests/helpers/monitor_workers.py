"""Training runs with planted slowness, run on 2 gloo processes by tests/monitor/test_monitor.py.

One spawn runs every scenario in turn on a process group the worker starts itself (so several ``Parallel``
objects can use it one after another), which saves a process start per scenario.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.monitor import MonitorConfig


class _Items(Dataset):
    """Random samples; each ``__getitem__`` sleeps ``sleep_ms`` (a slow decoder)."""

    def __init__(self, n: int, sleep_ms: float) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g)
        self.sleep_s = sleep_ms / 1e3

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.x[i], self.y[i]


def _train(
    strategy: str,
    *,
    steps: int,
    sleep_ms: dict[int, float],
    item_sleep_ms: float = 0.0,
    accumulate: int = 1,
    csv: str | None = None,
    **parallel_kwargs: object,
) -> dict:
    """``steps`` optimizer steps of a tiny MLP; rank r sleeps ``sleep_ms[r]`` in each micro-step, before its
    forward. Returns what the monitor raised and its summary, as plain data."""
    config = MonitorConfig(every=4, persist=2, csv=csv)
    par = paratrain.Parallel(strategy, accumulate=accumulate, monitor=config, **parallel_kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    batch = 8
    loader = DataLoader(_Items(steps * accumulate * batch * par.world_size, item_sleep_ms), batch_size=batch)
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    pause = sleep_ms.get(par.rank, 0.0) / 1e3
    for x, y in loader:
        with par.step(model, optimizer):
            time.sleep(pause)
            par.forward_backward(model, x.to(par.device), y.to(par.device), nn.functional.cross_entropy)
    summary = par.monitor.summary()
    par.close()
    return {
        "warnings": [(w.kind, w.rank, w.value, w.message) for w in summary.warnings],
        "rows": summary.rows,
        "table": summary.table(),
    }


PLANTED_MS = {0: 10, 1: 150}
"""The planted straggler: rank 1 sleeps 150 ms a step before its forward, rank 0 10 ms. The gap is far above what a
loaded 2-core host adds to a rank's step (30 ms seen at load 15), so the slow rank stays the straggler there."""


def straggler(accelerator: str) -> dict:
    """The planted straggler (``PLANTED_MS``) on ``accelerator``."""
    return _train("ddp", steps=12, sleep_ms=PLANTED_MS, accelerator=accelerator)


def cuda_straggler() -> dict:
    """The planted straggler on GPUs (NCCL, CUDA-event timing)."""
    return straggler("cuda")


def monitor_scenarios(csv: str) -> dict[str, dict]:
    dist.init_process_group("gloo")
    results = {
        "straggler": _train("ddp", steps=12, sleep_ms=PLANTED_MS, csv=csv),
        "straggler_zero2": _train("zero2", steps=12, sleep_ms=PLANTED_MS),
        # tensor parallelism all-reduces inside the forward: the fast rank waits there, not at the gradient sync
        "straggler_tp": _train("tp", steps=12, sleep_ms=PLANTED_MS, tp_plan={"0": "colwise", "2": "rowwise"}),
        "data": _train("ddp", steps=12, sleep_ms={}, item_sleep_ms=3),
        "balanced": _train("ddp", steps=12, sleep_ms={0: 25, 1: 25}, accumulate=2),
    }
    finish_group()  # on an error the launcher stops every rank instead
    return results
