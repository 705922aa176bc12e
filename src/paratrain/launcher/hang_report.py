"""The launcher's one-screen report of a stalled collective, from the ranks' flight-recorder traces.

The traces are those :mod:`paratrain.hang_trace` had every live rank write when a collective stalled. torch's own
analyser (``torch.distributed.flight_recorder.components``, what ``python -m
torch.distributed.flight_recorder.fr_trace DIR`` runs) matches the ranks' entries by process group and sequence
number and finds the first collective that some rank never entered, or entered with another op or other sizes;
this module words it, and adds what each rank was doing: the collective it waits in (not yet completed), or, in
none, the last it completed, with the user's line that made it. A rank that left no trace (it died in a C++
abort, or hangs holding the GIL) is named as such.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..hang_trace import FILE_PREFIX

_MAX_RANK_LINES = 8
_ANALYSER_LOGGER = "Flight Recorder"
_NOT_USER = (os.sep + "torch" + os.sep, os.sep + "paratrain" + os.sep, "contextlib.py", "<frozen")


def hang_report(folder: str, ended: dict[int, str] | None = None) -> str | None:
    """The report of the traces in ``folder`` (None when there are none); ``ended``: how ranks the launcher saw
    die ended (``killed by SIGABRT``), said of those that left no trace."""
    traces = read_traces(folder)
    if not traces:
        return None
    ranks = sorted(traces)
    lines = [
        f"paratrain: flight recorder: traces of rank{'s' if len(ranks) > 1 else ''} {_list(ranks)} in {folder} "
        f"(python -m torch.distributed.flight_recorder.fr_trace {folder} --allow-incomplete-ranks -p {FILE_PREFIX})"
    ]
    first = first_bad_collective(traces)
    if first is not None:
        lines.append(f"  {first.text}")
    expected = sorted(_members(traces) | set(traces))
    for rank in expected[:_MAX_RANK_LINES]:
        lines.append(f"  rank {rank} {_doing(traces.get(rank), first, (ended or {}).get(rank))}")
    if len(expected) > _MAX_RANK_LINES:
        lines.append(f"  … ({len(expected) - _MAX_RANK_LINES} more ranks in the traces)")
    return "\n".join(lines)


def read_traces(folder: str) -> dict[int, dict[str, Any]]:
    """Rank -> its trace, as torch's loader reads it (``read_dump``); none on a torch without that loader."""
    try:
        from torch.distributed.flight_recorder.components.loader import read_dump
    except ImportError:
        return {}

    traces: dict[int, dict[str, Any]] = {}
    names = os.listdir(folder) if os.path.isdir(folder) else []
    for name in names:
        if name.startswith(FILE_PREFIX) and name[len(FILE_PREFIX) :].isdigit():
            with contextlib.suppress(Exception):  # a partial NCCL dump, another torch's format: left out
                trace = read_dump(FILE_PREFIX, os.path.join(folder, name))
                traces[int(trace["rank"])] = trace
    return traces


@dataclass(frozen=True)
class Verdict:
    """The first collective the ranks did not all make alike, as torch's analyser found it."""

    text: str
    group: str
    """The process group's name as the entries give it (``process_group[0]``)."""
    seq: int
    entered: frozenset[int]
    """Ranks that entered it (and, once it timed out, gloo marks completed): they are stuck there."""


def first_bad_collective(traces: dict[int, dict[str, Any]]) -> Verdict | None:
    """torch's verdict on the first collective the ranks did not all make alike, worded; None when they did (or
    the analyser cannot read these traces)."""
    try:
        collectives = _analyse(traces)
    except Exception:  # noqa: BLE001 - the per-rank lines still say where each rank is
        return None
    for c in collectives:
        head = f"{_group(c.pg_desc)} #{c.collective_seq_id}"
        group = c.pg_desc.partition(":")[0]
        if c.mismatch_collectives:
            others = "; ".join(
                f"rank {r} called {_op(o.collective_name)} (sizes {o.input_sizes})"
                for r, o in sorted(c.mismatch_collectives.items())
            )
            mine = f"{_op(c.collective_name)} (sizes {c.input_sizes})"
            text = f"{head}: the ranks disagree: {mine} on the others, {others}"
            return Verdict(text, group, c.collective_seq_id, frozenset(c.expected_ranks))
        if c.missing_ranks:
            entered = sorted(set(c.expected_ranks) - set(c.missing_ranks))
            text = (
                f"{head} {_op(c.collective_name)} (sizes {c.input_sizes}): "
                f"rank{'s' if len(entered) > 1 else ''} {_list(entered)} entered it, "
                f"rank{'s' if len(c.missing_ranks) > 1 else ''} {_list(sorted(c.missing_ranks))} never did"
            )
            return Verdict(text, group, c.collective_seq_id, frozenset(entered))
    return None


