"""The launched job of tests/test_preemption.py: a stop signal mid-training under ddp, zero3, a pipeline and tp."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import paratrain
from helpers.cases import each_case
from helpers.checkpoint_workers import train
from paratrain.preemption import SPAWNED_VAR

STEPS, EVERY = 6, 2
SIGNALS = {0: (3, signal.SIGUSR1), 1: (4, signal.SIGTERM)}
"""Rank 0 is signalled after step 3, rank 1 after step 4: after the check at step 4, so only an agreement stops
both there."""
CASES = [
    ("ddp", {}),
    ("zero3", {}),
    ("pipeline", {"schedule": "gpipe", "microbatches": 2}),
    ("tp", {"tp_plan": {"0": "colwise", "3": "rowwise"}}),
]


def run_cases(root: str) -> dict:
    """Each case on every rank: the uninterrupted run, the run the signals stop, and a fresh ``Parallel`` that
    resumes from what it saved and trains to the end. The ranks stand for torchrun's (or srun's), which catch SIGTERM
    too: ``paratrain.launch``'s mark is dropped."""
    os.environ.pop(SPAWNED_VAR, None)
    return each_case(CASES, lambda i, case: _case(Path(root) / case[0], *case), key=lambda c: c[0], every_rank=True)


def _case(folder: Path, strategy: str, options: dict) -> dict:
    def config(**kwargs: object) -> paratrain.CheckpointConfig:
        return paratrain.CheckpointConfig(dir=str(folder), stop_check_every=EVERY, **kwargs)

    runs = {
        "whole": train(strategy, STEPS, "", options=options),
        "stopped": train(strategy, STEPS, "", options=options, checkpoint=config(), signal_at=SIGNALS),
        "resumed": train(strategy, STEPS, "", options=options, checkpoint=config(resume=True)),
    }
    return {
        name: {k: run[k] for k in ("params", "optim", "lr", "batches", "step", "preempted", "resumed_at")}
        for name, run in runs.items()
    }
