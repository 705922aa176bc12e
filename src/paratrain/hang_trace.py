"""Every live rank's flight-recorder trace, written when a collective stalls (read by
:mod:`paratrain.launcher.hang_report`).

torch's flight recorder (``TORCH_FR_BUFFER_SIZE``) keeps, per rank, the last N collectives that rank entered: the
process group, sequence number, op, sizes and whether it completed (gloo included, torch 2.13). ``paratrain run``
turns it on for its workers and gives them a folder (``PARATRAIN_TRACE_DIR``); each worker keeps a thread that
waits, on the job's store, for a request to dump. A request comes from whichever rank sees the stall first:
paratrain's call watch when a call has waited past its report threshold, or a rank whose collective timed out or
lost its peer. Every rank that is still alive then writes ``rank_<rank>`` there, including a rank that is in no
collective at all (stuck in its data loader): its trace says what it completed last. On NCCL, torch's own
watchdog dumps on a timeout to the same files (``TORCH_FR_DUMP_TEMP_FILE``).

gloo's recorder leaves its process-group table empty (``pg_config``); each dump here fills it in from the process
groups this rank holds, so torch's analyser (``torch.distributed.flight_recorder``) can match the ranks' entries.
On a torch without ``_dump_fr_trace`` nothing is turned on and nothing is written.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import threading
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

TRACE_DIR_VAR = "PARATRAIN_TRACE_DIR"
"""The folder every rank of the job writes its trace to (set by ``paratrain run``)."""
BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
DEFAULT_BUFFER_SIZE = 2000
"""Collectives kept per rank: a few training steps of a model sharded per block."""
FILE_PREFIX = "rank_"
DUMP_WAIT_S = 10.0
"""How long the launcher waits for the traces of the ranks a failure left before it stops them (a first dump with
stacks takes seconds on a busy machine); the last answer ends the wait."""
_SETTLE_TRIES = 20
"""Dumps 10 ms apart while the newest collective is not completed: 0.2 s for a rank that does wait in one."""
_USER_BUFFER_VARS = (BUFFER_VAR, "TORCH_NCCL_TRACE_BUFFER_SIZE")
_DUMP_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
"""The dump file's prefix under torch 2.9's name and the one before it (torch reads either)."""


def recorder_available() -> bool:
    """This torch can dump a rank's flight-recorder trace."""
    from torch._C import _distributed_c10d

    return hasattr(_distributed_c10d, "_dump_fr_trace")


def recorder_environ(folder: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables the workers get: the recorder on, its dumps in ``folder``; a size the user set wins (0 turns
    the recorder off)."""
    env = {TRACE_DIR_VAR: folder}
    if not any(var in environ for var in _USER_BUFFER_VARS):
        env[BUFFER_VAR] = str(DEFAULT_BUFFER_SIZE)
    if not any(var in environ for var in _DUMP_FILE_VARS):  # NCCL's watchdog writes <prefix><rank> on a timeout
        env.update(dict.fromkeys(_DUMP_FILE_VARS, os.path.join(folder, FILE_PREFIX)))
    if "TORCH_NCCL_DUMP_ON_TIMEOUT" not in environ:
        env["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    return env


def dump_trace(folder: str, rank: int, *, stacks: bool = True) -> bool:
    """Write this rank's trace to ``folder/rank_<rank>`` (whole, or not at all); False when there is none.

    A trace with no newer collective than the one this process wrote there before is not written: once a
    collective has timed out, gloo marks it completed, and the trace taken while it waited is the one that says
    where the rank is stuck. A trace of an earlier attempt's process (``--max-restarts``) is always replaced.
    ``stacks``: each collective's Python stack (the user's line in the report); torch's first dump with stacks
    takes seconds (0.1 s without), so a rank that merely ends writes none.
    """
    try:
        from torch._C._distributed_c10d import _dump_fr_trace
    except ImportError:
        return False
    for _ in range(_SETTLE_TRIES):  # gloo marks a finished collective completed a moment later, from its thread
        trace = pickle.loads(_dump_fr_trace(includeCollectives=True, includeStackTraces=stacks, onlyActive=False))
        if not trace.get("entries") or trace["entries"][-1].get("retired", True):
            break
        time.sleep(0.01)
    path = os.path.join(folder, f"{FILE_PREFIX}{rank}")
    if not trace.get("entries") or _last_record(trace) <= _last_record(_read(path), os.getpid()):
        return False
    trace["pg_config"] = {**trace.get("pg_config", {}), **_process_groups()}
    trace["pid"] = os.getpid()
    with open(f"{path}.{os.getpid()}.tmp", "wb") as f:
        pickle.dump(trace, f)
    os.replace(f"{path}.{os.getpid()}.tmp", path)
    return True


def _read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError):
        return {}


def _last_record(trace: dict[str, Any], pid: int | None = None) -> int:
    """The newest collective's record id (-1: none, or written by another process than ``pid``)."""
    entries = trace.get("entries") or [{"record_id": -1}]
    return int(entries[-1]["record_id"]) if pid is None or trace.get("pid") == pid else -1


