"""Every wait on other ranks speaks: which ranks have not arrived, and what each last called.

A collective only completes when every rank calls it. When one rank calls ``par.mean`` and its peer does not,
torch waits silently for the whole process-group timeout and then says "Timed out waiting … for recv"; when a
peer leaves early (``sys.exit(0)``), the rank still waiting is the one that fails, and is blamed.

Each ``Parallel`` of a multi-process job keeps a :class:`CallWatch`: its collective calls (``par.mean``,
``par.step``, ``par.save`` …) note their name, their count and the user's line that made them; a thread
publishes that to the job's rendezvous store (torch's own ``TCPStore``, the key
``paratrain/calls/<attempt>/<watch>/<rank>``) a few times a minute, at once when a call starts to wait, and when
the process exits. From it:

* a call that has waited longer than ``report_after_s`` (default a fifth of the timeout, at most 60 s) prints,
  once per such period and from the lowest waiting rank only, one line naming the ranks that have not arrived
  and the last paratrain call of each;
* a call that fails because a peer left or because the timeout passed is re-raised as a one-line
  :class:`~paratrain.errors.CollectiveError` naming the rank that left first, or the calls that did not match;
* a call still waiting a report period past its timeout (a peer caught a paratrain error and carried on, so the
  collective that would time out was never made) ends the job (:meth:`CallWatch._end_job`) naming the ranks not
  in it, instead of waiting on;
* under ``paratrain run``, the first wait report asks every rank for its flight-recorder trace
  (:mod:`paratrain.hang_trace`), so the launcher's report can name the collective torch is stuck in;
* a rare call, and work outside any call that every rank must do together (:mod:`paratrain.rank_alone`), first
  meets the others (:meth:`CallWatch.meet`): a rank that does it alone fails within a second or two, naming the
  peer that went on to another call.

Nothing is sent on the collective's own channel; a watched call costs about 4.5 µs (benchmarks/RESULTS.md §8)
and the store is written only by the thread, at most every 5 s per rank while nothing waits, and by meetings.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from typing import Any, TypeVar

from .errors import CollectiveError
from .hang_trace import TraceDumps

F = TypeVar("F", bound=Callable[..., Any])
_PACKAGE = os.path.dirname(os.path.abspath(__file__))
_TORCH = os.path.dirname(importlib.util.find_spec("torch").origin or "")  # located, not imported
_STDLIB_CONTEXT = "contextlib.py"
_PEER_LOST = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "has been closed",
    "NCCL communicator was aborted",
)
_TIMED_OUT = ("Timed out waiting", "collective operation timeout", "Socket Timeout", "wait timeout")
"""How gloo, NCCL's watchdog and the store say a collective's timeout passed (not any error with "timeout")."""
MAX_REPORT_AFTER_S = 60.0


@dataclass(slots=True)
class Call:
    """One rank's latest paratrain call, as published (never changed once made; slots, not frozen: a step makes
    two, and a frozen dataclass costs twice as much to build)."""

    name: str = ""
    """``par.mean``, ``par.step`` …"""
    nth: int = 0
    """How many calls of that name this rank has made (1 for the first)."""
    where: str = ""
    """``train.py:12``: the user's line that made it."""
    since: float = 0.0
    """Wall-clock time it started (or ended, once ``active`` is False)."""
    active: bool = False
    """Inside the call now (possibly waiting on the others)."""
    exited: bool = False
    """The process has ended (or closed its ``Parallel``)."""

    def describe(self, now: float) -> str:
        if not self.name:
            return "has made no paratrain call"
        call = f"{self.name} #{self.nth} ({self.where})"
        now = max(now, self.since)  # clocks read an instant apart: never "-0 s ago"
        if self.exited:
            return f"exited {now - self.since:.0f} s ago after {call}"
        if self.active:
            return f"is in {call} for {now - self.since:.0f} s"
        return f"last called {call}, {now - self.since:.0f} s ago, and is not in a paratrain call"

    def same_call(self, other: Call) -> bool:
        return self.active and other.active and (self.name, self.nth) == (other.name, other.nth)


def default_report_after(timeout_s: float) -> float:
    return min(MAX_REPORT_AFTER_S, timeout_s / 5)


