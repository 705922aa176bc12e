"""Ctrl-C, SIGTERM and SIGUSR1 of ``paratrain run``: every rank stopped, one line, the conventional exit code.

torchrun's agent turns SIGINT/SIGTERM into its ``SignalException``, forwards the same signal to the workers
(SIGINT makes every rank print a ``KeyboardInterrupt`` traceback, and a rank blocked inside a collective only
sees it when the collective returns) and the launcher exits 1 after some 70 lines. Here the launcher handles
SIGINT and SIGTERM itself: it notes when the signal came and how many workers were running, and raises torch's
``SignalException`` with SIGTERM, so the agent stops every worker the way it always does (SIGTERM, SIGKILL
after its grace period, ``--shutdown-timeout`` seconds, 30 by default). The CLI then prints ``interrupted
(SIGINT), 2 ranks stopped in 0.4 s`` and exits 128 + the signal's number (130, 143).

SIGUSR1 (SLURM's ``--signal=USR1@SECONDS``) is handled as SIGTERM. Before the agent forwards either, the launcher
marks the file it named for the ranks (``PARATRAIN_PREEMPT_NOTE``) as asked to stop, so their SIGTERM is a
preemption, not the teardown after a failed rank: ranks whose ``Parallel`` has a checkpoint directory save at a
step they agree on and exit 75 (:mod:`paratrain.preemption`), writing where they saved into that file; the CLI's
line is then ``preempted (SIGTERM) at step 40, saved to …`` and its exit code 75, which ``paratrain slurm``'s
script requeues on. A second SIGTERM or SIGUSR1 during that shutdown (a scheduler's next warning, SLURM's SIGTERM at the
time limit) changes nothing: the ranks go on saving until the grace period ends. A second Ctrl-C is not waited
on: the launcher leaves at once and its workers die with it (:mod:`paratrain.launcher.parent_death`).

SIGHUP, SIGQUIT and whatever else ``--signals-to-handle`` names stay torch's. The workers see
``TORCHELASTIC_SIGNALS_TO_HANDLE`` as torchrun would have set it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field

from ..errors import PREEMPTED_EXIT_CODE, JobInterrupted, JobPreempted
from ..preemption import NOTE_VAR, Note, ask_to_stop
from .processes import children, running

SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""Which signals torchrun's agent handles itself (``--signals-to-handle``; torchrun exports it to the workers)."""
_SAVED_VAR = "PARATRAIN_SIGNALS_TO_HANDLE"
_OURS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
MARK_VAR = "PARATRAIN_PREEMPTED_MARK"
"""A file a preempted ``paratrain run`` creates, for the batch script that started it (:func:`marked`)."""


@dataclass
class StopRequest:
    """The first stop signal the launcher received."""

    signal: signal.Signals | None = None
    at: float = 0.0
    """``time.monotonic()`` when it arrived."""
    ranks: int = 0
    """Workers running at that moment."""
    children: list[int] = field(default_factory=list)

    def note(self, sig: signal.Signals) -> None:
        """Keep the first signal, when it came and the workers then running; later ones change nothing."""
        if self.signal is None:
            self.signal, self.at = sig, time.monotonic()
            self.children = children()
            self.ranks = len(self.children)

    def interrupted(self) -> JobInterrupted:
        """The error the CLI prints for it, once the launcher has stopped the workers."""
        assert self.signal is not None
        return JobInterrupted(
            self.signal, ranks=self.ranks, seconds=time.monotonic() - self.at, left=running(self.children)
        )


