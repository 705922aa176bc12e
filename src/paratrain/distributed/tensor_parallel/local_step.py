"""An optimizer step that updates replicated DTensor parameters through their local tensors.

Every parameter of a tensor-parallel model is a DTensor (:class:`.styles.Replicated` keeps those a plan leaves whole
as ``Replicate`` DTensors), and so are their gradients and optimizer state. torch's optimizers update one parameter
at a time on CPU (their per-parameter path, the default there), and on a DTensor every op of that update goes
through DTensor's dispatcher: AdamW's 9 ops a parameter cost a hand-written model, whose norm weights are plain
tensors, nothing of the kind (benchmarks/RESULTS.md §20). A ``Replicate`` DTensor holds the whole tensor on every
rank, so its update is its local tensor's update. For the step, each such parameter is swapped in the param groups
for its local tensor, with its gradient's local tensor as ``grad`` and its state's local tensors as state (the
same storage, updated in place), and put back after it, also when the step raises. Between steps the optimizer
holds the DTensors and the DTensor state it always did: checkpoints, clipping and resharding see no difference.

Only where that is safe: torch's own optimizers on their per-parameter path (``foreach`` and ``fused`` off, or
``foreach`` left to torch on CPU, where it is off), and parameters that already have state (the first step creates
it as DTensors) whose gradient and state tensors are replicated too. A multi-tensor path (``foreach``, ``fused``)
takes all parameters in a few ops, where plain tensors among DTensors would be refused; it costs little there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor


@dataclass
class _Swap:
    params: list[torch.Tensor]
    """The param group's list, which holds ``local`` in place of ``param`` during the step."""
    index: int
    param: DTensor
    local: torch.Tensor
    before: dict[str, Any]
    """The parameter's state as it was (DTensors), to put back."""
    views: dict[str, torch.Tensor]
    """The local tensors of ``before``'s DTensors, as the step was given them."""


@contextmanager
def replicated_locally(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within it, ``optimizer.step()`` updates its replicated DTensor parameters on their local tensors (see the
    module docstring)."""
    swaps: list[_Swap] = []
    try:
        with torch.no_grad():  # to_local() without autograd: the local tensor itself (or a view of it)
            for group in optimizer.param_groups:
                if _per_parameter(optimizer, group):
                    _swap_group(optimizer, group["params"], swaps)
        yield
    finally:
        for swap in swaps:
            _restore(optimizer, swap)


def _per_parameter(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> bool:
    """Whether ``optimizer`` steps ``group`` one parameter at a time (see the module docstring)."""
    if not type(optimizer).__module__.startswith("torch.optim.") or "foreach" not in group:
        return False
    if group.get("fused") or group.get("differentiable"):
        return False
    foreach = group["foreach"]
    return foreach is False or (foreach is None and all(p.device.type == "cpu" for p in group["params"]))


def _replicated(t: object) -> bool:
    return isinstance(t, DTensor) and all(pl.is_replicate() for pl in t.placements)


def _swap_group(optimizer: torch.optim.Optimizer, params: list[torch.Tensor], swaps: list[_Swap]) -> None:
    for i, param in enumerate(params):
        state = optimizer.state.get(param)
        if (
            not state
            or not _replicated(param)
            or not _replicated(param.grad)
            or any(isinstance(v, DTensor) and not _replicated(v) for v in state.values())
        ):
            continue
        local = param.to_local()
        local.grad = param.grad.to_local()
        views = {k: v.to_local() for k, v in state.items() if isinstance(v, DTensor)}
        optimizer.state[local] = {**state, **views}
        swaps.append(_Swap(params, i, param, local, dict(state), views))
        params[i] = local


def _restore(optimizer: torch.optim.Optimizer, swap: _Swap) -> None:
    """Put the DTensor parameter back, with its state: what the step updated in place is the DTensors' own storage;
    a tensor it replaced is made a DTensor laid out like the one it replaced."""
    swap.params[swap.index] = swap.param
    swap.local.grad = None
    after = optimizer.state.pop(swap.local, {})
    state = optimizer.state[swap.param]
    state.clear()
    for key, value in after.items():
        old = swap.before.get(key)
        if value is swap.views.get(key):
            value = old
        elif isinstance(old, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = DTensor.from_local(value, old.device_mesh, old.placements, run_check=False)
        state[key] = value
