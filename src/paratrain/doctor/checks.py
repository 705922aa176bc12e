"""The doctor's verdicts: :class:`Check` (status, evidence, fix), and the checks of the torch build, the host
and the network. GPU checks live in :mod:`.gpu_checks`, the bandwidth verdict in :mod:`.bandwidth`.

Checks are pure functions of gathered facts: nothing here runs a command or opens a socket, so each status of
each check is tested from hand-built facts. Thresholds are module constants; ``docs/doctor.md`` says why
each value was chosen. Rule of thumb: **fail** when a job will not start or will break, **warn** when it will
run slower than the hardware allows.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

from ..sizes import MIB
from .system import TORCHRUN_DEFAULT_PORT, HostFacts, LoopbackFacts, MasterFacts, TorchFacts

GB = 1e9
"""Decimal gigabytes, as nccl-tests and RAM vendors count (a "128 GB" host has ~135e9 bytes)."""

RAM_PER_GPU_WARN_GB = 16.0
"""Host RAM per GPU below which loader workers, pinned buffers and checkpoint loads get tight."""
RAM_PER_GPU_FAIL_GB = 4.0
"""Below this a CUDA process (context + libraries ≈ 2–3 GB) plus any data is likely OOM-killed."""
RAM_PER_CPU_PROCESS_WARN_GB = 4.0
RAM_PER_CPU_PROCESS_FAIL_GB = 1.0
SHM_FAIL_GB = 0.25
"""Docker's default /dev/shm (64 MB) is below this: DataLoader workers die with 'Bus error'."""
SHM_PER_PROCESS_WARN_GB = 1.0
NOFILE_WARN = 4096
NOFILE_FAIL = 1024


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, kw_only=True)
class Check:
    """One line of the doctor's report."""

    name: str
    status: Status
    evidence: str
    """What was observed, with numbers, so the reader can judge the verdict."""
    fix: str = ""
    """What to do, for warn and fail."""

    @classmethod
    def ok(cls, name: str, evidence: str) -> Check:
        return cls(name=name, status=Status.OK, evidence=evidence)

    @classmethod
    def warn(cls, name: str, evidence: str, fix: str) -> Check:
        return cls(name=name, status=Status.WARN, evidence=evidence, fix=fix)

    @classmethod
    def fail(cls, name: str, evidence: str, fix: str) -> Check:
        return cls(name=name, status=Status.FAIL, evidence=evidence, fix=fix)


def check_torch(torch: TorchFacts, listed: int, visible: int) -> Check:
    """Versions, and whether this torch build can use the GPUs the machine has.

    ``listed`` GPUs are in nvidia-smi, ``visible`` of them are left to CUDA by CUDA_VISIBLE_DEVICES.
    """
    build = f"CUDA {torch.cuda}, NCCL {torch.nccl or 'none'}" if torch.cuda else "CPU-only build"
    evidence = f"Python {torch.python}, torch {torch.torch}, {build}"
    if listed and torch.cuda is None:
        return Check.fail(
            "torch",
            f"{evidence}; nvidia-smi lists {listed} GPU(s)",
            "install a CUDA build of torch (pip install torch --index-url "
            "https://download.pytorch.org/whl/cu128, matching your driver's CUDA version)",
        )
    if visible and not torch.cuda_available:
        return Check.fail(
            "torch",
            f"{evidence}; CUDA does not initialise",
            f"the driver is probably older than CUDA {torch.cuda} needs: upgrade it, or install torch "
            "for an older CUDA; `python -c 'import torch; torch.cuda.init()'` prints the reason",
        )
    return Check.ok("torch", evidence)


def check_backends(torch: TorchFacts, gpus: int) -> Check:
    """gloo serves CPU tensors (and object collectives), NCCL serves GPU tensors."""
    if not torch.distributed:
        return Check.fail(
            "backends",
            "torch.distributed is not available in this build",
            "install an official torch wheel (this one was built without distributed support)",
        )
    evidence = f"gloo {'yes' if torch.gloo else 'no'}, nccl {'yes' if torch.nccl_available else 'no'}"
    if gpus and not torch.nccl_available:
        return Check.fail(
            "backends",
            evidence,
            "GPU jobs need NCCL: install the CUDA wheel from download.pytorch.org, which bundles it",
        )
    if not torch.gloo:
        fix = "install an official torch wheel: gloo ships with every Linux build"
        return Check.warn("backends", evidence, fix) if gpus else Check.fail("backends", evidence, fix)
    if not gpus and not torch.nccl_available:
        evidence += " (not needed without GPUs)"
    return Check.ok("backends", evidence)


