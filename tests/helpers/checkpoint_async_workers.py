"""The launched jobs of tests/checkpoint/test_checkpoint_async_dist.py: asynchronous saves under every strategy.

Every DCP write here starts late (:func:`slow_writes`), so training steps on while a background save is written:
had the save not been staged (copied), the steps taken meanwhile would show in what it wrote.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

import torch
from torch.nn import functional as F

import paratrain
from helpers.cases import each_case
from helpers.checkpoint_workers import train
from helpers.ps_workers import PER_RANK, Recommender, recommender_batch

STEPS, SAVE_AT = 8, 3
CASES = [
    ("ddp", {}),
    ("zero1", {}),
    ("zero2", {}),
    ("zero3", {}),
    ("tp", {"tp_plan": {"0": "colwise", "3": "rowwise"}}),
    ("pipeline", {"schedule": "gpipe", "microbatches": 2}),
    ("model_parallel", {}),
]


def slow_writes(seconds: float) -> None:
    """Make every DCP write in this process start ``seconds`` late."""
    from torch.distributed.checkpoint.filesystem import _FileSystemWriter

    original = _FileSystemWriter.write_data

    def write_data(self, *args, **kwargs):
        time.sleep(seconds)
        return original(self, *args, **kwargs)

    _FileSystemWriter.write_data = write_data


def run_cases(root: str) -> dict:
    """Each case: a run that saves at step ``SAVE_AT`` blocking, one that saves there in the background, and one that
    resumes from the background save; rank 0 returns what each ended with."""
    slow_writes(0.5)
    return each_case(CASES, functools.partial(_case, Path(root)), key=lambda case: case[0])


def _case(root: Path, index: int, case: tuple[str, dict]) -> dict:
    strategy, options = case
    base = root / f"{index}-{strategy}"
    runs = {
        "blocking": train(strategy, STEPS, str(base / "blocking"), save_at=SAVE_AT, options=options),
        "async": train(strategy, STEPS, str(base / "async"), save_at=SAVE_AT, options=options, async_save=True),
        "resumed": train(strategy, STEPS, str(base / "async"), load=True, options=options),
    }
    return {
        name: {k: run[k] for k in ("params", "optim", "lr", "batches", "published_on_return")}
        for name, run in runs.items()
    }


def run_ps(root: str, steps: int = 4, at: int = 2) -> dict | None:
    """Parameter servers (tables with SparseAdam on two servers): saved after step ``at`` blocking and in the
    background, trained on to ``steps``, then loaded from the background save and trained to ``steps`` again."""
    slow_writes(0.5)
    par = paratrain.Parallel("ps", monitor=False, servers=2, tables=["bag", "emb"], table_optimizer="adam")
    model = Recommender()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=0.05))
    size, rank = par.data_parallel_size, par.data_parallel_rank
    mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def train_to(end: int) -> dict:
        for s in range(par.optimizer_steps, end):
            x, y = recommender_batch(s, size * PER_RANK)
            with par.step(model, opt):
                par.forward_backward(model, (x[0][mine], x[1][mine]), y[mine], F.cross_entropy)
        return par.full_state_dict(model)

    saved = train_to(at)
    par.save(Path(root) / "blocking")
    folder = par.save(Path(root) / "async", async_save=True)
    published_on_return = folder.exists()
    first = train_to(steps)
    par.load(folder)
    loaded = par.full_state_dict(model)
    again = train_to(steps)
    par.close()
    return {
        "saved": saved,
        "first": first,
        "loaded": loaded,
        "again": again,
        "published_on_return": published_on_return,
    }
