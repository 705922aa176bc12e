"""A window's figures as the scalars trackers take: each rank's (``MonitorConfig.tensorboard_dir``) and the job's
(``log_with``): step time, data wait, memory, samples and tokens per second over the whole job, the FLOP/s each
device achieved and that over its peak (MFU), the planner's arithmetic run on measured steps."""

from __future__ import annotations

import re
import statistics
from collections.abc import Sequence

import torch

from ..planner.hardware import DEVICE_ALIASES, DEVICES
from ..sizes import GIB
from .rules import RankStats


def catalogue_peak_flops(device: torch.device, precision: str) -> float | None:
    """A CUDA device's peak FLOP/s at ``precision`` from the planner's catalogue, found by a word of its name
    (``NVIDIA H100 80GB HBM3`` is an h100); None for a CPU or a GPU the catalogue lacks."""
    if device.type != "cuda":
        return None
    for word in re.split(r"[^a-z0-9]+", torch.cuda.get_device_name(device).lower()):
        known = DEVICES.get(DEVICE_ALIASES.get(word, word))
        if known is not None:
            return known.peak_tflops(precision) * 1e12
    return None


def job_figures(
    rows: Sequence[RankStats], *, replicas: int, flops_per_sample: float | None = None, peak_flops: float | None = None
) -> dict[str, float]:
    """The figures a window gives the trackers, for the job as a whole.

    ``rows`` are the window's ranks (those that train); ``replicas`` how many of them read different data (the
    others, a pipeline's later stages or a tensor-parallel group, count the same batches again). Step time is
    the ranks' median (equal by construction), data wait and memory the worst rank's; samples and tokens per
    second count every replica; FLOP/s and MFU are per device. A figure that cannot be known is left out.
    """
    measured = [r for r in rows if r.steps > 0 and r.step_ms > 0]
    if not measured:
        return {}
    step_s = statistics.median(r.step_ms for r in measured) / 1e3
    figures = {"monitor/step_ms": step_s * 1e3, "monitor/data_share": max(r.data_share for r in measured)}
    peak_mem = max(r.peak_mem for r in measured)
    if peak_mem >= 0:
        figures["monitor/peak_mem_gib"] = peak_mem / GIB
    samples = statistics.mean(r.samples for r in measured) * replicas / step_s
    tokens = statistics.mean(r.tokens for r in measured) * replicas / step_s
    if samples > 0:
        figures["monitor/samples_per_s"] = samples
    if tokens > 0:
        figures["monitor/tokens_per_s"] = tokens
    if flops_per_sample is not None and samples > 0:
        per_device = flops_per_sample * samples / len(rows)
        figures["monitor/tflops_per_device"] = per_device / 1e12
        if peak_flops is not None:
            figures["monitor/mfu"] = per_device / peak_flops
    return figures


def rank_figures(rows: Sequence[RankStats]) -> dict[str, float]:
    """Every rank's figures as scalars ``monitor/<figure>/rank<r>``."""
    return {
        f"monitor/{name}/rank{r.rank}": value
        for r in rows
        for name, value in (
            ("step_ms", r.step_ms),
            ("data_share", r.data_share),
            ("compute_ms", r.compute_ms),
            ("sync_ms", r.sync_ms),
            ("peak_mem_gib", r.peak_mem / GIB),
        )
    }
