"""Where the experts live: each rank of an expert group holds a slice of every routed-experts parameter, as a
DTensor sharded on dimension 0 (the expert) over the ``ep`` dimension of a ``(ep_dp, ep)`` mesh of the
data-parallel ranks, and how the ranks holding the same slice (``ep_dp``) keep their gradients equal.

DTensors make the split visible to torch's state-dict and checkpoint code: ``par.full_state_dict`` gathers the whole
experts, a DCP checkpoint records each slice at its place in the whole tensor, so it loads at another ``ep`` or
without one (the same road tensor-parallel parameters take).

Gradients: a rank's expert gradient already sums what every rank of its expert group sent it, each rank's part of
the loss being the mean over its own batch; summed over ``ep_dp`` it is the sum over all ``dp`` ranks, so it is
divided by ``dp`` (not by the ``ep_dp`` ranks that reduce it) to equal one process on the global batch.
Under ZeRO the experts are ``fully_shard``-ed over ``ep_dp`` with that divide factor (torchtitan's layout); beside
DDP, which is told to ignore them, one all-reduce per step over ``ep_dp`` does it. So does it under ZeRO when
``ep_dp`` is one rank (ep = the data ranks): there FSDP2's unit would shard nothing, only copy the whole slice into
its buffers and back around every forward and backward (1.12x the hand-written step at world 2 with it, 1.01x
without: benchmarks/RESULTS.md §28), so the sharding leaves the experts alone and the division is all that remains.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .experts import ExpertsLayer


def expert_mesh(dp_mesh: DeviceMesh, degree: int) -> DeviceMesh:
    """The data-parallel ranks of the 1-D ``dp_mesh`` as a ``(ep_dp, ep)`` mesh: consecutive ranks form an expert
    group (neighbours: on a node, NVLink peers), the ranks holding the same experts are ``degree`` apart.

    Unflattened from ``dp_mesh``'s place in its whole mesh, so that where ``dp_mesh`` is one slice of it (hybrid's
    ``dp`` ranks of one pipeline stage) every rank creates the same process groups, as creating one requires."""
    return dp_mesh._unflatten(0, (dp_mesh.size() // degree, degree), ("ep_dp", "ep"))


def split_experts(layers: list[ExpertsLayer], mesh: DeviceMesh, replicate: bool) -> None:
    """Replace each layer's split parameters by this rank's slice, a DTensor ``Shard(0)`` over ``mesh["ep"]``
    (``replicate``: over the whole mesh, replicated across ``ep_dp``, as DDP keeps it)."""
    ep = mesh["ep"]
    rank, size = ep.get_local_rank(), ep.size()
    target, placements = (mesh, [Replicate(), Shard(0)]) if replicate else (ep, [Shard(0)])
    for layer in layers:
        for name in layer.split:
            param = layer.module._parameters[name]
            assert param is not None
            local = param.detach().chunk(size)[rank].clone()
            sliced = DTensor.from_local(local, target, placements, run_check=False)
            layer.module._parameters[name] = nn.Parameter(sliced, requires_grad=param.requires_grad)


def shard_experts(layers: list[ExpertsLayer], mesh: DeviceMesh, dp: int, **fully_shard_kwargs: object) -> None:
    """``fully_shard`` each layer's experts over ``mesh["ep_dp"]``, gradients divided by ``dp`` (see the module
    docstring); before the blocks around them are sharded, which then leave them alone.

    FSDP2 cuts a tensor on dimension 0 unless told otherwise: here the experts, of which a rank holds ``n_local``.
    Where the ``ep_dp`` ranks do not divide them (Mixtral's 8 experts at ep=8 over 32 ranks: one expert over 4),
    some ranks would keep whole experts and the others padding, so those tensors are cut on dimension 1 (each
    expert's rows), as torchtitan does, and every rank keeps 1/ep_dp of its slice."""
    from torch.distributed.fsdp import fully_shard

    ranks = mesh["ep_dp"].size()

    def placement(param: nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param
        return Shard(1) if local.shape[0] % ranks and local.dim() > 1 else None  # None: FSDP2's own, Shard(0)

    for layer in layers:
        fully_shard(
            layer.module,
            mesh=mesh["ep_dp"],
            shard_placement_fn=placement,  # type: ignore[arg-type]
            **fully_shard_kwargs,
        )
        layer.module.set_gradient_divide_factor(float(dp))  # type: ignore[operator]
        # gloo has no PREMUL_SUM, which a divide factor uses: sum, then divide. Not over one rank, where torch 2.13
        # would divide twice (its copy for a single rank divides, and so does the post-division of a forced sum).
        if mesh["ep_dp"].size() > 1 and hasattr(layer.module, "set_force_sum_reduction_for_comms"):
            layer.module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]


def ignored_by_data_parallel(model: nn.Module, layers: list[ExpertsLayer]) -> None:
    """Tell DDP, or FSDP2 (about to wrap ``model``: :func:`paratrain.distributed.data_parallel.ignored_parameters`),
    to leave the experts' parameters to :func:`reduce_expert_grads`."""
    from torch.nn.parallel import DistributedDataParallel

    names = {id(p): n for n, p in model.named_parameters()}
    ignored = [names[id(layer.module._parameters[n])] for layer in layers for n in layer.split]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)


def reduce_expert_grads(layers: list[ExpertsLayer], mesh: DeviceMesh, dp: int) -> None:
    """Sum the experts' gradients over ``mesh["ep_dp"]`` in one all-reduce and divide them by ``dp``."""
    params = [p for layer in layers for n in layer.split if (p := layer.module._parameters[n]) is not None]
    if not params:
        return  # a pipeline stage without experts
    grads = [_local(p.grad) if p.grad is not None else torch.zeros_like(_local(p)) for p in params]
    flat = torch.cat([g.flatten() for g in grads])
    if mesh["ep_dp"].size() > 1:
        dist.all_reduce(flat, group=mesh.get_group("ep_dp"))
    flat.div_(dp)
    for p, g, part in zip(params, grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))
        if p.grad is None:
            p.grad = DTensor.from_local(g, mesh, [Replicate(), Shard(0)], run_check=False)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
