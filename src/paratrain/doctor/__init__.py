"""``paratrain doctor``: is this machine ready for distributed training, and if not, what to do.

:func:`run_doctor` gathers facts (torch build, nvidia-smi, host limits, environment, network), turns them into
checks with a status, the evidence and a fix (:mod:`.checks`), and times a live all-reduce across local
processes (:mod:`.bandwidth`). Gathering is injectable (a :class:`~.nvidia.CommandRunner` and prebuilt facts),
so tests drive every GPU check from recorded nvidia-smi outputs on a machine without a GPU.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError, ParatrainError
from ..sizes import MIB
from .bandwidth import BandwidthResult, check_bandwidth, check_bandwidth_error, expected_busbw, measure_allreduce
from .checks import (
    GB,
    Check,
    Status,
    check_backends,
    check_env,
    check_host_memory,
    check_loopback,
    check_master,
    check_open_files,
    check_shared_memory,
    check_torch,
)
from .gpu_checks import check_gpu_models, check_interconnect, check_pcie, check_visible_gpus, resolve_visible
from .nvidia import CommandRunner, Gpu, NvidiaFacts, probe, run_command
from .scripts import check_cuda, check_script
from .system import HostFacts, TorchFacts, gather_host, gather_torch, parse_master_addr, probe_master

__all__ = ["Check", "DoctorOptions", "DoctorReport", "Status", "run_doctor"]

CPU_PROCESSES = 2
"""Processes of the CPU all-reduce, like ``paratrain run`` on a machine without GPUs."""


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """What to check beyond the local machine, and how long the live test may take."""

    master_addr: str | None = None
    """HOST[:PORT] of a multi-node job's master (port 29500 by default): resolved and dialled once, nothing else."""
    skip_bandwidth: bool = False
    """Leave out the live all-reduce (saves a few seconds)."""
    max_bytes: int = 64 * MIB
    """Largest all-reduce buffer; the sweep also stops early once it has spent a few seconds."""
    nproc: int = CPU_PROCESSES
    """Processes for the CPU all-reduce; on a machine with 2+ GPUs every visible GPU takes part instead."""
    connect_timeout_s: float = 2.0
    """How long to wait for the master to answer."""
    bandwidth_timeout_s: float = 60.0
    """Hard limit on the live test, so a hung collective cannot hang the doctor."""
    tensorflow: bool = True
    """The TensorFlow section when TensorFlow is installed (:mod:`paratrain.tf.doctor`; imports it in a child)."""
    scripts: tuple[str, ...] = ()
    """Training scripts to read for imports that will hurt and CUDA hard-coded on a host without it
    (:mod:`.scripts`; torch and TensorFlow together: :mod:`paratrain.tf.doctor`)."""

    def __post_init__(self) -> None:
        if not 1024 <= self.max_bytes <= 1 << 30:
            raise ConfigError(
                f"the largest all-reduce buffer must be 1 KiB to 1 GiB (--max-mb 1..1024), got {self.max_bytes} bytes"
            )
        if self.nproc < 2:
            raise ConfigError(f"an all-reduce needs at least 2 processes, got --nproc {self.nproc}")
        if self.master_addr is not None:
            parse_master_addr(self.master_addr)


@dataclass(frozen=True, kw_only=True)
class DoctorReport:
    """The checks, in order, and the bandwidth table they were judged from."""

    title: str
    """One line naming the host and what it has."""
    checks: tuple[Check, ...]
    bandwidth: BandwidthResult | None = None
    expected_busbw_gbps: float | None = None

    @property
    def exit_code(self) -> int:
        """0 when nothing failed (warnings allowed), 1 otherwise."""
        return int(any(c.status is Status.FAIL for c in self.checks))

    def counts(self) -> dict[str, int]:
        return {s.value: sum(c.status is s for c in self.checks) for s in Status}

    def to_dict(self) -> dict[str, Any]:
        """The machine-readable form behind ``--json``."""
        bandwidth = None
        if self.bandwidth is not None:
            b = self.bandwidth
            bandwidth = {
                "backend": b.backend,
                "device": b.device,
                "world_size": b.world_size,
                "correct": b.correct,
                "peak_busbw_gbps": b.peak_busbw_gbps,
                "expected_busbw_gbps": self.expected_busbw_gbps,
                "rows": [
                    {
                        "size_bytes": r.size_bytes,
                        "time_us": r.seconds * 1e6,
                        "algbw_gbps": r.algbw_gbps,
                        "busbw_gbps": r.busbw_gbps,
                    }
                    for r in b.rows
                ],
            }
        return {
            "title": self.title,
            "exit_code": self.exit_code,
            "counts": self.counts(),
            "checks": [
                {"name": c.name, "status": c.status.value, "evidence": c.evidence, "fix": c.fix} for c in self.checks
            ],
            "bandwidth": bandwidth,
        }


