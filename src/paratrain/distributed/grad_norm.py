"""The global gradient norm over every shard, stage and tensor-parallel slice, and clipping by it."""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .tensor_parallel.quiet import quiet_sequential_collectives

T = TypeVar("T")


def clip_grad_norm(parameters: Iterator[nn.Parameter], max_norm: float,
                   group: dist.ProcessGroup | None = None,
                   counted: Iterable[nn.Parameter] | None = None) -> torch.Tensor:
    """Clip the global gradient norm, sharded (DTensor) gradients included; returns the norm before clipping, a 0-d
    tensor on the gradients' device: reading it (``float(norm)``, a format) waits for the device, so the step does
    not unless its caller asks.

    ``group``: ranks whose local norms make up the global one (the stages of a pipeline). ``counted``: the
    parameters whose gradients this rank adds to the norm, when not all of ``parameters`` (a tied weight that
    another stage counts).
    """
    params = [p for p in parameters if p.grad is not None]
    norm = global_grad_norm(params if counted is None else counted, group)
    for part in _by_mesh(params, lambda p: p.grad):  # torch's foreach ops take one kind of tensor at a time
        torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)
    return norm.detach()


def global_grad_norm(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of every gradient of the model (collective for sharded gradients and with ``group``)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    with quiet_sequential_collectives():  # a norm over (dp, tp) shards reduces one dimension after the other
        norm = _norm(grads)
    if group is not None:
        squared = norm.detach().pow(2)
        dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    return norm


def _by_mesh(items: list[T], tensor: Callable[[T], torch.Tensor]) -> list[list[T]]:
    """``items`` grouped by the mesh of their ``tensor`` (None: plain tensors), groups in first-seen order: torch's
    multi-tensor ops take plain tensors or DTensors of one mesh, and expert parallelism puts the experts' gradients
    on a mesh of their own beside the rest's."""
    groups: dict[object, list[T]] = {}
    for item in items:
        groups.setdefault(getattr(tensor(item), "device_mesh", None), []).append(item)
    return list(groups.values())


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads``, taken per mesh (:func:`_by_mesh`; the order is the parameters', the same on every
    rank, as the DTensor norms are collectives) and combined."""
    norms = []
    for part in _by_mesh(grads, lambda g: g):
        norm = torch.nn.utils.get_total_norm(part)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor: every shard together
    if len(norms) == 1:
        return norms[0]
    return torch.stack(norms).norm() if norms else torch.zeros(())
