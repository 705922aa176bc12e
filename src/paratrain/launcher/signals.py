"""Ctrl-C and SIGTERM of ``paratrain run``: every rank stopped, one line, the conventional exit code.

torchrun's agent turns SIGINT/SIGTERM into its ``SignalException``, forwards the same signal to the workers
(SIGINT makes every rank print a ``KeyboardInterrupt`` traceback, and a rank blocked inside a collective only
sees it when the collective returns) and the launcher exits 1 after some 70 lines. Here the launcher handles
SIGINT and SIGTERM itself: it notes when the signal came and how many workers were running, and raises torch's
``SignalException`` with SIGTERM, so the agent stops every worker the way it always does (SIGTERM, SIGKILL
after its grace period). The CLI then prints ``interrupted (SIGINT), 2 ranks stopped in 0.4 s`` and exits
128 + the signal's number (130, 143). A second signal during that shutdown is not waited on: the launcher
leaves at once and its workers die with it (:mod:`paratrain.launcher.parent_death`).

SIGHUP, SIGQUIT and whatever else ``--signals-to-handle`` names stay torch's. The workers see
``TORCHELASTIC_SIGNALS_TO_HANDLE`` as torchrun would have set it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass, field

from ..errors import JobInterrupted
from .processes import children, running

SIGNALS_VAR = "TORCHELASTIC_SIGNALS_TO_HANDLE"
"""Which signals torchrun's agent handles itself (``--signals-to-handle``; torchrun exports it to the workers)."""
_SAVED_VAR = "PARATRAIN_SIGNALS_TO_HANDLE"
_OURS = (signal.SIGINT, signal.SIGTERM)


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
        request.note(signal.Signals(signum))
        if then is not None:
            then(signal.Signals(signum))

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
    """Handle SIGINT/SIGTERM in the launcher for the duration of the block, instead of torchrun's agent
    (``args.signals_to_handle`` loses them); on leaving, a signal that arrived is turned into
    :class:`~paratrain.errors.JobInterrupted`."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def unwind(sig: signal.Signals) -> None:  # the agent then stops every worker the way it always does
        raise SignalException(f"paratrain run got {sig.name}", sigval=signal.SIGTERM)

    given = getattr(args, "signals_to_handle", "SIGTERM,SIGINT,SIGHUP,SIGQUIT")
    with caught_stop_signals(unwind) as request:
        os.environ[_SAVED_VAR] = given
        args.signals_to_handle = ",".join(s.strip() for s in given.split(",") if s.strip() not in ("SIGINT", "SIGTERM"))
        try:
            yield request
        except SignalException:
            if request.signal is None:
                raise
            raise request.interrupted() from None
        finally:
            args.signals_to_handle = given
            os.environ.pop(_SAVED_VAR, None)


def restore_worker_signals(environ: MutableMapping[str, str] | None = None) -> None:
    """In a worker: ``TORCHELASTIC_SIGNALS_TO_HANDLE`` as plain torchrun would have exported it."""
    env = os.environ if environ is None else environ
    saved = env.pop(_SAVED_VAR, None)
    if saved is not None:
        env[SIGNALS_VAR] = saved