def run_doctor(
    options: DoctorOptions | None = None,
    *,
    runner: CommandRunner = run_command,
    torch_facts: TorchFacts | None = None,
    host: HostFacts | None = None,
) -> DoctorReport:
    """Run every check (and the live all-reduce unless skipped); facts not passed in are gathered here."""
    options = options or DoctorOptions()
    torch_facts = torch_facts or gather_torch()
    host = host or gather_host()
    nvidia = probe(runner)
    cvd = host.env.get("CUDA_VISIBLE_DEVICES")
    visible = resolve_visible(cvd, nvidia.gpus)
    gpus = [g for i in visible.indices for g in nvidia.gpus if g.index == i]
    processes = len(gpus) or options.nproc
    checks = [
        check_torch(torch_facts, len(nvidia.gpus), len(gpus)),
        check_visible_gpus(torch_facts, nvidia, cvd, visible),
    ]
    if gpus:
        checks += [check_gpu_models(gpus), check_interconnect(gpus, nvidia.links), check_pcie(gpus)]
    checks += [
        check_host_memory(host, len(gpus), processes),
        check_shared_memory(host, processes),
        check_open_files(host),
        check_backends(torch_facts, len(gpus)),
        check_env(host.env, host.interfaces),
        check_loopback(host.loopback),
    ]
    cuda = torch_facts.cuda_available and torch_facts.device_count > 0
    checks += [c for path in options.scripts for c in (check_script(path), check_cuda(path, cuda))]
    if options.master_addr is not None:
        master_host, port = parse_master_addr(options.master_addr)
        checks.append(check_master(probe_master(master_host, port, options.connect_timeout_s)))
    if options.tensorflow or options.scripts:
        from ..tf.doctor import gather_tf, tf_checks

        checks += tf_checks(gather_tf() if options.tensorflow else None, options.scripts)
    bandwidth, expected = None, None
    if not options.skip_bandwidth:
        use_gpus = torch_facts.device_count >= 2 and torch_facts.nccl_available
        bandwidth, check, expected = _bandwidth(options, use_gpus, torch_facts.device_count, gpus, nvidia)
        checks.append(check)
    return DoctorReport(
        title=_title(torch_facts, host, gpus), checks=tuple(checks), bandwidth=bandwidth, expected_busbw_gbps=expected
    )


def _bandwidth(
    options: DoctorOptions, use_gpus: bool, gpu_count: int, gpus: list[Gpu], nvidia: NvidiaFacts
) -> tuple[BandwidthResult | None, Check, float | None]:
    """All-reduce over NCCL on every visible GPU when there are 2+, else over gloo on CPU processes.

    CPU processes are forked: they inherit the imported torch and start in milliseconds instead of seconds
    (this process has not initialised CUDA, so forking is safe). GPU processes are spawned, as CUDA requires.
    """
    try:
        result = measure_allreduce(
            nprocs=gpu_count if use_gpus else options.nproc,
            accelerator="cuda" if use_gpus else "cpu",
            max_bytes=options.max_bytes,
            timeout_s=options.bandwidth_timeout_s,
            start_method="spawn" if use_gpus else "fork",
        )
    except ParatrainError as err:
        return None, check_bandwidth_error(err), None
    expected = expected_busbw(result.device, gpus, nvidia.links)
    check = check_bandwidth(result, expected)
    return result, check, (expected[0] if expected else None)


def _title(torch: TorchFacts, host: HostFacts, gpus: list[Gpu]) -> str:
    names = sorted({g.name for g in gpus})
    hardware = f"{len(gpus)} GPU(s) ({', '.join(names)})" if gpus else "no GPU"
    return (
        f"{socket.gethostname()}: {host.cores} cores, {host.ram_bytes / GB:.1f} GB RAM, {hardware}, torch {torch.torch}"
    )