@contextlib.contextmanager
def caught_stop_signals(then: Callable[[signal.Signals], None] | None = None) -> Iterator[StopRequest]:
    """For the duration of the block, SIGINT and SIGTERM are noted in the request (and ``then`` called with each)
    instead of raising ``KeyboardInterrupt`` or ending the launcher; in the main thread only, where Python runs
    signal handlers. Both launchers stop their workers this way: torchrun's agent (``stop_signals``) and
    TensorFlow's (``paratrain.tf.launcher``), which polls the request."""
    request = StopRequest()

    def handler(signum: int, _frame: object) -> None:
        sig = signal.Signals(signum)
        first = request.signal is None
        request.note(sig)
        if then is not None and (first or sig == signal.SIGINT):  # a repeated stop signal must not cut a save short
            then(sig)

    if threading.current_thread() is not threading.main_thread():
        yield request
        return
    previous = {sig: signal.signal(sig, handler) for sig in _OURS}
    try:
        yield request
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def stop_signals(args: argparse.Namespace) -> Iterator[StopRequest]:
    """Handle SIGINT/SIGTERM/SIGUSR1 in the launcher for the duration of the block, instead of torchrun's agent
    (``args.signals_to_handle`` loses them); on leaving, a signal that arrived is turned into
    :class:`~paratrain.errors.JobPreempted` when the ranks saved, else :class:`~paratrain.errors.JobInterrupted`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    def unwind(sig: signal.Signals) -> None:  # the agent then stops every worker the way it always does
        if sig != signal.SIGINT:  # the ranks' SIGTERM is a preemption to save on, not a teardown after a failure
            ask_to_stop(note)
        raise SignalException(f"paratrain run got {sig.name}", sigval=signal.SIGTERM)

    given = getattr(args, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    ours = {sig.name for sig in _OURS}
    with preemption_note() as note, caught_stop_signals(unwind) as request:
        os.environ[_SAVED_VAR] = given
        args.signals_to_handle = ",".join(s.strip() for s in given.split(",") if s.strip() not in ours)
        try:
            yield request
        except SignalException:
            if request.signal is None:
                raise
            saved = Note.read(note)
            if saved is not None:
                raise marked(JobPreempted(saved.step, saved.folder, request.signal.name)) from None
            raise request.interrupted() from None
        except ChildFailedError as err:  # the scheduler signalled the ranks only; they saved and left restartable
            done = preempted([failure.exitcode for failure in err.failures.values()], note)
            if done is None:
                raise
            raise marked(done) from None
        finally:
            args.signals_to_handle = given
            os.environ.pop(_SAVED_VAR, None)


@contextlib.contextmanager
def preemption_note() -> Iterator[str]:
    """For the duration of the block, the ranks find in ``PARATRAIN_PREEMPT_NOTE`` the file to write where they
    saved on a stop signal (:class:`~paratrain.preemption.Note`); yields its path."""
    folder = tempfile.mkdtemp(prefix="paratrain-preempt-")
    path = os.path.join(folder, "note.json")
    saved = os.environ.get(NOTE_VAR)
    os.environ[NOTE_VAR] = path
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop(NOTE_VAR, None)
        else:
            os.environ[NOTE_VAR] = saved
        shutil.rmtree(folder, ignore_errors=True)


def preempted(exitcodes: list[int], note: str) -> JobPreempted | None:
    """The job's end when every rank that failed, ``exitcodes``, saved on a stop signal and one wrote where into
    ``note``; None otherwise."""
    if not exitcodes or any(code != PREEMPTED_EXIT_CODE for code in exitcodes):
        return None
    saved = Note.read(note)
    return None if saved is None else JobPreempted(saved.step, saved.folder)


def marked(done: JobPreempted) -> JobPreempted:
    """Touch the file ``PARATRAIN_PREEMPTED_MARK`` names, if any: ``paratrain slurm``'s script requeues the job when
    it exists, whatever exit code srun ends with (``--kill-on-bad-exit`` may kill another node's launcher that was
    about to exit 75 too)."""
    mark = os.environ.get(MARK_VAR)
    if mark:
        with contextlib.suppress(OSError):
            open(mark, "w").close()
    return done


def restore_worker_signals(environ: MutableMapping[str, str] | None = None) -> None:
    """In a worker: ``TORCHELASTIC_SIGNALS_TO_HANDLE`` as plain torchrun would have exported it."""
    env = os.environ if environ is None else environ
    saved = env.pop(_SAVED_VAR, None)
    if saved is not None:
        env[SIGNALS_VAR] = saved
