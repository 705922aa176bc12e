"""Ranks that may leave a running job: the contract between ``paratrain run`` and the ranks it starts.

By default the death of any rank stops the job (torchrun's rule, and the right one for collectives, where every rank
waits for every other). An asynchronous worker of a parameter server is different: the servers can go on without it.
Such a rank says so with :func:`allow_leaving`; if it then dies, ``paratrain run`` reports it, keeps the job running
and, with restarts left (``--max-restarts``), starts a replacement for that rank alone
(:mod:`paratrain.launcher.agent`).

Whoever waits on that rank (a server) learns what happened from the *notice store*: when the n-th process of rank r
dies (n = 1 for the original process, 2 for its first replacement, ...), the launcher sets ``notice_key(r, n)`` to
``b"back"`` when it starts a replacement (which then sees ``rejoin_count() == n``) or ``b"gone"`` when it does not.
The notice store is the launcher agents' rendezvous store: every rank of the job can reach it and it outlives any
worker (a store that rank 0 hosts would die with rank 0).

Permission is per process: a replacement runs the same script, which asks again. The markers are files in a folder
of this node's launcher (``PARATRAIN_LEAVE_DIR``), since each node's launcher only supervises its own ranks.
This module imports nothing of paratrain beyond its errors, so that any layer can take the contract from here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING

from ..errors import ConfigError

if TYPE_CHECKING:
    import torch.distributed as dist

LEAVE_DIR_VAR = "PARATRAIN_LEAVE_DIR"
"""Set by the launcher for every worker: a folder on this node where ranks leave their markers."""
NOTICE_STORE_VAR = "PARATRAIN_NOTICE_STORE"
"""``host:port`` of the store where the launcher says whether a rank that left comes back."""
REJOIN_VAR = "PARATRAIN_REJOIN"
"""Set only in a replacement process: n, for the n-th replacement of this rank in this launch attempt."""
_ATTEMPT_VAR = "TORCHELASTIC_RESTART_COUNT"
BACK = b"back"
GONE = b"gone"


def allow_leaving(rank: int) -> bool:
    """Tell the launcher that the job goes on if this process (of global ``rank``) dies.

    Returns False, and does nothing, outside ``paratrain run`` (no ``PARATRAIN_LEAVE_DIR``). Call it once the
    process is ready to be done without: a death before the call stops the job as any failure does.
    """
    folder = os.environ.get(LEAVE_DIR_VAR)
    if not folder:
        return False
    own = os.environ.get("RANK")
    if own is not None and own.isdigit() and int(own) != rank:
        raise ConfigError(f"allow_leaving({rank}) called by the process of rank {own}; pass this process's own RANK")
    path = marker_path(folder, rank, rejoin_count() + 1)
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        f.write(str(os.getpid()))
    os.replace(partial, path)  # whole or absent: the launcher may look at any moment
    return True


def rejoin_count(environ: Mapping[str, str] | None = None) -> int:
    """0 in an original process, n in the n-th replacement of its rank."""
    value = (os.environ if environ is None else environ).get(REJOIN_VAR, "")
    return int(value) if value.isdigit() else 0


def notice_store(timeout: timedelta) -> dist.Store | None:
    """A client of the job's notice store (None outside ``paratrain run`` or under a rendezvous without one)."""
    address = os.environ.get(NOTICE_STORE_VAR)
    if not address:
        return None
    from torch.distributed import TCPStore

    host, _, port = address.rpartition(":")
    return TCPStore(host.strip("[]"), int(port), is_master=False, timeout=timeout, wait_for_workers=False)


def notice_key(rank: int, n: int, attempt: int | None = None) -> str:
    """Where the launcher says what became of the n-th process of ``rank`` (n = 1: the original process).

    ``attempt`` defaults to this process's launch attempt (``TORCHELASTIC_RESTART_COUNT``).
    """
    if attempt is None:
        value = os.environ.get(_ATTEMPT_VAR, "")
        attempt = int(value) if value.isdigit() else 0
    return f"paratrain/leave/attempt_{attempt}/rank_{rank}/{n}"


def marker_path(folder: str, rank: int, n: int) -> str:
    """The marker of the n-th process of ``rank`` (a folder per launcher and attempt: no attempt in the name)."""
    return os.path.join(folder, f"rank_{rank}.{n}")