class CallWatch:
    """The collective calls of one rank (see the module docstring). ``enabled=False``: calls are only counted."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        *,
        timeout_s: float,
        report_after_s: float | None = None,
        enabled: bool = True,
        environ: dict[str, str] | None = None,
    ) -> None:
        env = os.environ if environ is None else environ
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.report_after_s = report_after_s if report_after_s is not None else default_report_after(timeout_s)
        self._current = Call()
        self._counts: dict[str, int] = {}
        self._address = (env.get("MASTER_ADDR"), env.get("MASTER_PORT"))
        self._prefix = f"paratrain/calls/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        self.enabled = enabled and world_size > 1 and all(self._address)
        self.every_rank = True
        """Every rank makes the job's paratrain calls (not so where some ranks serve: parameter servers)."""
        self._store: Any = None
        self._meet_store: Any = None
        self._published: Call | None = None
        self._published_at = 0.0
        self._report_key: tuple[str, int] = ("", 0)
        self._reports = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._dumps = TraceDumps.from_environ(env) if self.enabled else None
        if self.enabled:
            # A process may hold several Parallel objects in turn (one per case of a test job): each watch publishes
            # under its own number, so a peer's state from an earlier object never reads as where it is now.
            self._prefix += f"/{self._meeting_store().add(f'{self._prefix}/watches/{rank}', 1)}"
            self._thread = threading.Thread(target=self._run, name="paratrain-call-watch", daemon=True)
            self._thread.start()
            atexit.register(self._exit)

    # ----------------------------------------------------------------- the training thread
    @contextmanager
    def call(self, name: str, meet: str | None = None, uneven: str | None = None) -> Iterator[None]:
        """Mark a collective paratrain call; a peer lost or a timeout inside it becomes a ``CollectiveError``.
        ``meet``: first wait until every rank has made this call, failing at once when a peer went on without it
        (:meth:`meet`); the text says why every rank must make it, ``uneven`` what to do when every rank made it
        before but not equally often."""
        outer = self._current if self._current.active else None  # a save inside a step, say
        if outer is not None:
            yield
            return
        nth = self._counts[name] = self._counts.get(name, 0) + 1
        self._current = Call(name, nth, _user_line(), time.time(), active=True)
        try:
            if meet is not None and self.enabled and self.every_rank:
                self._meet(self._current, meet, uneven)
            yield
        except Exception as e:
            better = self._explain(e) if self.enabled else None
            if better is None:
                raise
            raise better from None
        finally:
            done = self._current
            self._current = Call(done.name, done.nth, done.where, time.time())  # not dataclasses.replace: 3x slower

    @property
    def inside(self) -> bool:
        """Inside a paratrain call now (``par.step``, ``par.save`` …)."""
        return self._current.active

    def within(self, name: str) -> bool:
        """Inside the paratrain call ``name`` now."""
        return self._current.active and self._current.name == name

    def meet(self, name: str, why: str, uneven: str | None = None) -> None:
        """Before work every rank must do together that no paratrain call holds — a model's forward outside
        ``par.step`` under a strategy whose forward communicates, a ``state_dict()`` of shards — wait until every
        rank is there, or fail at once in one line naming the rank that went on without it; ``why`` says why every
        rank must do it (and what to do instead). ``uneven``: what the line says instead when every rank did it
        before, so the ranks do it unequally often (an evaluation split unevenly over them)."""
        if self.enabled and not self._current.active:
            with self.call(name, meet=why, uneven=uneven):
                pass

    def _meet(self, call: Call, why: str, uneven: str | None = None) -> None:
        """Count this rank in at ``call`` (a key of the job's store per call) and wait for the others; while
        waiting, a peer that has made a call this rank has not made is one that went on without it."""
        store = self._meeting_store()
        store.set(f"{self._prefix}/{self.rank}", json.dumps(asdict(call)))  # now: a waiting peer reads it
        key = f"{self._prefix}/meet/{call.name}/{call.nth}"
        if store.add(key, 1) >= self.world_size:
            store.set(f"{key}/all", "1")
            return
        pause, deadline = 0.0002, time.monotonic() + self.timeout_s
        while not store.check([f"{key}/all"]):
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
            if pause == 0.05:  # a few ms gone: look where the others are
                calls = self._read_all(store)
                # A peer publishes a later call only after the meeting is complete: read first, then check, or a
                # meeting completed between the two looks like a peer that went on without it.
                if store.check([f"{key}/all"]):
                    return
                line = self._went_on(call, why, calls, uneven)
                if line is not None or time.monotonic() > deadline:
                    raise CollectiveError(
                        line
                        or f"rank {self.rank} waited {self.timeout_s:g} s in {call.name} "
                        f"({call.where}) for the other ranks; {why}"
                    )

    def _went_on(self, call: Call, why: str, calls: dict[int, Call], uneven: str | None = None) -> str | None:
        """The line naming a peer that made a call this rank has not (so will never come to ``call``), or left.
        Every rank met at ``call``'s earlier counts, so past the first (and with ``uneven``) the peer made it
        ``call.nth - 1`` times."""
        now = time.time()
        for r, c in sorted(calls.items()):
            if r == self.rank or (c.name, c.nth) == (call.name, call.nth):
                continue
            if c.exited or (c.name and c.nth > self._counts.get(c.name, 0)):
                went = c.describe(now) if c.exited else f"went on to {c.name} #{c.nth} ({c.where})"
                if uneven is not None and call.nth > 1:
                    return (
                        f"rank {self.rank} ran {call.name} more times than rank {r}: rank {r} ran it "
                        f"{call.nth - 1} times and {went}, rank {self.rank} is in its #{call.nth} ({call.where}); "
                        f"{uneven}"
                    )
                return f"rank {self.rank} is alone in {call.name} ({call.where}): rank {r} {went}; {why}"
        return None

    def _meeting_store(self) -> Any:
        """A connection of the training thread's own (the watch's thread has the other)."""
        if self._meet_store is None:
            from torch.distributed import TCPStore

            host, port = self._address
            self._meet_store = TCPStore(
                host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30)
            )
        return self._meet_store

    def close(self) -> None:
        """Publish that this rank is done and stop the thread."""
        if not self.enabled:
            return
        self._stop.set()
        atexit.unregister(self._exit)
        self._exit()

    # ----------------------------------------------------------------- the thread
    def _run(self) -> None:
        poll = max(0.05, min(1.0, self.report_after_s / 4))
        while not self._stop.wait(poll):
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - diagnostics must never take the job down
                self._store = None

    def _tick(self) -> None:
        now, current = time.time(), self._current
        started_waiting = current.active and now - current.since > poll_min(self.report_after_s)
        if current != self._published and (started_waiting or now - self._published_at > 5.0):
            self._publish(current)
        if not current.active:
            return
        if (current.name, current.nth) != self._report_key:
            self._report_key, self._reports = (current.name, current.nth), 0
        if now - current.since < self.report_after_s * (self._reports + 1):
            return
        self._reports += 1
        if self._reports == 1 and self._dumps is not None:
            self._dumps.request()  # while it waits: once torch's timeout passes, gloo marks it done
        calls = self._read_all()
        missing = {r: c for r, c in calls.items() if r != self.rank and not current.same_call(c)}
        if missing and now - current.since >= self.timeout_s + self.report_after_s:
            self._end_job(self._past_deadline_line(current, missing, now))
            return
        waiting = [r for r, c in calls.items() if c.active and now - c.since >= self.report_after_s]
        if waiting and min(waiting) != self.rank:
            return  # the lowest waiting rank speaks for all
        print(f"paratrain: {self._waiting_line(current, calls, now)}", file=sys.stderr, flush=True)

    def _past_deadline_line(self, mine: Call, missing: dict[int, Call], now: float) -> str:
        """Every rank in the same call for that long may be computing (a long step): only a wait for ranks that
        are elsewhere ends the job."""
        head = (
            f"rank {self.rank} waited {now - mine.since:.0f} s in {mine.name} #{mine.nth} ({mine.where}), past its "
            f"{self.timeout_s:g} s timeout"
        )
        return (
            f"{head}, for rank{'s' if len(missing) > 1 else ''} {_ranks(missing)}: "
            + "; ".join(f"rank {r} {c.describe(now)}" for r, c in sorted(missing.items())[:8])
            + "; ended the job (a rank that catches a paratrain error must stop, not carry on alone)"
        )

    def _end_job(self, line: str) -> None:
        """End this process as a failed rank whose error is ``line`` (the watch's thread cannot raise in the
        training thread, blocked in torch): recorded for the launcher's report as an uncaught error would be."""
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        print(f"paratrain: {line}", file=sys.stderr, flush=True)
        try:
            raise CollectiveError(line)  # raised, so that the record holds its traceback, as for an uncaught one
        except CollectiveError as err:
            get_error_handler().record_exception(err)
        finally:
            if self._dumps is not None:
                self._dumps.request()
            os._exit(1)

    def _waiting_line(self, mine: Call, calls: dict[int, Call], now: float) -> str:
        missing = {r: c for r, c in calls.items() if r != self.rank and not mine.same_call(c)}
        head = f"rank {self.rank} has waited {now - mine.since:.0f} s in {mine.name} #{mine.nth} ({mine.where})"
        left = max(0.0, self.timeout_s - (now - mine.since))
        if not missing:
            return (
                f"{head}; every rank is in it (a collective inside it does not complete; "
                f"TORCH_DISTRIBUTED_DEBUG=DETAIL names mismatched collectives); "
                + (f"it fails in {left:.0f} s" if left > 0 else "its timeout has passed")
            )
        return (
            f"{head} for rank{'s' if len(missing) > 1 else ''} {_ranks(missing)}: "
            + "; ".join(f"rank {r} {c.describe(now)}" for r, c in sorted(missing.items())[:8])
            + (f"; it fails in {left:.0f} s" if left > 0 else "; its timeout has passed")
        )

    def _publish(self, call: Call) -> None:
        store = self._connect()
        store.set(f"{self._prefix}/{self.rank}", json.dumps(asdict(call)))
        self._published, self._published_at = call, time.time()

    def _read_all(self, store: Any = None) -> dict[int, Call]:
        store = store if store is not None else self._connect()
        keys = [f"{self._prefix}/{r}" for r in range(self.world_size)]
        present = [k for k in keys if store.check([k])]
        values = store.multi_get(present) if present else []
        calls = {int(k.rsplit("/", 1)[1]): Call(**json.loads(bytes(v).decode())) for k, v in zip(present, values)}
        calls[self.rank] = self._current
        return calls

    def _connect(self) -> Any:
        if self._store is None:
            from torch.distributed import TCPStore

            host, port = self._address
            self._store = TCPStore(
                host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=10)
            )
        return self._store

    def _exit(self) -> None:
        try:
            self._publish(replace(self._current, active=False, exited=True, since=time.time()))
        except Exception:  # noqa: BLE001 - the store may be gone already
            pass

    # ----------------------------------------------------------------- failures
    def _explain(self, err: Exception) -> CollectiveError | None:
        text = str(err)
        lost, timed_out = any(m in text for m in _PEER_LOST), any(m in text for m in _TIMED_OUT)
        if not (lost or timed_out):
            return None
        mine = self._current
        try:
            calls = self._read_all()
        except Exception:  # noqa: BLE001 - no store: keep torch's own error
            return None
        now = time.time()
        here = f"{mine.name} #{mine.nth} ({mine.where})"
        gone = sorted((c.since, r) for r, c in calls.items() if c.exited and r != self.rank)
        if gone:
            r = gone[0][1]
            return CollectiveError(
                f"rank {r} left the job first ({calls[r].describe(now)}) while rank {self.rank} "
                f"was in {here}; every rank must make the same paratrain calls until the end"
            )
        other = {r: c for r, c in calls.items() if r != self.rank and not mine.same_call(c)}
        if timed_out and other:
            return CollectiveError(
                f"rank {self.rank} gave up on {here} after {self.timeout_s:g} s: the ranks made "
                "different paratrain calls: "
                + "; ".join(f"rank {r} {c.describe(now)}" for r, c in sorted(other.items())[:8])
                + "; every rank must make the same paratrain calls in the same order"
            )
        return None