_TRUTHY_RISKS = (
    ("NCCL_P2P_DISABLE", "GPU-to-GPU traffic goes through host memory, NVLink/PCIe P2P unused"),
    ("NCCL_SHM_DISABLE", "no shared-memory transport between local ranks"),
    ("NCCL_IB_DISABLE", "multi-node traffic falls back to TCP sockets instead of InfiniBand/RoCE"),
    ("CUDA_LAUNCH_BLOCKING", "every CUDA kernel runs synchronously: a debugging switch, much slower"),
)
_VALUE_RISKS = (
    ("NCCL_P2P_LEVEL", ("LOC", "0"), "P2P is never used"),
    ("NCCL_DEBUG", ("TRACE",), "traces every call: slow, huge logs"),
    ("TORCH_DISTRIBUTED_DEBUG", ("DETAIL",), "checks every collective: for debugging only, slower"),
)
_SET_RISKS = (("NCCL_ALGO", "overrides NCCL's tuning"), ("NCCL_PROTO", "overrides NCCL's tuning"))


def check_env(env: Mapping[str, str], interfaces: Sequence[str]) -> Check:
    """NCCL/gloo/CUDA variables that break a job (a socket interface that does not exist) or slow it down."""
    broken = [
        _missing_interface(var, env[var], interfaces, exact=var.startswith("GLOO"))
        for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
        if var in env
    ]
    broken = [b for b in broken if b]
    if broken:
        return Check.fail(
            "env",
            "; ".join(broken) + f" (interfaces: {', '.join(interfaces) or 'none'})",
            "unset it, or name an interface that exists on every node (NCCL: prefixes, ^ to exclude, "
            "= for exact names; gloo: exact names)",
        )
    risky = [f"{var}={env[var]}: {why}" for var, why in _TRUTHY_RISKS if env.get(var, "").strip() not in ("", "0")]
    risky += [
        f"{var}={env[var]}: {why}" for var, values, why in _VALUE_RISKS if env.get(var, "").strip().upper() in values
    ]
    risky += [f"{var}={env[var]}: {why}" for var, why in _SET_RISKS if env.get(var, "").strip()]
    if risky:
        return Check.warn(
            "env",
            "; ".join(risky),
            "unset these unless you set them on purpose; NCCL_DEBUG=INFO is "
            "harmless and shows which transport NCCL picked",
        )
    shown = sorted(f"{k}={v}" for k, v in env.items() if k.startswith(("NCCL_", "GLOO_")))
    return Check.ok("env", "NCCL/gloo variables: " + (", ".join(shown) if shown else "none set (defaults)"))


def _missing_interface(var: str, spec: str, interfaces: Sequence[str], *, exact: bool) -> str | None:
    """Why ``spec`` selects no usable interface here, or None.

    gloo (``exact``) opens every interface named and fails on a missing one. NCCL matches prefixes, ``^``
    excludes, ``=`` asks for exact names, and fails only when nothing is left.
    """
    if exact:
        missing = [n.strip() for n in spec.split(",") if n.strip() and n.strip() not in interfaces]
        return f"{var}={spec}: no interface {', '.join(missing)}" if missing else None
    exclude = spec.startswith("^")
    body = spec.removeprefix("^")
    exact_names = body.startswith("=")
    names = [n.strip() for n in body.removeprefix("=").split(",") if n.strip()]
    selected = [i for i in interfaces if any(i == n if exact_names else i.startswith(n) for n in names) != exclude]
    return None if selected else f"{var}={spec} matches no interface"


def check_host_memory(host: HostFacts, gpus: int, processes: int) -> Check:
    """Host RAM per GPU (or per CPU process): loader workers, pinned buffers and checkpoint loads live there."""
    count, unit = (gpus, "GPU") if gpus else (processes, "process")
    warn_at, fail_at = (
        (RAM_PER_GPU_WARN_GB, RAM_PER_GPU_FAIL_GB)
        if gpus
        else (RAM_PER_CPU_PROCESS_WARN_GB, RAM_PER_CPU_PROCESS_FAIL_GB)
    )
    total = host.ram_bytes / GB
    per = total / max(count, 1)
    limit = " (container limit)" if host.ram_limited_by_cgroup else ""
    plural = unit if count == 1 else f"{unit}es" if unit == "process" else f"{unit}s"
    evidence = f"{_gb(total)}{limit}, {_gb(per)} per {unit} ({count} {plural})"
    if per < fail_at:
        return Check.fail(
            "host memory",
            evidence,
            f"processes will be OOM-killed: run fewer per node or use a host with ≥ {warn_at:g} GB per {unit}",
        )
    if per < warn_at:
        return Check.warn(
            "host memory",
            evidence,
            f"below {warn_at:g} GB per {unit}: use fewer DataLoader workers and load checkpoints "
            "sharded, or a bigger host",
        )
    return Check.ok("host memory", evidence)


