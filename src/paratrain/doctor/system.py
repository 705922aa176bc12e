"""Facts about this host and this torch build, gathered once and handed to the pure checks.

Each gatherer reads one thing (``/proc/meminfo``, ``/dev/shm``, the open-file limit, network interfaces, a
loopback socket, the master's address) and returns a frozen dataclass, so a test builds the same dataclass
by hand to drive a check into every status.
"""

from __future__ import annotations

import os
import platform
import resource
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..env import cpu_count
from ..errors import ConfigError
from ..launcher.ports import port_in_use

TORCHRUN_DEFAULT_PORT = 29500
ENV_PREFIXES = ("NCCL_", "GLOO_", "CUDA_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_")


@dataclass(frozen=True, kw_only=True)
class TorchFacts:
    """This interpreter and torch build."""

    python: str
    torch: str
    cuda: str | None = None
    """CUDA version torch was built with; None for a CPU-only build."""
    cuda_available: bool = False
    """``torch.cuda.is_available()``: the build has CUDA *and* a driver initialised it."""
    device_count: int = 0
    """GPUs torch sees (after CUDA_VISIBLE_DEVICES)."""
    nccl: str | None = None
    """NCCL version bundled with torch, when it has one."""
    distributed: bool = True
    gloo: bool = True
    nccl_available: bool = False


@dataclass(frozen=True, kw_only=True)
class LoopbackFacts:
    """Whether this host can open the ports a local job needs."""

    bound_port: int | None
    """A port bound and listened on at 127.0.0.1 a moment ago, or None when binding failed."""
    error: str | None = None
    default_port_in_use: bool = False
    """torchrun's default master port (29500) is taken here."""


@dataclass(frozen=True, kw_only=True)
class HostFacts:
    """Memory, limits and network of this host, plus the environment variables the checks read."""

    cores: int
    ram_bytes: int
    """Memory this process may use: physical RAM, or the container's cgroup limit when lower."""
    ram_limited_by_cgroup: bool = False
    shm_bytes: int | None = None
    """Size of /dev/shm; None where there is none (then DataLoader workers fall back to files)."""
    shm_free_bytes: int | None = None
    nofile_soft: int = 0
    nofile_hard: int = 0
    loopback: LoopbackFacts
    interfaces: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    """The variables that steer CUDA, NCCL, gloo and torch.distributed, as set for this process."""


@dataclass(frozen=True, kw_only=True)
class MasterFacts:
    """What happened when this host looked up and dialled the multi-node master address."""

    host: str
    port: int
    addresses: tuple[str, ...] = ()
    """Resolved IP addresses; empty when resolution failed."""
    resolve_error: str | None = None
    connect: str = "skipped"
    """'open' (something listens), 'refused' (host answered, port closed), 'timeout', or an error text."""
    timeout_s: float = 2.0


def gather_torch() -> TorchFacts:
    """Versions and capabilities of the torch this interpreter imports."""
    import torch
    import torch.distributed as dist

    cuda_available = torch.cuda.is_available()
    nccl = None
    if torch.version.cuda is not None:
        try:
            nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
        except (RuntimeError, AttributeError, TypeError):
            nccl = None
    distributed = dist.is_available()
    return TorchFacts(
        python=platform.python_version(),
        torch=torch.__version__,
        cuda=torch.version.cuda,
        cuda_available=cuda_available,
        device_count=torch.cuda.device_count() if cuda_available else 0,
        nccl=nccl,
        distributed=distributed,
        gloo=distributed and dist.is_gloo_available(),
        nccl_available=distributed and dist.is_nccl_available(),
    )


def gather_host(environ: Mapping[str, str] | None = None) -> HostFacts:
    """Read memory, /dev/shm, the open-file limit, interfaces, a loopback port and the relevant env vars."""
    env = os.environ if environ is None else environ
    ram, cgroup_limit = _ram_bytes()
    shm = _statvfs("/dev/shm")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return HostFacts(
        cores=cpu_count(),
        ram_bytes=cgroup_limit or ram,
        ram_limited_by_cgroup=cgroup_limit is not None,
        shm_bytes=shm[0] if shm else None,
        shm_free_bytes=shm[1] if shm else None,
        nofile_soft=_limit(soft),
        nofile_hard=_limit(hard),
        interfaces=_interfaces(),
        loopback=probe_loopback(),
        env={k: v for k, v in env.items() if k.startswith(ENV_PREFIXES)},
    )


def probe_loopback() -> LoopbackFacts:
    """Bind and listen on 127.0.0.1 with an OS-chosen port, as a local rendezvous store does."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            port = int(s.getsockname()[1])
    except OSError as err:
        return LoopbackFacts(bound_port=None, error=str(err))
    return LoopbackFacts(bound_port=port, default_port_in_use=port_in_use("127.0.0.1", TORCHRUN_DEFAULT_PORT))


def probe_master(host: str, port: int, timeout_s: float = 2.0) -> MasterFacts:
    """Resolve ``host`` and open one TCP connection to ``host:port`` — the only address the doctor dials."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        return MasterFacts(host=host, port=port, resolve_error=str(err), timeout_s=timeout_s)
    addresses = tuple(dict.fromkeys(str(info[4][0]) for info in infos))
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(timeout_s)
        try:
            s.connect(sockaddr)
            outcome = "open"
        except ConnectionRefusedError:
            outcome = "refused"
        except TimeoutError:
            outcome = "timeout"
        except OSError as err:
            outcome = err.strerror or str(err)
    return MasterFacts(host=host, port=port, addresses=addresses, connect=outcome, timeout_s=timeout_s)


def _ram_bytes() -> tuple[int, int | None]:
    """Physical RAM from /proc/meminfo (sysconf elsewhere) and the cgroup memory limit when it is lower."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    ram = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    limit = None
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < ram:  # 'max' or a near-2**63 value mean no limit
            limit = int(raw)
        break
    return ram, limit


def _interfaces() -> tuple[str, ...]:
    try:
        return tuple(name for _, name in socket.if_nameindex())
    except OSError:
        return ()


def _statvfs(path: str) -> tuple[int, int] | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def _limit(value: int) -> int:
    """RLIM_INFINITY as a large number, so comparisons stay simple."""
    return 2**31 - 1 if value == resource.RLIM_INFINITY else value


def parse_master_addr(text: str) -> tuple[str, int]:
    """'HOST', 'HOST:PORT', '[IPv6]:PORT' or a bare IPv6 address → (host, port); the port defaults to 29500."""
    text = text.strip()
    if text.startswith("["):
        host, bracket, rest = text[1:].partition("]")
        port_text = rest.removeprefix(":") if rest.startswith(":") else None
        if not bracket or (rest and port_text is None):
            raise ConfigError(f"--master-addr {text!r}: expected [IPv6]:PORT")
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    else:
        host, port_text = text, None
    if not host:
        raise ConfigError(f"--master-addr {text!r} has no host; expected HOST or HOST:PORT")
    if port_text is None:
        return host, TORCHRUN_DEFAULT_PORT
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ConfigError(f"--master-addr {text!r}: port must be a number in 1..65535")
    return host, int(port_text)