def _process_groups() -> dict[str, dict[str, str]]:
    """The process groups this rank holds, as the recorder's ``pg_config`` names them (name -> desc, ranks)."""
    from torch.distributed import distributed_c10d as c10d

    if not c10d.is_initialized() or not hasattr(c10d, "_get_all_pg_configs"):
        return {}
    return {
        str(pg["pg_name"]): {"name": str(pg["pg_name"]), "desc": pg["pg_desc"], "ranks": str(list(pg["ranks"]))}
        for pg in c10d._get_all_pg_configs()
    }


class TraceDumps:
    """One worker's side of the dumps: a thread that dumps on request, and :meth:`request` for a rank that saw a
    collective stall. Requests are numbered keys of the job's store (``paratrain/trace/<attempt>/…``); a rank
    answers each by writing its trace and then its number under ``done/<rank>``."""

    def __init__(self, folder: str, environ: Mapping[str, str]) -> None:
        self.folder = folder
        self.rank, self.world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        self._environ = dict(environ)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> TraceDumps | None:
        """The dumps of a worker of ``paratrain run`` (None outside one, or without a recorder)."""
        env = os.environ if environ is None else environ
        folder = env.get(TRACE_DIR_VAR)
        if not folder or not all(env.get(v) for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
            return None
        if env.get(BUFFER_VAR, "1") == "0" or not recorder_available():
            return None
        return cls(folder, env)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self._serve, name="paratrain-trace-dumps", daemon=True)
        thread.start()
        return thread

    def dump(self, *, stacks: bool = True) -> None:
        """Write this rank's trace now (``stacks=False``: a rank that ends, whose peers may still wait for it)."""
        try:
            dump_trace(self.folder, self.rank, stacks=stacks)
        except Exception:  # noqa: BLE001 - diagnostics never fail the rank
            pass

    def request(self) -> None:
        """Write this rank's trace and ask every other rank for theirs, without waiting for them: the launcher
        waits for the ranks still alive before it stops them (:func:`ask_for_traces`)."""
        self.dump()
        with contextlib.suppress(Exception):  # diagnostics never replace the error that brought us here
            ask_for_traces(self._environ, [], wait_s=0.0)

    def _serve(self) -> None:
        """Answer requests from the first process group on (no collective is recorded before it, and the store
        may start with it: a failed connection is a C++ warning on stderr) until the store goes away."""
        import torch.distributed as dist

        prefix, served = _prefix(self._environ), 0
        store = None
        while store is None:
            time.sleep(0.5)
            if dist.is_initialized():
                with contextlib.suppress(Exception):
                    store = _connect(self._environ)
        try:
            while True:
                store.wait([f"{prefix}/request/{served + 1}"], timedelta(days=1))
                served = int(store.add(f"{prefix}/requests", 0))
                self.dump()
                store.set(f"{prefix}/done/{self.rank}", str(served))
        except Exception:  # noqa: BLE001 - the store is gone: nobody is left to ask
            return


def ask_for_traces(environ: Mapping[str, str], ranks: list[int], wait_s: float = DUMP_WAIT_S) -> None:
    """Ask every rank of the job whose worker environment is ``environ`` to write its trace, and wait at most
    ``wait_s`` for ``ranks`` to have done so (the launcher asks before it stops the ranks a failure left)."""
    store, prefix = _connect(environ), _prefix(environ)
    n = store.add(f"{prefix}/requests", 1)
    store.set(f"{prefix}/request/{n}", "1")
    keys = [f"{prefix}/done/{r}" for r in ranks]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(store.check([k]) and int(store.get(k)) >= n for k in keys):
        time.sleep(0.05)


def _prefix(environ: Mapping[str, str]) -> str:
    return f"paratrain/trace/{environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _connect(environ: Mapping[str, str]) -> Any:
    """A connection of the calling thread's own to the job's store (a client is not shared between threads)."""
    from torch.distributed import TCPStore

    host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10))
