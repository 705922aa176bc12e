"""What composes with what: the one table of which strategies take tensor (``tp``), context (``cp``) and expert
(``ep``) parallelism, and the rules between those degrees.

The presets and pipelines refuse what it refuses, the planner's candidate layouts and ``auto`` are filtered by it, and
the dry run builds through the runtime that reads it: a layout the planner emits is one the runtime builds. The
divisibility of the degrees (``ep`` dividing the ranks that hold one copy, ``mp`` beside nothing) is
:class:`~paratrain.dims.ParallelDims`'s. Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Takes:
    """Which degrees a strategy takes beside its own."""

    tp: Literal["option", "all", "never"] = "option"
    """``option``: ``tp=N`` makes groups of N ranks that split each layer; ``all``: every rank splits each layer;
    ``never``: the strategy does not compose with tensor parallelism."""
    cp: bool = False
    """Whether ``cp=N`` (ranks that split each sequence) composes with it."""
    ep: bool = False
    """Whether ``ep=N`` (data-parallel ranks that split every mixture-of-experts layer's experts) composes with it."""


TAKES: dict[str, Takes] = {
    "single": Takes(tp="never"),
    "ddp": Takes(cp=True, ep=True),
    "zero1": Takes(),  # ZeroRedundancyOptimizer holds whole parameters: no split experts, no cp's mesh
    "zero2": Takes(cp=True, ep=True),
    "zero3": Takes(cp=True, ep=True),
    "hsdp": Takes(tp="never", cp=True),
    "tp": Takes(tp="all"),
    "pipeline": Takes(),  # no replicas for ep to split the experts over
    "hybrid": Takes(ep=True),
    "model_parallel": Takes(tp="never"),
    "dp": Takes(tp="never"),
    "ps": Takes(tp="never"),
}
"""Every strategy by name (aliases are their preset's); a strategy missing here takes nothing beside its own."""

PIPELINES = ("pipeline", "hybrid")
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")
"""Pipeline schedules that split each backward into its input and its weight gradients, the latter run later to
fill the bubble (torch's ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``). The
weight half runs through ``torch.autograd.grad``: no ``DistributedDataParallel`` hook fires (a pipeline's ``ddp``
replicates with FSDP2's ``replicate`` under them), and FSDP keeps each stage gathered through the step."""

CP_METHODS = ("auto", "ulysses", "allgather")
"""How ``cp`` ranks run attention over whole sequences (``cp_method=``): ``ulysses``, an all-to-all trading the
sequence split for a head split (heads and key/value heads must divide by tp x cp); ``allgather``, every rank
gathers the keys and values and computes its own queries' rows (any head count; the sequence head-tail balanced);
``auto``, Ulysses where the heads divide, else the all-gather."""


def cp_method(requested: str, heads: int | None, kv_heads: int | None, ranks: int) -> str:
    """The method ``cp`` runs for ``requested`` (one of :data:`CP_METHODS`) on attention with ``heads`` query and
    ``kv_heads`` key/value heads (None: not known before the first call) split over ``ranks`` (tp x cp). Ulysses
    runs the kernel on whole sequences with its own causal flag (flash kernels take it); the all-gather hands the
    kernel a mask of its rows (which keeps SDPA off its flash kernels) and holds a layer's whole keys and values, so
    it is chosen only where Ulysses cannot split the heads (its bytes are no reason: under GQA fewer below cp =
    heads / kv_heads + 1)."""
    if requested != "auto":
        return requested
    if heads is None or all(n % ranks == 0 for n in (heads, kv_heads or heads)):
        return "ulysses"
    return "allgather"


def takes(name: str) -> Takes:
    """What strategy ``name`` takes (``fsdp`` is ``zero3``)."""
    return TAKES.get("zero3" if name == "fsdp" else name, Takes(tp="never"))


def names_taking(degree: Literal["tp", "cp", "ep"]) -> list[str]:
    """The strategies that take ``degree`` beside their own (``tp``: as an option), in the table's order."""
    return [n for n, t in TAKES.items() if (t.tp == "option" if degree == "tp" else getattr(t, degree))]


def refusal(
    name: str, *, tp: int = 1, cp: int = 1, ep: int = 1, data: str = "ddp", schedule: str = "1f1b"
) -> str | None:
    """Why strategy ``name`` cannot take these degrees together (one line), or None when it can. ``data``: a
    pipeline's data engine (``ddp``, ``zero1``, ``fsdp``); ``schedule``: its schedule."""
    rule = takes(name)
    if tp > 1 and rule.tp == "never":
        return refuse_degree(name, "tp", tp)
    if cp > 1 and not rule.cp:
        return refuse_degree(name, "cp", cp)
    if ep > 1 and name == "pipeline":
        return (
            f"strategy 'pipeline' has one replica, no data-parallel ranks to split experts over (ep={ep}); "
            "use Parallel('hybrid', dp=2, ep=2), which splits them over each stage's replicas"
        )
    if ep > 1 and not rule.ep:
        return refuse_degree(name, "ep", ep)
    if name in PIPELINES and ep > 1 and tp > 1:
        return (
            f"{name} with both tp and ep is not supported yet; split the experts (ep) or every layer (tp) of its "
            "stages, or use Parallel('zero3', tp=2, ep=2) without stages"
        )
    if name in PIPELINES and ep > 1 and schedule in ZERO_BUBBLE:
        return (
            f"{name} with ep under the {schedule} schedule is not supported: torch's split backward (input, then "
            "weight gradients) cannot run the experts' token exchange; use schedule='1f1b' or 'interleaved-1f1b' "
            "with ep"
        )
    if name in PIPELINES and ep > 1 and data == "zero1":
        return (
            f"{name} with data='zero1' and ep is not supported: ZeroRedundancyOptimizer cannot checkpoint split "
            "experts' state; use data='ddp' or data='fsdp' with ep"
        )
    return None


def schedule_refusal(schedule: str, *, compiled: bool) -> str | None:
    """Why pipeline ``schedule`` cannot run blocks compiled by ``torch.compile`` (one line), or None when it can."""
    if compiled and schedule in ZERO_BUBBLE:
        return (
            f"the {schedule} schedule splits each backward into input and weight gradients, which compiled blocks "
            "cannot run (a compiled backward runs once); drop compile or use schedule='1f1b' or 'interleaved-1f1b'"
        )
    return None


_EXAMPLE = {"tp": "Parallel('zero3', tp=2)", "cp": "Parallel('zero3', cp=2)", "ep": "Parallel('zero3', ep=2)"}
_WHAT = {
    "tp": "tensor parallelism runs alone (Parallel('tp')) or",
    "cp": "context parallelism runs",
    "ep": "expert parallelism runs",
}


def refuse_degree(name: str, degree: Literal["tp", "cp", "ep"], value: object = None) -> str:
    """The one line for strategy ``name`` given a degree it does not take, naming the strategies that do."""
    inside = names_taking(degree)
    listed = ", ".join(inside[:-1]) + f" and {inside[-1]}"
    given = degree if value is None else f"{degree}={value}"
    return f"strategy {name!r} does not take {given}; {_WHAT[degree]} inside {listed} ({_EXAMPLE[degree]})"
