"""Numbers a job combines over its ranks: sums and means over the data-parallel replicas, minimums, gathered objects."""

from __future__ import annotations

from numbers import Integral
from typing import Any

import torch
import torch.distributed as dist


def reduce_value(
    value: torch.Tensor | float, *, mean: bool, size: int, group: dist.ProcessGroup | None, device: torch.device
) -> torch.Tensor | float:
    """The sum (or mean) of ``value`` over the ``size`` replicas of ``group``: a tensor stays a tensor on its own
    device, a number stays a number. Integers sum to integers (an int tensor keeps its dtype; a Python or NumPy int
    comes back an int, so a summed count prints ``59/512`` as the one-process script did, not ``59.0/512``) and
    average to float64 (a float). Floats are sent as float64: counts kept in floats stay exact, and gloo cannot
    average integers."""
    if isinstance(value, torch.Tensor):
        floating = value.is_floating_point()
        out_dtype = value.dtype if floating or not mean else torch.float64
        t = value.detach().to(device, torch.float64 if floating or mean else value.dtype, copy=True)
    else:
        integral = isinstance(value, Integral) and not mean
        t = torch.tensor(
            int(value) if integral else float(value), dtype=torch.int64 if integral else torch.float64, device=device
        )
    if size > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    if mean:
        t = t / size
    if isinstance(value, torch.Tensor):
        return t.to(value.device, out_dtype)
    return t.item()  # an int from int64


def least(value: float, device: torch.device) -> float:
    """The smallest ``value`` any rank has (collective over the default group)."""
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return t.item()


def gather_object(value: Any, group: dist.ProcessGroup | None = None) -> list[Any]:
    """``value`` of every rank of ``group`` (default: all), in rank order (``[value]`` without a process group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out
