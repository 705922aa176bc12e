"""torchrun's elastic agent, taught that some ranks may leave (:mod:`paratrain.launcher.leaving`).

torch's ``LocalElasticAgent`` watches its workers through a process context whose poll is all-or-nothing: the first
process that exits non-zero makes it close every process, and the agent then stops or restarts the whole job. Here
the context torch built is given a poll step of its own (:class:`LeavingContext`): a dead process whose rank allowed
leaving is taken out of the failures *inside* that poll, before torch can act on it, so no death can slip between
our look and torch's. Such a rank is reported and either replaced alone (a restart from the same budget as
whole-job restarts) or dropped from the running set, after which torch's own bookkeeping carries on unchanged: the
job succeeds when every other rank exits 0. Any other death, or a leaver that dies together with one, is left to
torch (stop everything, one report, restart the job).

Why this seam: ``torch.distributed.run.run`` builds its agent in ``torch.distributed.launcher.api.launch_agent``
from the module-level name ``LocalElasticAgent``, with keyword arguments only (torch 2.11 and 2.13 alike; 2.13
adds ``shutdown_timeout`` and ``health_check_server``, which pass through). Rebinding that one name for the
duration of our call (:func:`leaving_agent`) swaps the agent without re-implementing torchrun's argument handling,
rendezvous or restart loop, and touches nothing outside the call. The process context is ``SubprocessContext`` in
both versions (``paratrain run`` always starts a program) with the same attributes; ``_capture_process_failures``
and ``_close`` are the two steps of its ``_poll`` overridden, so torch's poll itself runs as written. The context is
given its subclass after torch built it (``_start_workers`` builds it from ~60 lines of worker environment that a
copy would have to follow). tests/launcher/test_leaving.py runs the same jobs on torch 2.11 and 2.13.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.elastic.agent.server.api import WorkerGroup
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing.api import SubprocessContext
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler

from ..hang_trace import TRACE_DIR_VAR, ask_for_traces
from ..preemption import stop_asked
from .failure import collective_failure, format_leave, trace_of
from .leaving import BACK, GONE, LEAVE_DIR_VAR, NOTICE_STORE_VAR, REJOIN_VAR, marker_path, notice_key


@dataclass
class Leaves:
    """What left during one ``paratrain run``, on this node: the launcher's record for its closing line."""

    folder: str
    """This launcher's marker folder (``PARATRAIN_LEAVE_DIR``)."""
    returns: dict[int, list[bool]] = field(default_factory=dict)
    """Global rank -> for each of its deaths, whether a replacement was started."""

    def record(self, rank: int, back: bool) -> None:
        self.returns.setdefault(rank, []).append(back)

    def summary(self) -> str | None:
        """``rank 1 left and came back; rank 3 left for good``, or None when no rank left."""
        parts = []
        for rank, backs in sorted(self.returns.items()):
            times = sum(backs)
            again = f" {times} times" if times > 1 else ""
            if backs[-1]:
                parts.append(f"rank {rank} left and came back{again}")
            else:
                parts.append(f"rank {rank} left for good" + (f" after coming back{again or ' once'}" if times else ""))
        return "; ".join(parts) or None


@contextlib.contextmanager
def leaving_agent() -> Iterator[Leaves | None]:
    """Have ``torch.distributed.run.run`` start a :class:`LeavingAgent` while the block runs (see the module
    docstring for why this name), with a marker folder of this launcher's own, removed at the end.

    Yields None, and exports no folder (``allow_leaving`` then returns False), on a torch that builds its agent
    some other way: there every death stops the job, as under torchrun.
    """
    from torch.distributed.launcher import api

    if getattr(api, "LocalElasticAgent", None) is not LocalElasticAgent:
        yield None
        return
    leaves = Leaves(tempfile.mkdtemp(prefix="paratrain-leave-"))
    saved = {var: os.environ.get(var) for var in (LEAVE_DIR_VAR, NOTICE_STORE_VAR)}
    os.environ[LEAVE_DIR_VAR] = leaves.folder
    api.LocalElasticAgent = functools.partial(LeavingAgent, leaves=leaves)  # type: ignore[misc]
    try:
        yield leaves
    finally:
        api.LocalElasticAgent = LocalElasticAgent  # type: ignore[misc]
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        shutil.rmtree(leaves.folder, ignore_errors=True)


