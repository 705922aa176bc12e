"""What a multi-node ``paratrain run`` adds to torchrun: a bounded rendezvous, the right network interface,
and errors that say which address did not answer.

torchrun itself leaves three traps for jobs across hosts: gloo binds to the address the *hostname* resolves
to (often loopback), the c10d rendezvous host decides whether to run the store by comparing hostnames (and
misses an address given as an IP), and a node that never shows up is reported as a C++ stack trace after ten
minutes. Here each node looks up the route to the rendezvous host once and exports what that implies.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable

from ..errors import LaunchError
from . import network
from .ports import port_in_use

DEFAULT_RDZV_TIMEOUT_S = 600
"""torchrun's own default wait for the other nodes, for the static and the c10d rendezvous alike."""
_C10D_READ_TIMEOUT_S = 60
_C10D_DEFAULT_PORT = 29400


def max_nodes(nnodes: str) -> int:
    """The MAX of ``--nnodes N`` or ``MIN:MAX``."""
    return nnodes_range(nnodes)[1]


def nnodes_range(nnodes: str) -> tuple[int, int]:
    """``(MIN, MAX)`` of ``--nnodes N`` or ``MIN:MAX``; anything else is a one-line error."""
    parts = str(nnodes).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[-1])) if len(parts) in (1, 2) else (0, 0)
    except ValueError:
        lo = hi = 0
    if not 0 < lo <= hi:
        raise LaunchError(f"--nnodes must be N or MIN:MAX with 0 < MIN <= MAX, got {nnodes!r}")
    return lo, hi


def rendezvous_endpoint(args: argparse.Namespace) -> tuple[str, int]:
    """Host and port every node meets at: ``--master-addr/--master-port`` (static) or ``--rdzv-endpoint``."""
    if args.rdzv_backend == "static" and not args.rdzv_endpoint:
        return args.master_addr, args.master_port if args.master_port is not None else 29500
    host, _, port = args.rdzv_endpoint.rpartition(":")
    if not host or not port.isdigit():
        return args.rdzv_endpoint or "", _C10D_DEFAULT_PORT
    return host.strip("[]"), int(port)


def rendezvous_timeout(args: argparse.Namespace) -> int:
    """Seconds a node waits for the others before the rendezvous fails."""
    key = "timeout" if args.rdzv_backend == "static" else "join_timeout"
    return int(_conf(args).get(key, DEFAULT_RDZV_TIMEOUT_S))


def set_rendezvous_timeout(args: argparse.Namespace, seconds: int) -> None:
    """Apply ``--rdzv-timeout``: torchrun spells it ``timeout`` (static) or ``join_timeout`` (c10d), and a c10d
    node that cannot reach the store gives up after ``read_timeout``. Keys in ``--rdzv-conf`` win."""
    conf = _conf(args)
    if args.rdzv_backend == "static":
        conf.setdefault("timeout", str(seconds))
    else:
        conf.setdefault("join_timeout", str(seconds))
        conf.setdefault("read_timeout", str(min(seconds, _C10D_READ_TIMEOUT_S)))
    args.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())


def prepare_network(args: argparse.Namespace, note: Callable[[str], None]) -> None:
    """Pick the interface and address the other nodes can reach, from the route to the rendezvous host.

    Sets ``GLOO_SOCKET_IFNAME`` (unless set) and, for c10d, ``--local-addr`` (unless given), which is the
    address rank 0's node publishes as ``MASTER_ADDR``; tells a c10d node whose IP is the endpoint to host the
    store. A rendezvous host that does not resolve is an error now rather than a timeout later, except in a
    Kubernetes pod: there the master's name resolves only once its pod runs, so a node waits for it as long as it
    would wait for the rendezvous.
    """
    host, port = rendezvous_endpoint(args)
    address, waited = network.address_of(host), ""
    if address is None and network.in_pod(os.environ):
        wait = rendezvous_timeout(args)
        note(f"waiting up to {wait} s for {host} to resolve (Kubernetes names a pod once it runs)")
        address, waited = network.wait_for_address(host, wait), f" within {wait} s"
    if address is None:
        raise LaunchError(
            f"the rendezvous host {host!r} does not resolve on this node{waited}; give its IP "
            "address or a name this node can resolve (DNS, /etc/hosts)"
        )
    source = network.route_source(address, port)
    if source is None:
        return  # no route now: the rendezvous will time out with a message naming the address
    if network.is_loopback(source):
        if not network.is_loopback(host) and host != "localhost":
            note(
                f"the rendezvous host {host} resolves to {address} (loopback) on this node, which other nodes "
                "cannot reach; give the master's network address, or set GLOO_SOCKET_IFNAME and --local-addr"
            )
        return
    iface = network.interface_of(source)
    chosen = []
    if iface and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        chosen.append(f"GLOO_SOCKET_IFNAME={iface}")
    if args.rdzv_backend != "static" and not args.local_addr:
        args.local_addr = source
        chosen.append(f"--local-addr {source}")
        _host_the_store_if_mine(args, address, port)
    if chosen:
        note(
            f"this node reaches {host}:{port} from {source}"
            + (f" on {iface}" if iface else "")
            + f" ({', '.join(chosen)})"
        )