def collective(name: str, meet: str | None = None) -> Callable[[F], F]:
    """Mark a ``Parallel`` method (or generator method, under ``@contextmanager``) as the collective call
    ``name`` of ``self._calls``; ``meet``: a rare call whose ranks first meet (:meth:`CallWatch.meet`; the text
    says why every rank must make it)."""

    def wrap(fn: F) -> F:
        if inspect.isgeneratorfunction(fn):

            @functools.wraps(fn)
            def steps(self: Any, *args: Any, **kwargs: Any) -> Any:
                with self._calls.call(name):
                    return (yield from fn(self, *args, **kwargs))

            return steps  # type: ignore[return-value]

        @functools.wraps(fn)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            with self._calls.call(name, meet=meet):
                return fn(self, *args, **kwargs)

        return method  # type: ignore[return-value]

    return wrap


def collective_stalled(err: BaseException) -> bool:
    """``err`` says a collective timed out or lost its peer (torch's words, or a paratrain error made of them)."""
    return isinstance(err, CollectiveError) or mentions_stall(str(err))


def mentions_stall(text: str) -> bool:
    """``text`` (an error, a traceback) says a collective timed out, lost its peer, or did not match."""
    return CollectiveError.__name__ in text or any(m in text for m in (*_PEER_LOST, *_TIMED_OUT))


def poll_min(report_after_s: float) -> float:
    """How long a call runs before its state is published at once (shorter calls wait for the next round)."""
    return min(1.0, report_after_s / 4)


def _ranks(calls: dict[int, Call]) -> str:
    ranks = sorted(calls)
    return ", ".join(map(str, ranks[:8])) + (f" … ({len(ranks)} ranks)" if len(ranks) > 8 else "")


def _user_line() -> str:
    """``file.py:line`` of the first frame outside paratrain, torch and contextlib (a forward's hook runs inside
    torch's module call)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith(_PACKAGE) and not name.startswith(_TORCH) and not name.endswith(_STDLIB_CONTEXT):
            return f"{_basename(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


@functools.lru_cache(maxsize=256)
def _basename(path: str) -> str:
    return os.path.basename(path)