class LeavingAgent(LocalElasticAgent):
    """``LocalElasticAgent`` that lets ranks which allowed it die, or come back, without stopping the job."""

    def __init__(self, *args: Any, leaves: Leaves, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._leaves = leaves
        self._process_number: dict[int, int] = {}
        """Local rank -> n of its current process in this attempt (1: the original)."""
        self._notices: Any = None

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Every attempt starts with no markers; its workers learn where the notice store is."""
        shutil.rmtree(self._leaves.folder, ignore_errors=True)
        os.makedirs(self._leaves.folder, exist_ok=True)
        self._notices = _tcp_store(worker_group.store)
        if self._notices is not None:  # the workers inherit the launcher's environment (as for LAUNCHER_PID_VAR)
            os.environ[NOTICE_STORE_VAR] = f"{self._notices.host}:{self._notices.port}"
        else:
            os.environ.pop(NOTICE_STORE_VAR, None)
        pids = super()._start_workers(worker_group)
        self._process_number = dict.fromkeys(pids, 1)
        if type(self._pcontext) is SubprocessContext:  # always, for paratrain run: it starts a program
            LeavingContext.adopt(self._pcontext, self._may_leave, self._left, self._ask_traces)
        return pids

    def _may_leave(self, local_rank: int) -> bool:
        rank = self._worker_group.workers[local_rank].global_rank
        return os.path.exists(marker_path(self._leaves.folder, rank, self._process_number[local_rank]))

    def _left(self, local_rank: int, failure: ProcessFailure) -> bool:
        """Report a leaver's death, tell the notice store, and replace it when restarts are left (True)."""
        context = self._pcontext
        assert isinstance(context, LeavingContext)
        worker = self._worker_group.workers[local_rank]
        spec = self._worker_group.spec
        n = self._process_number[local_rank]
        back = self._remaining_restarts > 0
        if back:
            self._remaining_restarts -= 1
            then = (
                f"restarting it alone (restart {spec.max_restarts - self._remaining_restarts} of {spec.max_restarts})"
            )
        else:
            then = "the job goes on without it"
        print(
            format_leave(
                worker.global_rank, socket.gethostname(), failure.pid, failure.exitcode, trace_of(failure), then
            ),
            file=sys.stderr,
            flush=True,
        )
        attempt = int(context.envs[local_rank].get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._notify(notice_key(worker.global_rank, n, attempt), BACK if back else GONE)
        self._leaves.record(worker.global_rank, back)
        if back:
            worker.id = context.replace(local_rank, {REJOIN_VAR: str(n)}, n)
            self._process_number[local_rank] = n + 1
        return back

    def _ask_traces(self, alive: list[int]) -> None:
        """Before the ranks a failure left are stopped: each writes its flight-recorder trace
        (:mod:`paratrain.hang_trace`), waited for a few seconds at most. ``alive``: their local ranks."""
        context = self._pcontext
        assert isinstance(context, LeavingContext)
        env = {**os.environ, **context.envs[0]}  # what a worker sees: the launcher's environment and torchrun's
        if not alive or not env.get(TRACE_DIR_VAR) or not env.get("MASTER_PORT"):
            return
        ranks = [self._worker_group.workers[r].global_rank for r in alive]
        try:
            ask_for_traces(env, ranks)
        except Exception:  # noqa: BLE001 - the store is gone with the failed rank: stop the job as it is
            pass

    def _notify(self, key: str, value: bytes) -> None:
        if self._notices is None:
            return
        try:
            self._notices.set(key, value)
        except Exception as err:  # noqa: BLE001 - the store's host is gone: nobody is left to read it
            print(f"paratrain run: could not write {key} to the notice store: {err}", file=sys.stderr, flush=True)


class LeavingContext(SubprocessContext):
    """torch's ``SubprocessContext`` whose poll hands the deaths of ranks that allowed leaving to the agent.

    ``_poll`` captures the exits of the running ranks, closes everything on any failure, and otherwise waits until
    every rank has exited. Deaths of leavers are taken out of the captured failures (when they are the only ones):
    a replaced rank stays running, a rank gone for good is done. After ``close`` nothing is taken out: ranks
    stopped with the job are the job's.
    """

    _may_leave: Callable[[int], bool]
    _left: Callable[[int, ProcessFailure], bool]
    _ask_traces: Callable[[list[int]], None]
    _closing: bool

    @classmethod
    def adopt(
        cls,
        context: SubprocessContext,
        may_leave: Callable[[int], bool],
        left: Callable[[int, ProcessFailure], bool],
        ask_traces: Callable[[list[int]], None],
    ) -> None:
        """Give the context torch built (and started) this class's poll steps."""
        context.__class__ = cls
        assert isinstance(context, LeavingContext)
        context._may_leave, context._left, context._closing = may_leave, left, False
        context._ask_traces = ask_traces

    def _capture_process_failures(self, done_local_ranks: set[int]) -> None:
        super()._capture_process_failures(done_local_ranks)
        if self._closing or not self._failures or not all(map(self._may_leave, self._failures)):
            return
        for local_rank in sorted(self._failures):
            failure = self._failures.pop(local_rank)
            if self._left(local_rank, failure):
                done_local_ranks.discard(local_rank)

    def _close(self, death_sig: signal.Signals, timeout: int = 30) -> None:
        stalled = any(collective_failure(f.exitcode, trace_of(f)) for f in self._failures.values())
        if not self._closing and stalled:  # a collective's failure stops the others: their traces first
            handlers = self.subprocess_handlers.items()
            self._ask_traces([r for r, h in handlers if r not in self._failures and h.proc.poll() is None])
        self._closing = True
        if stop_asked():  # a preemption: the ranks save first, and their DataLoader workers must live until then
            timeout = self._ranks_first(timeout)
        super()._close(death_sig, timeout)

    def _ranks_first(self, timeout: int) -> int:
        """Send SIGUSR1 (the ranks' stop: :func:`paratrain.preemption.caught_signals`) to each running rank alone and
        wait up to ``timeout`` s for them; the seconds left.

        torch's close signals each rank's process group, which holds its DataLoader workers; torch's workers die of
        SIGTERM (a handler of its own), and the rank then fails on the lost worker before it can save."""
        end = time.monotonic() + timeout
        for handler in self.subprocess_handlers.values():
            if handler.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(handler.proc.pid, signal.SIGUSR1)
        for handler in self.subprocess_handlers.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                handler.proc.wait(max(0.0, end - time.monotonic()))
        return max(0, int(end - time.monotonic()))

    def replace(self, local_rank: int, env: dict[str, str], n: int) -> int:
        """Start the n-th replacement of ``local_rank`` with its command and environment plus ``env`` and an error
        file of its own; return its pid."""
        old = self.subprocess_handlers[local_rank]
        for stream in (getattr(old, "_stdout", None), getattr(old, "_stderr", None)):
            if stream is not None:
                stream.close()
        error_file = self.error_files[local_rank]
        if error_file and error_file != os.devnull:
            base, ext = os.path.splitext(error_file)
            error_file = f"{base}-rejoin_{n}{ext}"
            env = {**env, "TORCHELASTIC_ERROR_FILE": error_file}
        self.envs[local_rank] = {**self.envs[local_rank], **env}
        self.error_files[local_rank] = error_file
        # Not under a blocked SIGTERM: the child would inherit the mask. A stop signal between the start and the
        # next line leaves the process out of the context; it still dies with the launcher (parent_death).
        handler = _AppendingHandler(
            entrypoint=self.entrypoint,
            args=self.args[local_rank],
            env=self.envs[local_rank],
            stdout=self.stdouts[local_rank],
            stderr=self.stderrs[local_rank],
            local_rank_id=local_rank,
            numa_options=self._numa_options,
        )
        self.subprocess_handlers[local_rank] = handler
        return handler.proc.pid


class _AppendingHandler(SubprocessHandler):
    """torch's process handler, appending to the log files of the process it replaces (``--redirects``) rather
    than truncating them."""

    def __init__(self, *, stdout: str | None, stderr: str | None, **kwargs: Any) -> None:
        self._logs = (stdout, stderr)
        super().__init__(stdout=None, stderr=None, **kwargs)

    def _popen(self, args: tuple, env: dict[str, str]) -> Any:
        out, err = self._logs
        self._stdout = open(out, "a") if out else None  # noqa: SIM115 - closed by the handler's close
        self._stderr = open(err, "a") if err else None  # noqa: SIM115
        return super()._popen(args, env)


def _tcp_store(store: Any) -> Any:
    """The TCPStore under the rendezvous's prefix stores (None for a rendezvous on another kind of store)."""
    from torch.distributed import TCPStore

    while store is not None and not isinstance(store, TCPStore):
        store = getattr(store, "underlying_store", None)
    return store
