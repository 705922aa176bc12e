"""The addresses of a TensorFlow job's workers, from the same flags as a torch job.

One node: ``-n`` free ports on loopback. Several nodes (``--nnodes/--node-rank/--master-addr/--master-port``, or
a SLURM step, which fills those flags in): each node's launcher picks free ports on the address that reaches the
master, and the launchers swap them through a ``torch.distributed.TCPStore`` that node 0 hosts at
``--master-addr:--master-port``, the rendezvous torch jobs use. The workers themselves never see torch: they get
the finished ``TF_CONFIG``.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta

from ..errors import LaunchError
from ..launcher.network import LOOPBACK, address_of, is_loopback, route_source

DEFAULT_MASTER_PORT = 29500


@dataclass(frozen=True)
class NodeSlots:
    """This node's workers: every worker's address in the job, and the index of this node's first."""

    addresses: list[str]
    first: int
    local: int
    store: object = None
    """Node 0's store, kept open until this node's workers end (the other nodes may still be reading it)."""

    @property
    def indices(self) -> range:
        return range(self.first, self.first + self.local)


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on every interface a moment ago (TensorFlow's server binds all of them)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("", 0))
            sockets.append(s)
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def single_node(nproc: int) -> NodeSlots:
    return NodeSlots([f"{LOOPBACK}:{port}" for port in free_ports(nproc)], first=0, local=nproc)


def multi_node(
    *,
    nproc: int,
    nnodes: int,
    node_rank: int,
    master_addr: str,
    master_port: int | None,
    timeout_s: float,
    attempt: int = 0,
) -> NodeSlots:
    """Swap every node's worker addresses through node 0's store; wait at most ``timeout_s`` for the others."""
    from torch.distributed import TCPStore

    master = address_of(master_addr)
    if master is None:
        raise LaunchError(f"--master-addr {master_addr!r} does not resolve; give node 0's address or hostname")
    host = LOOPBACK if is_loopback(master) else (route_source(master) or master)
    port = master_port or DEFAULT_MASTER_PORT
    own = ",".join(f"{host}:{p}" for p in free_ports(nproc))
    try:
        store = TCPStore(master, port, nnodes, node_rank == 0, timedelta(seconds=timeout_s), wait_for_workers=False)
        key = f"paratrain-tf/{attempt}/node"
        store.set(f"{key}/{node_rank}", own)
        store.wait([f"{key}/{r}" for r in range(nnodes)], timedelta(seconds=timeout_s))
        nodes = [store.get(f"{key}/{r}").decode().split(",") for r in range(nnodes)]
    except (RuntimeError, OSError) as e:
        if "Address already in use" in str(e) or "EADDRINUSE" in str(e):
            raise LaunchError(f"--master-port {port} is already in use on {master}; pick another port") from None
        raise LaunchError(
            f"the {nnodes} nodes did not all meet at {master}:{port} within {timeout_s:g} s (node 0 "
            "hosts the meeting point: start it, check --master-addr/--master-port and the firewall, "
            "or raise --rdzv-timeout)"
        ) from None
    first = sum(len(n) for n in nodes[:node_rank])
    return NodeSlots([a for n in nodes for a in n], first=first, local=nproc, store=store)
