"""Which of this host's addresses and interfaces the other nodes of a job can reach.

A multi-node job breaks in a way that is hard to read when a node advertises an address the others cannot
reach. gloo binds to whatever this host's *hostname* resolves to, and on many machines that is a loopback
address (Debian's ``127.0.1.1``, a container's ``/etc/hosts``), so every node tells the others to connect to
``127.x`` and the job fails with "Connection refused" or waits for its timeout. The route the kernel takes to
the master is the reliable answer: the local address on that route is one the master can reach back.
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
import time
from collections.abc import Mapping

_SIOCGIFADDR = 0x8915
LOOPBACK = "127.0.0.1"
"""The address a job on one host uses for its master and rendezvous."""
_RESOLVE_POLL_S = 0.5


def address_of(host: str) -> str | None:
    """An address of ``host`` (IPv4 first), or None when it does not resolve."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    infos.sort(key=lambda info: info[0] != socket.AF_INET)
    return str(infos[0][4][0]) if infos else None


def in_pod(environ: Mapping[str, str]) -> bool:
    """True inside a Kubernetes pod (the kubelet sets ``KUBERNETES_SERVICE_HOST`` in every container), where the
    name of another pod resolves only once that pod runs."""
    return "KUBERNETES_SERVICE_HOST" in environ


def wait_for_address(host: str, timeout_s: float) -> str | None:
    """``address_of(host)``, asked again every half second until it resolves or ``timeout_s`` has passed."""
    deadline = time.monotonic() + timeout_s
    while (address := address_of(host)) is None and time.monotonic() < deadline:
        time.sleep(min(_RESOLVE_POLL_S, max(0.0, deadline - time.monotonic())))
    return address


def route_source(address: str, port: int = 9) -> str | None:
    """The local address the kernel would use to reach ``address``, or None when there is no route.

    A UDP ``connect`` only looks the route up; no packet is sent.
    """
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((address, port))
        except OSError:
            return None
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the interface whose (primary) IPv4 address is ``address``, or None (also for IPv6)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on this interface
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def is_own_address(address: str) -> bool:
    """True when ``address`` belongs to one of this host's interfaces (it can be bound)."""
    with socket.socket(socket.AF_INET6 if ":" in address else socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((address, 0))
        except OSError:
            return False
    return True
