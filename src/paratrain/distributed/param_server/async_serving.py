"""Asynchronous serving: one thread per worker, so that a worker may die and come back while the others train on.

A synchronous server receives from any worker in one loop, which suits a step that needs every worker anyway. An
asynchronous server must notice that a worker has gone, and a receive from any source does not: it keeps serving
the live workers and waits for the dead one's next message until the group's timeout (measured on gloo). A
receive from a *named* peer fails as soon as that peer's connection closes, so each worker gets a thread that
receives its requests alone; the requests themselves are answered one at a time, under one lock, by the same code
as the synchronous loop (:meth:`Server.serve_one`), in the order they arrive.

When a worker's connection closes, its thread asks the launcher (:class:`Returns`) whether a new process takes its
place: if so, it meets that process in a group of their own (:func:`~.peers.return_group`) and serves it there,
from the parameters the servers hold now; if not, the worker is gone and the others finish without it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from ...errors import ParatrainError
from .messages import HEADER_WORDS, REQUEST_TAG
from .peers import Peer, return_group
from .server import Departed, Server

IDLE_WORKER = timedelta(days=7)
"""How long a worker may go without a request (evaluating, say) before its server gives up on it: far longer than
the group's timeout, which bounds the other waits, since only a dead connection means a worker is gone."""


@dataclass(frozen=True)
class Returns:
    """How a server learns whether a worker whose process died comes back (the launcher decides and says so)."""

    comes_back: Callable[[int, int], bool]
    """``(worker rank, n)``: True when the launcher started a new process for that rank after its n-th died."""
    store: dist.Store
    """Where a returning worker's group with the servers is set up."""
    timeout: timedelta


@dataclass
class Departure:
    """A worker whose process died while it trained: after how many pushes, and whether it came back."""

    rank: int
    pushes: int
    reason: str
    back: bool = False


@dataclass
class Attendance:
    """Who left and who came back, for the closing table."""

    departures: list[Departure] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [
            f"  rank {d.rank} left after {d.pushes} push(es) ({d.reason}); "
            f"{'a new process took its place' if d.back else 'it did not come back'}"
            for d in self.departures
        ]


def serve_each_worker(server: Server, returns: Returns | None, index: int, servers: int) -> Attendance:
    """Serve every worker in a thread of its own until each is done or gone for good; ``index``: this server's
    place among the ``servers`` servers (a returning worker's group numbers them)."""
    lock = threading.Lock()
    attendance = Attendance()
    errors: list[BaseException] = []

    def run(worker: int) -> None:
        try:
            _serve_worker(server, worker, lock, returns, index, servers, attendance)
        except BaseException as err:  # noqa: BLE001 - raised in the server's main thread below
            errors.append(err)

    threads = [
        threading.Thread(target=run, args=(w,), name=f"ps-worker-{w}", daemon=True) for w in server.layout.workers
    ]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive() and not errors:
            t.join(0.2)
        if errors:  # a failure serving one worker ends the server (and so the job), not that worker's thread alone
            raise errors[0]
    server.finish_sends()
    if not server.finished:  # the servers alone would end with exit code 0: the job must not pass for finished
        raise ParatrainError(
            f"parameter server rank {server.rank}: every worker left and none came back, so "
            "training did not finish (the launcher's report of each above says why)"
        )
    return attendance


def _serve_worker(
    server: Server,
    worker: int,
    lock: threading.Lock,
    returns: Returns | None,
    index: int,
    servers: int,
    attendance: Attendance,
) -> None:
    deaths = 0
    while (gone := _serve_until_gone(server, worker, lock)) is not None:
        deaths += 1
        with lock:
            departure = _depart(server, worker, gone, attendance)
        peer = _await_return(worker, deaths, returns, index, servers)
        if peer is None:
            return
        with lock:
            departure.back = True
            server.peers[worker] = peer
            server.training.add(worker)


def _serve_until_gone(server: Server, worker: int, lock: threading.Lock) -> BaseException | None:
    """Serve ``worker``'s requests until it says it is done (None) or its connection closes (the error)."""
    words = torch.zeros(HEADER_WORDS, dtype=torch.int64)
    while worker not in server.finished:
        words.zero_()
        try:
            server.peers[worker].recv(words, REQUEST_TAG, timeout=IDLE_WORKER)
        except RuntimeError as err:  # between requests
            return err
        try:
            with lock:
                server.serve_one(worker, words)
        except Departed as err:  # inside a request
            return err
    return None


def _depart(server: Server, worker: int, err: BaseException, attendance: Attendance) -> Departure:
    server.training.discard(worker)
    server.rows[worker].clear()  # the row gradients of a push that never came
    reason = "its connection closed" if "closed" in str(err).lower() else str(err).splitlines()[0][:120]
    departure = Departure(worker, server.clock[worker], reason)
    attendance.departures.append(departure)
    print(
        f"paratrain ps: server rank {server.rank}: worker rank {worker} left after {departure.pushes} push(es) "
        f"({reason}); serving the others",
        file=sys.stderr,
        flush=True,
    )
    return departure


def _await_return(worker: int, deaths: int, returns: Returns | None, index: int, servers: int) -> Peer | None:
    """The peer that is the process that takes ``worker``'s place after its ``deaths``-th death, or None: none does."""
    if returns is None or not returns.comes_back(worker, deaths):
        return None
    group = return_group(returns.store, worker, deaths, 1 + index, servers, returns.timeout)
    return Peer(group, 0)
