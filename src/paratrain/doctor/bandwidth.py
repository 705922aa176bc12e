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

from dataclasses import dataclass

KIB = 1024
MIB = 1024 * KIB
GB = 1e9
WARMUP = 2
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


def measure_allreduce(*, nprocs: int, accelerator: str, max_bytes: int, timeout_s: float = 60.0,
                      budget_s: float = SWEEP_BUDGET_S) -> BandwidthResult:
    """Run the sweep on ``nprocs`` local processes; raises the launcher's errors when a rank fails or hangs."""
    from ..launch import launch

    sizes = sweep_sizes(max_bytes)
    results = launch(sweep, nprocs, (sizes, accelerator, budget_s), timeout_s=timeout_s)
    backend, device, timings, _ = results[0]
    rows = tuple(BandwidthRow(size_bytes=size, seconds=t, algbw_gbps=algbw(size, t),
                              busbw_gbps=allreduce_busbw(algbw(size, t), nprocs)) for size, t in timings)
    return BandwidthResult(backend=backend, device=device, world_size=nprocs, rows=rows,
                           correct=all(result[3] for result in results))


def sweep(sizes: list[int], accelerator: str, budget_s: float) -> tuple[str, str, list[tuple[int, float]], bool]:
    """One rank's part (runs inside a launched process): (backend, device type, [(size, seconds)], correct)."""
    import time
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from ..devices import backend_for, select_device
    from ..env import ClusterEnv

    env = ClusterEnv.from_environ()
    device = select_device(env.local_rank, accelerator)
    backend = backend_for(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=30))
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


def _sync(device) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)