def _host_the_store_if_mine(args: argparse.Namespace, address: str, port: int) -> None:
    """torchrun decides who hosts the c10d store by hostname; an endpoint given as this node's IP is missed."""
    conf = _conf(args)
    if "is_host" in conf or not network.is_own_address(address) or network.is_loopback(address):
        return
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname

    if _matches_machine_hostname(rendezvous_endpoint(args)[0]) or port_in_use(address, port):
        return  # torchrun already knows, or another agent on this host runs the store
    conf["is_host"] = "1"
    args.rdzv_conf = ",".join(f"{k}={v}" for k, v in conf.items())


def _conf(args: argparse.Namespace) -> dict[str, str]:
    conf: dict[str, str] = {}
    for item in filter(None, (s.strip() for s in (args.rdzv_conf or "").split(","))):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    return conf


def rendezvous_errors() -> tuple[type[BaseException], ...]:
    """What torchrun raises when the nodes do not meet (not a worker failure)."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousError

    return DistError, RendezvousError


_ERRNO = re.compile(r"errno: \d+ - ([^)]+)\)")
_JOINED = re.compile(r"(\d+)/(\d+) clients joined")
_LOST = ("Connection reset by peer", "Broken pipe", "Connection closed by peer")


def rendezvous_error(args: argparse.Namespace, err: BaseException) -> LaunchError:
    """One line for a rendezvous that failed: which address, how long it waited, what to check."""
    host, port = rendezvous_endpoint(args)
    where = f"{host}:{port}"
    waited = f"{rendezvous_timeout(args)} s"
    text = f"{err} {err.__cause__ or ''}"
    same = "start every node with the same --nnodes and " + (
        "--master-addr/--master-port" if args.rdzv_backend == "static" else "--rdzv-endpoint/--rdzv-id"
    )
    joined = _JOINED.search(text)
    if joined:
        present, expected = int(joined[1]), int(joined[2])
        return LaunchError(
            f"only {present} of {expected} nodes joined the rendezvous at {where} within {waited}; "
            f"{same}, or raise --rdzv-timeout"
        )
    if any(marker in text for marker in _LOST):
        return LaunchError(
            f"lost the connection to the rendezvous at {where} before it completed: the node "
            f"hosting it stopped (its own error is the cause); {same}"
        )
    if type(err).__name__ == "RendezvousTimeoutError":
        return LaunchError(
            f"the rendezvous at {where} did not complete within {waited}: fewer than "
            f"{nnodes_range(args.nnodes)[0]} nodes joined; {same}, or raise --rdzv-timeout"
        )
    if type(err).__name__ in ("DistNetworkError", "RendezvousConnectionError"):
        reason = _ERRNO.search(text)
        why = f" ({reason[1]})" if reason else " (no answer)" if "timed out" in text else ""
        return LaunchError(
            f"could not reach the rendezvous at {where} within {waited}{why}; check that node 0 "
            f"is running and that {host} is its address as seen from this node, with port {port} "
            "open; --rdzv-timeout sets the wait"
        )
    first = text.strip().splitlines()[0][:160] if text.strip() else type(err).__name__
    return LaunchError(
        f"the rendezvous at {where} did not complete within {waited} ({first}); {same}, or raise --rdzv-timeout"
    )
