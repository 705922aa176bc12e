"""The root cause of a failed job, in one screen: rank, host, exit code, traceback."""
from __future__ import annotations

import socket

from ..errors import RankFailedError

_MAX_TRACE_LINES = 30
_OWN_ERRORS = tuple(f"paratrain.errors.{name}" for name in ("ParatrainError", "ConfigError", "UnknownStrategyError",
                                                            "LaunchError", "CheckpointError"))


# Errors a rank raises because a peer died first: never the root cause when a real one is there.
_SECONDARY = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "NCCL communicator was aborted",
              "has been closed", "Socket Timeout")


def from_child_failed(err: object) -> RankFailedError:
    """Turn torchelastic's ``ChildFailedError`` into a ``RankFailedError`` for its root cause.

    Failures are ordered by time (torchelastic records whole seconds); within a second a rank's own error
    comes before errors that only report a dead peer.
    """
    failures = err.failures  # type: ignore[attr-defined]
    rank = min(failures, key=lambda r: (failures[r].timestamp, _is_secondary(failures[r].message)))
    failure = failures[rank]
    data = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    trace = None
    if isinstance(data, dict):
        trace = data.get("extraInfo", {}).get("py_callstack") or data.get("message")
    return RankFailedError(rank=rank, exitcode=failure.exitcode, host=socket.gethostname(), pid=failure.pid,
                           traceback=trace)


def _is_secondary(message: object) -> bool:
    text = str(message)
    return any(marker in text for marker in _SECONDARY)


def user_frames(trace: str) -> str:
    """The traceback without the launcher's own frames (runpy, the worker bootstrap, ``@record``)."""
    lines = trace.rstrip().splitlines()
    own = ("<frozen runpy>", "paratrain/launch/worker.py", "elastic/multiprocessing/errors/__init__.py",
           "multiprocessing/spawn.py")
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
    own = next((last.split(": ", 1)[1] for prefix in _OWN_ERRORS if last.startswith(prefix + ": ")), None)
    if own is not None:
        return f"paratrain: error: {own} (rank {err.rank})"
    lines = [f"paratrain: {err}", f"  rank {err.rank}  host {err.host}  pid {err.pid}"]
    if _is_secondary(last):
        lines.append("  this rank lost a peer that failed first: on a multi-node job, the root cause is in the "
                     "report of the node that failed first")
    if err.traceback:
        tb = user_frames(err.traceback).splitlines()
        if len(tb) > _MAX_TRACE_LINES:
            tb = ["  …", *tb[-_MAX_TRACE_LINES:]]
        lines.append(f"  traceback of rank {err.rank}:")
        lines.extend("    " + line for line in tb)
    elif err.exitcode < 0:
        lines.append("  no traceback: the process was killed by a signal (out of memory? killed by a scheduler?)")
    return "\n".join(lines)
