"""``paratrain plan --measure`` on a GPU: a few real training steps of the model on this machine's GPU.

The catalogue's figures are a guess: its old whole-step MFU (0.4) was off by 1.3-2.2x for GPT-2 on an H100 (the model
reached 0.18-0.30), its matmul efficiency with elementwise passes (docs/planner-model.md) still by 1.3-2.5x there.
A measured step replaces it: the forward+backward and the optimizer step are timed apart, under the planned
precision and optimizer, so ``hardware.calibrated`` can set both the sustained compute rate and the memory
bandwidth from them, as ``--step-time`` with ``--optimizer-time`` does. The model's sizes and activations still
come from the closed forms or the meta-device trace (checked against ``max_memory_allocated``,
benchmarks/GPU-LOG.md); the peak measured here is reported beside the plan's.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError
from .hardware import Device
from .inputs import InputSpec, TrainingCall, forward_of

_OPTIMIZERS: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-4),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-4),
    "sgd": lambda p: torch.optim.SGD(p, lr=1e-4),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-4, momentum=0.9),
}
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class GpuStep:
    """Medians of a few timed steps on one GPU, after warm-up."""

    gpu: str
    """``torch.cuda.get_device_name()``."""
    batch: int
    forward_backward_s: float
    optimizer_s: float
    peak_bytes: int
    """``max_memory_allocated`` over the timed steps, less what was allocated before the model was built."""


def check_same_gpu(device: Device, gpu_name: str) -> None:
    """Refuse to calibrate catalogue device ``device`` from a step timed on ``gpu_name``: an A100 plan with an
    H100's rate would be silently wrong."""
    family = re.sub(r"-\d+gb$", "", device.name).replace("-", "")
    if family not in re.sub(r"[^a-z0-9]", "", gpu_name.lower()):
        raise ConfigError(
            f"--measure ran on this machine's {gpu_name}, but the plan is for --gpu {device.name}; "
            f"plan for this GPU (--gpu {family}) or drop --measure"
        )


def time_gpu_step(
    factory: Callable[[], nn.Module],
    example: InputSpec | TrainingCall,
    *,
    batch: int,
    precision: str,
    optimizer: str,
    steps: int = 5,
    warmup: int = 3,
) -> GpuStep:
    """Build ``factory()`` on the current CUDA device and time ``steps`` training steps of ``batch`` samples, each
    called as training calls the model (``example``: its input, or ``TrainingCall``).

    The loss is the model's own where it returns one, else the sum of its output in fp32, as the CPU measurement
    takes it: the planner counts a model's matrix products, and a cross-entropy over the logits adds little beside
    them.
    """
    if not torch.cuda.is_available():
        raise ConfigError("measuring on a GPU needs CUDA, and torch sees none here; use --gpu cpu or drop --measure")
    if optimizer not in _OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; choose one of: {', '.join(_OPTIMIZERS)}")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with torch.device(device):
        model = factory()
    model = model.to(device)
    opt = _OPTIMIZERS[optimizer]([p for p in model.parameters() if p.requires_grad])
    x, targets = TrainingCall.of(example).inputs(model, batch, device)
    dtype = _AUTOCAST.get(precision)
    autocast = torch.autocast("cuda", dtype=dtype) if dtype is not None else nullcontext()
    fb, op = [], []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.reset_peak_memory_stats(device)
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        with autocast:
            loss = forward_of(model(x, **targets)).loss.float()
        loss.backward()
        torch.cuda.synchronize(device)
        middle = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize(device)
        if i >= warmup:
            fb.append(middle - start)
            op.append(time.perf_counter() - middle)
    peak = torch.cuda.max_memory_allocated(device) - before
    del model, opt, x, targets, loss
    torch.cuda.empty_cache()
    return GpuStep(
        gpu=torch.cuda.get_device_name(device),
        batch=batch,
        forward_backward_s=statistics.median(fb),
        optimizer_s=statistics.median(op),
        peak_bytes=peak,
    )