def check_shared_memory(host: HostFacts, processes: int) -> Check:
    """/dev/shm carries every batch from DataLoader workers to the training process."""
    if host.shm_bytes is None or host.shm_free_bytes is None:
        return Check.warn(
            "shared memory",
            "no /dev/shm",
            "DataLoader workers need shared memory: mount a tmpfs at /dev/shm, or use num_workers=0",
        )
    free = host.shm_free_bytes / GB
    evidence = f"/dev/shm {_gb(host.shm_bytes / GB)}, {_gb(free)} free"
    if host.shm_bytes == 64 * MIB:
        evidence += " (Docker's default)"
    fix = (
        "docker run --shm-size=16g (or --ipc=host); Kubernetes: an emptyDir with medium: Memory at /dev/shm; "
        "delete stale /dev/shm/torch_* files"
    )
    if free < SHM_FAIL_GB:
        return Check.fail("shared memory", evidence, f"DataLoader workers will die with 'Bus error': {fix}")
    if free < SHM_PER_PROCESS_WARN_GB * processes:
        return Check.warn("shared memory", f"{evidence}; < {SHM_PER_PROCESS_WARN_GB:g} GB per process", fix)
    return Check.ok("shared memory", evidence)


def check_open_files(host: HostFacts) -> Check:
    """Open-file limit: DataLoader workers share tensors by file descriptor, and every peer is a socket."""
    soft, hard = host.nofile_soft, host.nofile_hard
    evidence = f"soft {soft}, hard {hard}"
    if soft >= NOFILE_WARN:
        return Check.ok("open files", evidence)
    if hard >= NOFILE_WARN:
        fix = f"`ulimit -n {min(hard, 65536)}` before starting (no root needed up to the hard limit)"
    else:
        fix = "raise nofile in /etc/security/limits.conf, or docker run --ulimit nofile=65536:65536"
    if soft < NOFILE_FAIL:
        return Check.fail("open files", evidence, f"'Too many open files' / 'received 0 items of ancdata' ahead: {fix}")
    return Check.warn("open files", evidence, fix)


def check_loopback(loopback: LoopbackFacts) -> Check:
    """A local job's rendezvous store listens on 127.0.0.1."""
    if loopback.bound_port is None:
        return Check.fail(
            "loopback port",
            f"cannot listen on 127.0.0.1: {loopback.error}",
            "bring the loopback interface up (ip link set lo up); check seccomp/firewall rules on bind",
        )
    evidence = f"listened on 127.0.0.1:{loopback.bound_port}"
    if loopback.default_port_in_use:
        return Check.warn(
            "loopback port",
            f"{evidence}; {TORCHRUN_DEFAULT_PORT} (torchrun's default) is taken",
            "another job or a stale store holds it: `paratrain run` picks a free port by itself; pass "
            "--master-port for multi-node jobs",
        )
    return Check.ok("loopback port", evidence)


def check_master(master: MasterFacts) -> Check:
    """The multi-node master address: resolves, and answers on its port (a refusal still proves reachability)."""
    if master.resolve_error:
        return Check.fail(
            "master",
            f"{master.host} does not resolve ({master.resolve_error})",
            "use the master's IP address, or fix DNS or /etc/hosts so every node resolves it",
        )
    address = master.addresses[0]
    route = f"{master.host} → {address}" if master.host != address else address
    if master.connect == "open":
        evidence = f"{route}: port {master.port} open"
    elif master.connect == "refused":
        evidence = f"{route}: reachable, port {master.port} closed (fine before node 0 starts)"
    elif master.connect == "timeout":
        return Check.fail(
            "master",
            f"{route}: no answer on port {master.port} within {master.timeout_s:g} s",
            f"a firewall drops the traffic or the address is wrong: open TCP {master.port} and the "
            "NCCL/gloo ports between the nodes, and use the master's private-network address",
        )
    else:
        return Check.fail(
            "master",
            f"{route}: {master.connect}",
            "no route to the master: check the address and this node's network (`ip route`)",
        )
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return Check.warn(
            "master",
            evidence,
            "a loopback address only works when every node is this host: use the master's network address",
        )
    return Check.ok("master", evidence)


def _gb(value: float) -> str:
    return f"{value:.1f} GB" if value >= 1 else f"{value:.2f} GB"
