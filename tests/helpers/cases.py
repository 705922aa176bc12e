"""The one cases runner: every case of a launched job in order on one process group, on every rank.

A launched job is expensive (seconds to start, a process group to build), so a suite launches one job per world
size and runs all its cases in it. A case that raises a paratrain error is reported as ``{"error": its one line}``
instead of stopping the rest: every rank refuses alike, in ``prepare``, so the ranks stay in step.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import paratrain
from paratrain.distributed.process_group import finish_group


def each_case(cases: Sequence[Any], run: Callable[[int, Any], Any], key: Callable[[Any], Hashable]) -> dict:
    """``run(index, case)`` for every case, keyed ``key(case)``; rank 0 returns them all, the others ``{}``."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = {}
    for i, case in enumerate(cases):
        try:
            out[key(case)] = run(i, case)
        except paratrain.ParatrainError as err:
            out[key(case)] = {"error": str(err)}
    rank = dist.get_rank()
    finish_group()
    return out if rank == 0 else {}
