"""What this machine offers a benchmark (cores, GPUs) and how much memory a rank used at its peak."""

from __future__ import annotations

import os
import re
import resource
import time
from dataclasses import dataclass

import torch

from ..env import cpu_count


@dataclass(frozen=True, kw_only=True)
class Machine:
    """The resources a configuration is checked against before it is called oversubscribed."""

    cores: int
    """CPUs this process may run on (affinity)."""
    physical_cores: int
    """Distinct physical cores among them (hyper-threads counted once)."""
    gpus: int
    """Visible CUDA devices (0 on a CPU-only machine or with accelerator='cpu')."""

    @classmethod
    def here(cls, accelerator: str = "auto") -> Machine:
        gpus = torch.cuda.device_count() if accelerator != "cpu" and torch.cuda.is_available() else 0
        return cls(cores=cpu_count(), physical_cores=physical_cores(), gpus=gpus)

    def oversubscribed(self, processes: int, threads: int) -> str | None:
        """Why ``processes`` ranks of ``threads`` threads each share hardware, or None when they don't."""
        if self.gpus:
            if processes > self.gpus:
                return f"{processes} processes on {self.gpus} GPU(s)"
            return None
        if processes * threads > self.physical_cores:
            return f"{processes} x {threads} threads on {self.physical_cores} physical cores"
        return None

    def describe(self) -> str:
        cpu = f"{self.cores} CPUs ({self.physical_cores} physical cores)"
        return f"{cpu}, {self.gpus} GPU(s)" if self.gpus else f"{cpu}, no GPU"


def physical_cores() -> int:
    """Physical cores among the CPUs this process may use, from sysfs topology; the CPU count if unknown."""
    try:
        cpus = os.sched_getaffinity(0)
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
    cores = set()
    for cpu in cpus:
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/core_cpus_list") as f:
                cores.add(f.read().strip())
        except OSError:
            return len(cpus)
    return max(len(cores), 1)


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq = map(int, f.readline().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and every descendant it has reaped (launched jobs and their workers)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class BackgroundLoad:
    """The share of this machine's CPUs that *other* processes used while a measurement ran: a shared machine
    skews every timing, so a report says so instead of hiding it."""

    def __init__(self) -> None:
        self._machine, self._own, self._wall = machine_cpu_s(), own_cpu_s(), time.perf_counter()

    def share(self) -> float:
        foreign = (machine_cpu_s() - self._machine) - (own_cpu_s() - self._own)
        wall = time.perf_counter() - self._wall
        return max(0.0, foreign) / max(wall * cpu_count(), 1e-9)


class PeakMemory:
    """The peak memory of this rank over a stretch of work: CUDA allocations on a GPU, resident set on a CPU.

    On the CPU the kernel's resident-set high-water mark (``VmHWM``) is reset at ``start`` through
    ``/proc/self/clear_refs``, so each configuration of a job is measured on its own; where that reset is
    refused, the mark covers the whole process so far and ``kind`` says so.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda_max_allocated" if device.type == "cuda" else "rss_peak"

    def start(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self.kind = "rss_peak_since_process_start"

    def peak_bytes(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        try:
            with open("/proc/self/status") as f:
                found = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
            if found:
                return int(found.group(1)) * 1024
        except OSError:
            pass
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux reports KiB
