"""A multi-node rendezvous that waits says so: every ~15 s, who has joined and how long is left.

torchrun prints nothing while a node waits for the others (up to ``--rdzv-timeout``, 600 s by default). While
it waits, a thread of the launcher joins the rendezvous store (as a client that does not count as a node),
registers this node under a counter of its own, and reports what it sees::

    paratrain run: waiting for the other nodes at 10.0.0.1:29500: 1 of 2 joined (node 0 on hostA); 585 s left

It stops as soon as this node's workers start (the rendezvous is complete) or the launcher returns. Single-node
jobs meet on their own host and say nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from .multinode import max_nodes, nnodes_range, rendezvous_endpoint, rendezvous_timeout
from .processes import children

INTERVAL_VAR = "PARATRAIN_RDZV_REPORT_S"
DEFAULT_INTERVAL_S = 15.0


@contextlib.contextmanager
def rendezvous_progress(args: argparse.Namespace, note: Callable[[str], None]) -> Iterator[None]:
    """Report the rendezvous of a multi-node job while the block runs."""
    if max_nodes(args.nnodes) == 1:
        yield
        return
    done = threading.Event()
    thread = threading.Thread(target=_report, args=(args, note, done), name="paratrain-rendezvous", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()


def _report(args: argparse.Namespace, note: Callable[[str], None], done: threading.Event) -> None:
    from torch.distributed import TCPStore

    interval = float(os.environ.get(INTERVAL_VAR, DEFAULT_INTERVAL_S))
    host, port = rendezvous_endpoint(args)
    lo, hi = nnodes_range(args.nnodes)
    expected = str(lo) if lo == hi else f"{lo}-{hi}"
    me = (f"node {args.node_rank} on " if args.rdzv_backend == "static" else "") + socket.gethostname()
    prefix = f"paratrain/rendezvous/{args.rdzv_id}"
    deadline = time.monotonic() + rendezvous_timeout(args)
    store = None
    while not done.wait(interval):
        if children():  # the workers run: the rendezvous is complete
            return
        left = max(0.0, deadline - time.monotonic())
        try:
            if store is None:
                store = TCPStore(
                    host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=min(5.0, interval))
                )
                store.set(f"{prefix}/{store.add(f'{prefix}/count', 1)}", me)
            count = store.add(f"{prefix}/count", 0)
            names = [store.get(f"{prefix}/{i}").decode() for i in range(1, count + 1)]
        except Exception:  # noqa: BLE001 - the rendezvous host does not answer yet
            note(
                f"waiting for the rendezvous at {host}:{port} to answer (the node that hosts it has not started, "
                f"or cannot be reached); {left:.0f} s left"
            )
            store = None
            continue
        if done.is_set() or children():
            return
        note(
            f"waiting for the other nodes at {host}:{port}: {count} of {expected} joined ({', '.join(names)}); "
            f"{left:.0f} s left"
        )
