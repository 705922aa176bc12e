"""Live all-reduce bandwidth, measured the way nccl-tests measures it.

For a buffer of S bytes that takes t seconds to all-reduce on n ranks:

* algorithm bandwidth ``algbw = S / t``;
* bus bandwidth ``busbw = algbw * 2(n-1)/n``: a ring all-reduce moves 2(n-1)/n × S over each rank's link, so
  busbw is comparable with the link's own speed whatever n is (at n = 2 it equals algbw).

Ranks are started with :func:`paratrain.launch` (gloo on CPU processes, or NCCL on the local GPUs, chosen by
:mod:`paratrain.devices` like every other job), so the measurement goes through the same path training does.
Each size is first checked for a correct sum; the time of a size is the slowest rank's mean over the timed
iterations.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import TYPE_CHECKING

from ..sizes import KIB, MIB, format_bytes
from .checks import GB, Check
from .gpu_checks import pcie_gbps
from .nvidia import Gpu

if TYPE_CHECKING:
    import torch

WARMUP = 2
NVLINK_GBPS_PER_LINK = 25.0
"""Per link and direction for NVLink 2, 3 and 4 (V100, A100, H100)."""
LINK_EFFICIENCY = 0.8
"""Share of a link's speed nccl-tests' all-reduce busbw reaches at large sizes."""
CPU_EXPECTED_BUSBW_GBPS = 1.0
"""gloo over loopback on a small CPU box (FIELD-NOTES: 1.0–1.5 GB/s at world size 2)."""
CPU_WARN_FRACTION = 0.1
"""Warn (never fail) below a tenth: a loaded machine can halve gloo's speed without anything being wrong."""
GPU_WARN_FRACTION = 0.25
"""The sweep stops at 64 MiB, below the sizes where NCCL peaks, so only a large shortfall is flagged."""
GPU_FAIL_FRACTION = 0.05
"""A twentieth of the link: NCCL is not using it at all (P2P off, traffic through host memory)."""
SWEEP_BUDGET_S = 3.0
"""Stop growing the buffer once the timed loops have taken this long, so a slow link keeps the doctor fast."""


@dataclass(frozen=True, kw_only=True)
class BandwidthRow:
    """One buffer size of the sweep."""

    size_bytes: int
    seconds: float
    """Mean time of one all-reduce (slowest rank)."""
    algbw_gbps: float
    busbw_gbps: float


@dataclass(frozen=True, kw_only=True)
class BandwidthResult:
    """The sweep on one backend."""

    backend: str
    device: str
    """'cpu' or 'cuda'."""
    world_size: int
    rows: tuple[BandwidthRow, ...]
    correct: bool
    """Every rank saw the exact expected sum for every size."""

    @property
    def peak_busbw_gbps(self) -> float:
        return max((row.busbw_gbps for row in self.rows), default=0.0)


def sweep_sizes(max_bytes: int, min_bytes: int = KIB, factor: int = 4) -> list[int]:
    """1 KiB, 4 KiB, … up to ``max_bytes`` (included when it is not on the ×4 ladder)."""
    sizes, size = [], min_bytes
    while size < max_bytes:
        sizes.append(size)
        size *= factor
    sizes.append(max_bytes)
    return sizes


def algbw(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes/s, as nccl-tests reports)."""
    return size_bytes / seconds / GB if seconds > 0 else 0.0


def allreduce_busbw(algbw_gbps: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce: algbw × 2(n-1)/n."""
    return algbw_gbps * 2 * (world_size - 1) / world_size


def iterations(size_bytes: int) -> int:
    """Timed iterations for a size: many for small buffers (latency-bound, noisy), few for large ones."""
    if size_bytes < MIB:
        return 20
    return 10 if size_bytes < 16 * MIB else 4


def measure_allreduce(
    *,
    nprocs: int,
    accelerator: str,
    max_bytes: int,
    timeout_s: float = 60.0,
    budget_s: float = SWEEP_BUDGET_S,
    start_method: str = "spawn",
) -> BandwidthResult:
    """Run the sweep on ``nprocs`` local processes; raises the launcher's errors when a rank fails or hangs.

    ``start_method="fork"`` starts CPU ranks in milliseconds (they inherit the imported torch); CUDA needs
    ``"spawn"``.
    """
    from ..launcher import launch

    sizes = sweep_sizes(max_bytes)
    results = launch(sweep, nprocs, (sizes, accelerator, budget_s), timeout_s=timeout_s, start_method=start_method)
    backend, device, timings, _ = results[0]
    rows = tuple(
        BandwidthRow(
            size_bytes=size, seconds=t, algbw_gbps=algbw(size, t), busbw_gbps=allreduce_busbw(algbw(size, t), nprocs)
        )
        for size, t in timings
    )
    return BandwidthResult(
        backend=backend, device=device, world_size=nprocs, rows=rows, correct=all(result[3] for result in results)
    )


