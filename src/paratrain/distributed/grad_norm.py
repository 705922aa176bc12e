"""The global gradient norm over every shard, stage and tensor-parallel slice, and clipping by it."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from ..tensor_layouts import grouped, mesh_of
from .tensor_parallel.quiet import quiet_sequential_collectives


def clip_grads_with_norm(parameters: Iterable[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Clip the gradients, sharded (DTensor) ones included, by their global ``norm`` (:func:`global_grad_norm`, the
    norm before clipping) to ``max_norm``; nothing waits for the device: the scale stays a tensor."""
    params = [p for p in parameters if p.grad is not None]
    for part in grouped(params, lambda p: mesh_of(p.grad)):  # one kind of tensor a multi-tensor op (tensor_layouts.py)
        torch.nn.utils.clip_grads_with_norm_(part, max_norm, norm)


def global_grad_norm(parameters: Iterable[nn.Parameter], group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The 2-norm of every gradient of the model (collective for sharded gradients and with ``group``), a 0-d
    tensor on the gradients' device: reading it (``float(norm)``, a format) waits for the device, so the step does
    not unless its caller asks.

    ``parameters``: those whose gradients this rank adds to the norm (not a tied weight that another stage counts).
    ``group``: ranks whose local norms make up the global one (the stages of a pipeline).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    with quiet_sequential_collectives():  # a norm over (dp, tp) shards reduces one dimension after the other
        norm = _norm(grads)
    if group is not None:
        squared = norm.detach().pow(2)
        dist.all_reduce(squared, group=group)
        norm = squared.sqrt()
    return norm


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of ``grads``, taken per mesh (:mod:`paratrain.tensor_layouts`) and combined."""
    norms = []
    for part in grouped(grads, mesh_of):
        norm = torch.nn.utils.get_total_norm(part)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)  # DTensor: every shard together
    if len(norms) == 1:
        return norms[0]
    return torch.stack(norms).norm() if norms else torch.zeros(())