def _analyse(traces: dict[int, dict[str, Any]]) -> list[Any]:
    """torch's ``build_db`` over these traces (its logger silenced: it prints its findings itself)."""
    with _quiet_analyser():
        from torch.distributed.flight_recorder.components.builder import build_db

        args = argparse.Namespace(verbose=False, just_print_entries=False, allow_incomplete_ranks=True, mismatch_cap=10)
        details = {f"{FILE_PREFIX}{r}": {**t, "entries": list(t["entries"])} for r, t in traces.items()}
        version = str(next(iter(traces.values()))["version"])
        return list(build_db(details, args, version).collectives)


@contextlib.contextmanager
def _quiet_analyser() -> Iterator[None]:
    logger = logging.getLogger(_ANALYSER_LOGGER)
    saved, logger.disabled = logger.disabled, True
    try:
        yield
    finally:
        logger.disabled = saved


def _doing(trace: dict[str, Any] | None, verdict: Verdict | None, ended: str | None) -> str:
    """``waits in default_pg #3 all_reduce (sizes [[4]], train.py:22)``, or the last one it completed."""
    if trace is None and ended:
        why = " (gloo aborts a rank that is sent more than its tensor holds: sizes differ between ranks)"
        why *= "SIGABRT" in ended
        return f"ended ({ended}) and left no trace{why}"
    if trace is None:
        return "left no trace (it had exited, died, or was stuck holding the interpreter)"
    entries = trace["entries"]
    waiting = [e for e in entries if not e.get("retired", True) or _stuck_in(e, trace["rank"], verdict)]
    if waiting:
        return f"waits in {_entry(waiting[0])}"
    if entries:
        return f"is in no collective; last completed {_entry(entries[-1])}"
    return "made no collective"


def _stuck_in(e: dict[str, Any], rank: int, verdict: Verdict | None) -> bool:
    return (
        verdict is not None
        and rank in verdict.entered
        and (e["process_group"][0], e["collective_seq_id"]) == (verdict.group, verdict.seq)
    )


def _entry(e: dict[str, Any]) -> str:
    name, desc = e["process_group"]
    line = _user_line(e.get("frames") or [])
    where = f", {line}" if line else ""
    op = f"#{e['collective_seq_id']} {_op(e['profiling_name'])}"
    return f"{_group(f'{name}:{desc}')} {op} (sizes {e['input_sizes']}{where})"


def _user_line(frames: list[dict[str, Any]]) -> str | None:
    """``train.py:22``: the innermost frame outside torch and paratrain."""
    for frame in frames:
        path = str(frame.get("filename", ""))
        if path and not any(part in path for part in _NOT_USER):
            return f"{os.path.basename(path)}:{frame.get('line')}"
    return None


def _members(traces: dict[int, dict[str, Any]]) -> set[int]:
    """Every rank of the groups the traces name (a rank that dumped nothing is one of them)."""
    import ast

    ranks: set[int] = set()
    for trace in traces.values():
        for pg in trace.get("pg_config", {}).values():
            with contextlib.suppress(ValueError, SyntaxError, TypeError):
                ranks.update(int(r) for r in ast.literal_eval(pg["ranks"]))
    return ranks


def _group(pg_desc: str) -> str:
    """``0:default_pg`` -> ``default_pg``; an undescribed group keeps its number."""
    name, _, desc = pg_desc.partition(":")
    return f"group {desc}" if desc and desc != "undefined" else f"group {name}"


def _op(profiling_name: str) -> str:
    """``gloo:all_reduce`` -> ``all_reduce``."""
    return profiling_name.rpartition(":")[2]


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