def sweep(sizes: list[int], accelerator: str, budget_s: float) -> tuple[str, str, list[tuple[int, float]], bool]:
    """One rank's part (runs inside a launched process): (backend, device type, [(size, seconds)], correct)."""
    import time

    import torch
    import torch.distributed as dist

    from ..distributed.process_group import start_tool_group
    from ..env import ClusterEnv

    env = ClusterEnv.from_environ()
    device = start_tool_group(accelerator, host_tensors=False, timeout_s=30)
    backend = dist.get_backend()
    n, correct, timings, spent = env.world_size, True, [], 0.0
    try:
        for size in sizes:
            buf = torch.full((size // 4,), float(env.rank + 1), dtype=torch.float32, device=device)
            dist.all_reduce(buf)
            correct &= bool((buf == n * (n + 1) / 2).all())
            buf.zero_()
            iters = iterations(size)
            for _ in range(WARMUP):
                dist.all_reduce(buf)
            _sync(device)
            start = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(buf)
            _sync(device)
            slowest = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the same value on every rank, so all stop together
            seconds = float(slowest.item())
            timings.append((size, seconds))
            spent += seconds * (iters + WARMUP)
            if spent > budget_s:
                break
    finally:
        dist.destroy_process_group()
    return backend, device.type, timings, correct


def _sync(device: torch.device) -> None:
    """Wait for queued GPU work, so the clock measures the collective and not its launch."""
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def expected_busbw(device: str, gpus: Sequence[Gpu], links: Mapping[tuple[int, int], str]) -> tuple[float, str] | None:
    """Rough all-reduce busbw the slowest path should reach, and what it is based on; None if unknown.

    CPU: gloo over loopback. GPUs: NVLink links × per-link speed when every pair has NVLink, else the
    slowest GPU's PCIe link; either times the share of a link that all-reduce reaches.
    """
    if device == "cpu":
        return CPU_EXPECTED_BUSBW_GBPS, "gloo on loopback"
    cells = [links.get((a, b)) for a, b in combinations([g.index for g in gpus], 2)]
    counts = [int(m.group(1)) for c in cells if c and (m := re.fullmatch(r"NV(\d+)", c))]
    if cells and len(counts) == len(cells):
        return NVLINK_GBPS_PER_LINK * min(counts) * LINK_EFFICIENCY, f"NV{min(counts)}"
    speeds = [(pcie_gbps(g.pcie_gen_max, g.pcie_width), g) for g in gpus]
    if not speeds or any(s is None for s, _ in speeds):
        return None
    speed, slowest = min(speeds, key=lambda item: item[0] or 0.0)
    return (speed or 0.0) * LINK_EFFICIENCY, f"PCIe gen{slowest.pcie_gen_max} x{slowest.pcie_width}"


def check_bandwidth(result: BandwidthResult, expected: tuple[float, str] | None) -> Check:
    """The measured all-reduce: a correct sum, and a bus bandwidth not far below the link's speed.

    On CPU the verdict is at worst warn: gloo over loopback is memory-bound and shares cores with everything
    else on the machine.
    """
    peak = max(result.rows, key=lambda row: row.busbw_gbps)
    evidence = (
        f"busbw {peak.busbw_gbps:.2f} GB/s at {format_bytes(peak.size_bytes, digits=6)}, {result.backend}, "
        f"{result.world_size} ranks"
    )
    if not result.correct:
        return Check.fail(
            "all-reduce",
            f"{evidence}; WRONG SUM",
            "the backend corrupts data: rerun with NCCL_DEBUG=INFO and report it with the --json output",
        )
    if expected is None:
        return Check.ok("all-reduce", evidence)
    speed, basis = expected
    warn_at, fail_at = (CPU_WARN_FRACTION, 0.0) if result.device == "cpu" else (GPU_WARN_FRACTION, GPU_FAIL_FRACTION)
    evidence += f" (expect ≈{speed:.3g} for {basis})"
    fix = (
        "check the interconnect and env rows above; rerun with NCCL_DEBUG=INFO to see the transport NCCL picked"
        if result.device == "cuda"
        else "the machine is busy or slow: close other jobs and rerun"
    )
    if peak.busbw_gbps < speed * fail_at:
        return Check.fail("all-reduce", evidence, fix)
    if peak.busbw_gbps < speed * warn_at:
        return Check.warn("all-reduce", evidence, fix)
    return Check.ok("all-reduce", evidence)


def check_bandwidth_error(error: Exception) -> Check:
    """The live collective could not run: the job a user starts will not run either."""
    evidence = f"the test job failed: {error}"
    last = (getattr(error, "traceback", None) or "").strip().splitlines()
    if last:
        evidence += f": {last[-1]}"
    return Check.fail("all-reduce", evidence, "fix the failed checks above first; on GPUs rerun with NCCL_DEBUG=INFO")
