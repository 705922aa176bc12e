"""Two "hosts" on one machine: network namespaces joined by a veth pair, each with its own IP address.

Each namespace has only ``lo`` and its end of the link, so a job across them really goes over a network
between two hosts (the hostname still resolves to loopback in both, as on many real machines). Needs root.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces (`ip netns add`); CI runs as root"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2) to create network namespaces"
    return None


def _ip(*args: str) -> None:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if res.returncode != 0:
        raise OSError(f"`ip {' '.join(args)}` failed: {res.stderr.strip()}")


@dataclass
class HostPair:
    """Two namespaces ``names[i]`` with addresses ``addrs[i]`` on one link."""

    names: tuple[str, str]
    addrs: tuple[str, str]
    started: list[subprocess.Popen] = field(default_factory=list)

    @classmethod
    def create(cls) -> HostPair:
        tag = f"pt{os.getpid() % 100000}{int(time.time() * 1000) % 1000}"
        pair = cls(names=(f"{tag}a", f"{tag}b"), addrs=("10.123.0.1", "10.123.0.2"))
        veth = (f"v{tag}a", f"v{tag}b")
        try:
            for name in pair.names:
                _ip("netns", "add", name)
            _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
            for name, dev, addr in zip(pair.names, veth, pair.addrs):
                _ip("link", "set", dev, "netns", name)
                _ip("-n", name, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", name, "link", "set", "lo", "up")
                _ip("-n", name, "link", "set", dev, "up")
        except BaseException:
            pair.destroy()
            raise
        return pair

    def command(self, host: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *argv]

    def start(self, host: int, argv: list[str], **kw) -> subprocess.Popen:
        proc = subprocess.Popen(
            self.command(host, argv),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
            **kw,
        )
        self.started.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        res = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, timeout=20)
        return [int(p) for p in res.stdout.split()]

    def kill(self, host: int) -> None:
        """SIGKILL every process in the namespace: the host "loses power"."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def stop_all(self) -> None:
        for proc in self.started:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.communicate(timeout=10)
        self.started.clear()
        for host in (0, 1):
            self.kill(host)

    def destroy(self) -> None:
        """Kill whatever runs inside and delete both namespaces (which deletes the link)."""
        for host, name in enumerate(self.names):
            try:
                self.kill(host)
            except (OSError, subprocess.SubprocessError):
                pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)
