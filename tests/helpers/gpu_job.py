"""The GPU suite's job: every case of one world size in one launched job, each checked for where its tensors live.

A case is a worker the CPU suites run (tests/helpers/*_workers.py), given ``accelerator=`` in its options. Each case
gets a rendezvous store of its own, so it starts its group as a fresh launch would: ``own_group`` cases let their
``Parallel`` start it (the path ``paratrain run train.py`` takes: the backend the strategy needs, the device claimed
first); the others, whose workers make several ``Parallel`` objects one after another (train, save, resume), run in
a group the job starts as a script on that machine would, ``init_process_group()`` over gloo and NCCL, without
setting the device. A case that raises is reported with its traceback and the job goes on to the next; the
:class:`~helpers.placement.Placement` probe's findings and each rank's errors come back from every rank, and the test
process judges the results against the one-process reference (:func:`judge`).
"""

from __future__ import annotations

import os
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from helpers.placement import Placement
from paratrain.distributed.process_group import finish_group
from paratrain.testing import max_abs_diff

Verdict = Callable[[Any], str]
"""Run in the test process on rank 0's result: '' when it is right, else what is wrong."""


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., Any]
    """A module-level worker, run on every rank."""
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    verdict: Verdict | None = None
    home: str = "device"
    """Where parameters, gradients and optimizer state belong: ``"device"``, or ``"cpu"`` when offloaded."""
    own_group: bool = False
    """The case's one ``Parallel`` starts (and ends) the group itself."""
    steps: bool = True
    """The case takes optimizer steps (the probe must have seen one)."""


def run_job(cases: Sequence[Case], accelerator: str) -> dict[str, dict]:
    """Every case in order on every rank (started by ``paratrain.testing.spawn``), keyed by name."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, False, timedelta(seconds=60))
    servers: list[dist.TCPStore] = []
    out = {}
    for i, case in enumerate(cases):
        with _own_store(base, f"gpu-job/case-{i}", rank, servers):
            out[case.name] = _run(case, accelerator)
    base.add("gpu-job/done", 1)
    while rank == 0 and base.add("gpu-job/done", 0) < world:  # the cases' stores live until every rank is done
        time.sleep(0.01)
    return out


@contextmanager
def _own_store(base: dist.Store, key: str, rank: int, servers: list) -> Iterator[None]:
    """Within, ``env://`` finds a store that rank 0 made for this case alone (as a new launch would)."""
    if rank == 0:
        servers.append(
            dist.TCPStore(os.environ["MASTER_ADDR"], 0, None, True, timedelta(seconds=60), wait_for_workers=False)
        )
        base.set(key, str(servers[-1].port))
    saved = os.environ["MASTER_PORT"]
    os.environ["MASTER_PORT"] = base.get(key).decode()
    try:
        yield
    finally:
        os.environ["MASTER_PORT"] = saved


def _run(case: Case, accelerator: str) -> dict:
    """One case under the probe. Any exception is this case's result (the other cases still run): on a GPU the
    point is to learn every broken path in one run."""
    probe = Placement(accelerator, case.home)
    try:
        with probe.watching():
            value = case.fn(*case.args, **case.kwargs) if case.own_group else _in_job_group(case, accelerator)
    except Exception as err:  # noqa: BLE001
        if dist.is_initialized():
            dist.destroy_process_group()
        return {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()[-4000:]}
    return {"value": value, "misplaced": probe.misplaced, "steps": probe.steps}


def _in_job_group(case: Case, accelerator: str) -> Any:
    """The case in a group started as a script on the machine starts it: over NCCL and gloo on a GPU machine."""
    dist.init_process_group("cpu:gloo,cuda:nccl" if accelerator == "cuda" else "gloo")
    value = case.fn(*case.args, **case.kwargs)
    finish_group()
    return value


def judge(ranks: list[dict], case: Case) -> list[str]:
    """What is wrong with ``case`` in the job's results (one dict per rank): its errors, misplaced tensors, a
    case that never stepped, and its verdict on rank 0's result."""
    problems = []
    for rank, results in enumerate(ranks):
        got = results[case.name]
        if "error" in got:
            problems.append(f"rank {rank}: {got['error']}\n{got['traceback']}")
            continue
        problems += [f"rank {rank}: {m}" for m in got["misplaced"]]
        if case.steps and not got["steps"]:
            problems.append(f"rank {rank} took no optimizer step")
    if not problems and case.verdict is not None:
        problems += [p for p in [case.verdict(ranks[0][case.name]["value"])] if p]
    return problems


def equals(
    reference: Callable[..., Any], *args: Any, tol: float, field: str | None = "state", **kwargs: Any
) -> Verdict:
    """The result's ``field`` (the whole result: None) within ``tol`` of ``reference(*args, **kwargs)``'s state
    dict, computed in the test process."""
    return partial(_equals, partial(reference, *args, **kwargs), tol, field)


def _equals(reference: Callable[[], dict], tol: float, field: str | None, result: Any) -> str:
    got = result if field is None else result[field]
    diff = max_abs_diff(_on_host(got), _on_host(reference()))
    return "" if diff <= tol else f"{field or 'state'} is {diff:.3g} from one process (tolerance {tol:g})"


def _on_host(state: dict) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in state.items()}
