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


def each_call(calls: Sequence[tuple[str, Callable[..., Any], tuple, dict]]) -> dict:
    """Calls ``(name, fn, args, kwargs)`` of module-level workers in one job, keyed by name, on every rank: the
    tests of one file that train small models by different functions share a launch per world size."""
    return each_case(calls, lambda _, c: c[1](*c[2], **c[3]), key=lambda c: c[0], every_rank=True)


def each_case(
    cases: Sequence[Any], run: Callable[[int, Any], Any], key: Callable[[Any], Hashable], *, every_rank: bool = False
) -> dict:
    """``run(index, case)`` for every case, keyed ``key(case)``; rank 0 returns them all, the others ``{}`` (with
    ``every_rank``, each rank its own: for tests that compare the ranks)."""
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
    return out if rank == 0 or every_rank else {}
