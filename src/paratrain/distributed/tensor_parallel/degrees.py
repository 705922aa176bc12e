"""How a tensor-parallel degree sits with the other degrees of a job: one option spelling, one mesh.

``Parallel("tp")`` splits every layer over all ranks; ``Parallel("ddp", tp=2)`` / ``Parallel("zero3", tp=2)`` make
groups of 2 ranks that split every layer and replicate (or shard) across the groups. The mesh is ``(dp, tp)`` with
``tp`` innermost, as torchtitan lays it out: the ranks of one tensor-parallel group are neighbours (on a GPU node,
the ones joined by NVLink), since they talk inside every layer. Pipelines put their stages between the two:
``Parallel("pipeline", tp=2)`` on ``(pp, tp)``, ``Parallel("hybrid", dp=2, tp=2)`` on ``(dp, pp, tp)``
(:mod:`paratrain.strategies.pipeline`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ...composition import refuse_degree
from ...errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle


def tp_degree(strategy: str, degree: int | None, world_size: int) -> int:
    """The ranks of one tensor-parallel group (``degree``, or every rank when None); a world size the degree does
    not divide names the layouts that fit."""
    tp = world_size if degree is None else degree
    if world_size % tp:
        fits = [f"{strategy} tp={d} ({world_size // d} x {d})" for d in range(2, world_size + 1) if world_size % d == 0]
        raise ConfigError(
            f"{strategy} with tp={tp} does not fit {world_size} processes (tp must divide them); "
            f"valid layouts: {', '.join(fits) or 'none, launch an even number of processes'}"
        )
    return tp


def refuse_tp(strategy: str, options: dict[str, Any]) -> None:
    """One line for a strategy that does not compose with tensor parallelism (yet) but was given ``tp``."""
    if "tp" in options or "tp_plan" in options:
        raise ConfigError(refuse_degree(strategy, "tp", options.get("tp")))


def cli_options(strategy: str, tp: int | None, plan: Mapping[str, str | ParallelStyle] | None = None) -> dict[str, Any]:
    """The strategy options a command's ``--tp N`` means (demo, bench, verify): nothing when it is off; for the
    ``tp`` strategy, which splits over every rank, the plan (and the degree when given, checked against the world);
    for ddp/zero2/zero3/pipeline/hybrid the degree and the plan. ``plan``: the command's model's own, when it has no
    built-in one."""
    if strategy != "tp" and tp in (None, 1):
        return {}
    options: dict[str, Any] = {} if tp is None else {"tp": tp}
    if plan is not None:
        options["tp_plan"] = dict(plan)
    return options
