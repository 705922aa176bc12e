"""The root cause of a failed job, in one screen: rank, host, exit code, traceback."""

from __future__ import annotations

import re
import signal
import socket

from ..call_watch import mentions_stall
from ..errors import RankFailedError, _last_line, describe_exitcode

_MAX_TRACE_LINES = 30
_OWN_ERROR = re.compile(r"^paratrain\.errors\.\w+: (.*)$")
"""The last line of a traceback that ends in one of paratrain's own (one-line) errors."""
_SIGNAL_HINTS = {
    signal.SIGKILL: "the process was killed (out of memory? killed by a scheduler?)",
    signal.SIGABRT: (
        "the process aborted inside torch's C++ code: gloo and NCCL abort a rank whose peer failed or "
        "that called a different collective than its peers (TORCH_DISTRIBUTED_DEBUG=DETAIL names "
        "mismatched collectives); the other ranks' errors may say more"
    ),
    signal.SIGSEGV: "the process crashed (segmentation fault) in native code",
    signal.SIGTERM: "the process was terminated (by a scheduler, a user, or its launcher)",
}


# Errors a rank raises because a peer died first: never the root cause when a real one is there.
_SECONDARY = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
    "has been closed",
    "Socket Timeout",
    "left the job first",
)


def from_child_failed(err: object) -> RankFailedError:
    """Turn torchelastic's ``ChildFailedError`` into a ``RankFailedError`` for its root cause.

    A rank ended by SIGTERM is one the launcher stopped because another failed, unless every rank was (a
    scheduler stopping the job): it never outranks another failure. Nor does an error that only reports a dead
    peer: a SIGKILLed rank is stamped when the launcher notices it (torchelastic records whole seconds), which can
    be a second after its peer wrote "Connection closed by peer". Otherwise failures are ordered by time.
    """
    failures = err.failures  # type: ignore[attr-defined]
    rank = min(
        failures,
        key=lambda r: (
            failures[r].exitcode == -signal.SIGTERM,
            _is_secondary(failures[r].message),
            failures[r].timestamp,
            failures[r].exitcode < 0,
            r,
        ),
    )
    failure = failures[rank]
    trace = trace_of(failure)
    own = own_error(trace)
    same = tuple(
        r for r in sorted(failures) if r != rank and own is not None and own_error(trace_of(failures[r])) == own
    )
    stopped = (
        ()
        if failure.exitcode == -signal.SIGTERM
        else tuple(r for r in sorted(failures) if failures[r].exitcode == -signal.SIGTERM)
    )
    return RankFailedError(
        rank=rank,
        exitcode=failure.exitcode,
        host=socket.gethostname(),
        pid=failure.pid,
        traceback=trace,
        ranks=(rank, *same),
        stopped=stopped,
    )


def collective_failure(exitcode: int, traceback: str | None) -> bool:
    """A rank ended by a collective: a timeout, a lost peer, a paratrain collective error, or an abort in torch's
    C++ code (gloo aborts a rank that is sent more than its tensor holds), not by the user's own error."""
    return exitcode == -signal.SIGABRT or mentions_stall(traceback or "")


def trace_of(failure: object) -> str | None:
    file_data = getattr(failure, "error_file_data", None)
    data = file_data.get("message") if isinstance(file_data, dict) else None
    if isinstance(data, dict):
        return data.get("extraInfo", {}).get("py_callstack") or data.get("message")
    return None


def own_error(trace: str | None) -> str | None:
    """The message of a paratrain error a traceback ends in, or None."""
    last = trace.strip().splitlines()[-1] if trace and trace.strip() else ""
    found = _OWN_ERROR.match(last)
    return found[1] if found else None


def _is_secondary(message: object) -> bool:
    text = str(message)
    return any(marker in text for marker in _SECONDARY)


def user_frames(trace: str) -> str:
    """The traceback without the launcher's own frames (runpy, the worker bootstrap, ``@record``)."""
    lines = trace.rstrip().splitlines()
    own = (
        "<frozen runpy>",
        "paratrain/launcher/worker.py",
        "paratrain/tf/worker.py",
        "elastic/multiprocessing/errors/__init__.py",
        "multiprocessing/spawn.py",
    )
    kept: list[str] = []
    skip_body = False
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith('File "'):
            skip_body = any(marker in stripped for marker in own)
            if skip_body:
                continue
        elif skip_body and line.startswith("  "):
            continue
        else:
            skip_body = False
        kept.append(line)
    return "\n".join(kept)


def format_failure(err: RankFailedError) -> str:
    """A short report that leads with the failing rank and ends with the tail of its traceback.

    A paratrain error (bad options, detected identically on every rank) is already a one-line diagnosis:
    it is shown alone, without the traceback.
    """
    last = err.traceback.strip().splitlines()[-1] if err.traceback and err.traceback.strip() else ""
    own = own_error(err.traceback)
    if own is not None:
        return f"paratrain: error: {own} ({_which(getattr(err, 'ranks', (err.rank,)))})"
    lines = [f"paratrain: {err}", f"  rank {err.rank}  host {err.host}  pid {err.pid}"]
    stopped = getattr(err, "stopped", ())
    if stopped:
        lines.append(f"  {_which(stopped)} stopped by the launcher ({err.stopped_by}) after this failure")
    if _is_secondary(last):
        lines.append(
            "  this rank lost a peer that failed first: on a multi-node job, the root cause is in the "
            "report of the node that failed first"
        )
    lines.extend(_cause(err.rank, err.exitcode, err.traceback))
    return "\n".join(lines)


def format_leave(rank: int, host: str, pid: int | None, exitcode: int, traceback: str | None, then: str) -> str:
    """The report of a rank that allowed leaving and died (:mod:`paratrain.launcher.leaving`): the failure report's
    shape, saying what happens next (``then``) instead of that the job was stopped."""
    lines = [
        f"paratrain: rank {rank} left the job on {host} ({failure_cause(exitcode, traceback)}); {then}",
        f"  rank {rank}  host {host}  pid {pid}",
    ]
    lines.extend(_cause(rank, exitcode, traceback))
    return "\n".join(lines)


def failure_cause(exitcode: int, traceback: str | None) -> str:
    """How a rank ended, in a few words: ``exit code 1: ValueError: …`` or ``killed by SIGKILL``."""
    cause = _last_line(traceback)
    return f"{describe_exitcode(exitcode)}{': ' + cause if cause else ''}"


def _cause(rank: int, exitcode: int, traceback: str | None) -> list[str]:
    """The tail of the rank's traceback, or what its signal usually means."""
    if traceback:
        tb = user_frames(traceback).splitlines()
        if len(tb) > _MAX_TRACE_LINES:
            tb = ["  …", *tb[-_MAX_TRACE_LINES:]]
        return [f"  traceback of rank {rank}:", *("    " + line for line in tb)]
    if exitcode < 0:
        hint = _SIGNAL_HINTS.get(-exitcode, "the process was killed by a signal")  # type: ignore[call-overload]
        return [f"  no traceback: {hint}"]
    return []


def _which(ranks: tuple[int, ...]) -> str:
    """``rank 3`` or ``ranks 0, 2``."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, sorted(ranks)))}"
