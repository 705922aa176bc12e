"""``paratrain.launch``: run a function on N local processes, for notebooks and tests.

Each process gets the same environment torchrun would give it (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``…), so
``Parallel()`` and plain ``init_process_group()`` both work inside ``fn``. The rendezvous store is hosted by
the calling process on a port the OS picked, so two jobs never race for a port. When any rank fails the others
are stopped at once and a ``RankFailedError`` names the rank and carries its traceback.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from ..env import cpu_count
from ..errors import JobTimeoutError, LaunchError, RankFailedError
from ..hang_trace import TRACE_DIR_VAR
from ..preemption import NOTE_VAR, SPAWNED_VAR
from .finish import leave
from .leaving import LEAVE_DIR_VAR, NOTICE_STORE_VAR, REJOIN_VAR
from .network import LOOPBACK
from .parent_death import die_with_parent


def launch(
    fn: Callable[..., Any],
    nprocs: int = 2,
    args: Sequence[Any] = (),
    *,
    timeout_s: float | None = None,
    threads: int | None = None,
    start_method: str = "spawn",
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` processes and return each rank's return value, in rank order.

    Args:
        fn: a picklable (module-level) function; with ``start_method="fork"`` a notebook function works too.
        nprocs: number of processes (world size).
        timeout_s: stop every process and raise ``JobTimeoutError`` after this many seconds.
        threads: intra-op threads per process (default: cores / nprocs).
        start_method: ``"spawn"`` (safe default), ``"fork"`` or ``"forkserver"`` (ranks forked from one server
            process that imported what ``multiprocessing.set_forkserver_preload`` names once: a job starts in a
            fraction of a second instead of each rank importing torch anew).
        env: extra environment variables for every process. Every method starts the ranks in this process's
            environment as it is at the call (a fork server's, from when it started, is replaced) and, as
            multiprocessing does, its working directory and ``sys.path``.
    """
    import torch.multiprocessing as tmp
    from torch.distributed import TCPStore

    if not isinstance(nprocs, int) or nprocs < 1:
        raise LaunchError(f"nprocs must be an integer >= 1, got {nprocs!r}")
    threads = threads or max(1, cpu_count() // nprocs)
    store = TCPStore(LOOPBACK, 0, None, True, timedelta(seconds=60), wait_for_workers=False)
    base_env = {
        **os.environ,
        "MASTER_ADDR": LOOPBACK,
        "MASTER_PORT": str(store.port),
        "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # every rank joins the store this process hosts
        "OMP_NUM_THREADS": str(threads),
        **(env or {}),
    }
    with tempfile.TemporaryDirectory(prefix="paratrain-launch-") as result_dir:
        parent = None if start_method == "forkserver" else os.getpid()  # a fork server starts the ranks
        entry_args = (fn, tuple(args), base_env, threads, result_dir, parent, start_method == "spawn")
        ctx = tmp.start_processes(_entry, args=entry_args, nprocs=nprocs, join=False, start_method=start_method)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=0.1):
                if deadline is not None and time.monotonic() > deadline:
                    raise JobTimeoutError(
                        f"job did not finish within {timeout_s:g} s; all {nprocs} processes were stopped"
                    )
        except tmp.ProcessRaisedException as e:
            raise RankFailedError(
                rank=e.error_index,
                exitcode=1,
                host=socket.gethostname(),
                pid=e.error_pid,
                traceback=_strip_header(str(e)),
            ) from None
        except tmp.ProcessExitedException as e:
            raise RankFailedError(
                rank=e.error_index, exitcode=e.exit_code, host=socket.gethostname(), pid=e.error_pid, traceback=None
            ) from None
        finally:
            _stop(ctx.processes)
            del store
        return [_load(os.path.join(result_dir, f"{rank}.pt")) for rank in range(nprocs)]


def _entry(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple,
    base_env: dict[str, str],
    threads: int,
    result_dir: str,
    parent: int | None,
    spawned: bool,
) -> None:
    import torch

    die_with_parent(parent if parent is not None else os.getppid())  # a fork server's child: with the server
    os.environ.clear()  # the caller's environment now, not the one a fork server started in
    os.environ.update(base_env)
    os.environ.update(
        {"RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": "0", "TORCHELASTIC_RESTART_COUNT": "0"}
    )
    os.environ[SPAWNED_VAR] = "1"  # torch's spawn ends the ranks left after a failure with SIGTERM
    # an outer paratrain run's: no rank here may leave, nor write over the outer ranks' flight-recorder traces
    for var in (LEAVE_DIR_VAR, NOTICE_STORE_VAR, REJOIN_VAR, NOTE_VAR, TRACE_DIR_VAR):
        os.environ.pop(var, None)
    torch.set_num_threads(threads)
    result = fn(*args)
    torch.save(result, os.path.join(result_dir, f"{local_rank}.pt"))
    if spawned:  # end as multiprocessing ends its forked children, without the finalization gloo's threads abort
        leave(0)


def _load(path: str) -> Any:
    import torch

    if not os.path.exists(path):  # the rank ended with exit code 0 before fn returned (a parameter server's)
        return None
    return torch.load(path, weights_only=False)  # our own file, written a moment ago by a child


def _stop(processes: list) -> None:
    """Kill whatever is still alive (after a timeout or an interrupt) and reap it."""
    for p in processes:
        if p.is_alive():
            p.kill()
    for p in processes:
        p.join(timeout=5)


def _strip_header(message: str) -> str:
    marker = "terminated with the following error:\n"
    return message.split(marker, 1)[-1].strip()
