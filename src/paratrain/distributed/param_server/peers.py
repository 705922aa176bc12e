"""Who a parameter-server message goes to, and over which group.

Every worker and server of a job meet in the job's group; a worker that comes back after its process died cannot
join it again (a gloo group's members are fixed when it starts), so it meets the servers in a group of its own:
the worker as rank 0, server ``i`` as rank ``1 + i``, set up through the launcher's notice store
(:mod:`paratrain.launcher.leaving`) under a prefix naming the worker and its return. Both sides build that group
with ``ProcessGroupGloo`` itself (not ``new_group``, which every member of the job's group would have to call).
A :class:`Peer` hides which group a peer sits in, so the client and the server speak the same calls to both.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Peer:
    """A peer: ``peer`` is its rank in ``group`` (the job's group: its global rank)."""

    group: dist.ProcessGroup
    peer: int

    def isend(self, tensor: torch.Tensor, tag: int) -> dist.Work:
        return self.group.send([tensor], self.peer, tag)

    def recv(self, tensor: torch.Tensor, tag: int, timeout: timedelta | None = None) -> None:
        """Receive into ``tensor``; wait at most ``timeout`` (default: the group's)."""
        work = self.group.recv([tensor], self.peer, tag)
        work.wait() if timeout is None else work.wait(timeout)


def job_peer(rank: int) -> Peer:
    """``rank`` in the job's own group."""
    return Peer(dist.group.WORLD, rank)


def return_group(
    store: dist.Store, worker: int, returns: int, member: int, servers: int, timeout: timedelta
) -> dist.ProcessGroup:
    """The group in which worker ``worker``, back for the ``returns``-th time, meets the ``servers`` servers;
    ``member``: 0 for the worker, ``1 + i`` for server ``i``. Blocks until every member has called it."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    prefix = f"paratrain/ps-return/attempt_{attempt}/rank_{worker}/{returns}"
    return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), member, 1 + servers, timeout)
