"""The routed experts of a mixture-of-experts model, found and made to run over an expert group.

A routed-experts module is found by what it is (:func:`paratrain.model.experts.find_expert_layers`: fused 3-D
parameters whose dimension 0 is the expert, a forward that takes the router's choice; any name), as transformers'
Mixtral, Qwen-MoE, OLMoE and GPT-OSS, torchtitan's ``GroupedExperts`` and :class:`paratrain.workloads.experts.Experts`
hold them. Its block's routing code stays as it is: only the module's ``forward`` is replaced, on the instance, by
one that sends each row to the rank holding its expert (:func:`.dispatch.exchange`), computes it there with the
local slice of the experts (local expert indices), and brings the outputs back. The computation is the module's
ORIGINAL forward, called in the model's own convention, except for transformers' fused experts
(``gate_up_proj``/``down_proj``, marked by transformers 5's ``use_experts_implementation``), which
:func:`paratrain.model.expert_compute.run_fused_experts` runs as they do, with grouped GEMM where the device has it
and without the host reads of their own loop. A layer reads its counts on the host once per forward (the
all-to-all's splits), nothing more. Each call's convention is read from what it carries
(:class:`paratrain.model.experts.Routing`), not from argument names:

- ``(hidden_states, index [tokens, k], weights)`` (transformers): each (token, k) slot is sent, computed with
  weight 1, and weighted and added in token order on its own rank (the expert's output times the weight, as the
  original forward computes it); an index equal to ``num_experts`` is a sentinel and skipped, as there.
- ``(rows sorted by expert, counts)``: the rows are sent as they are, and the local experts get their counts as the
  model gave them: a tensor of its dtype on its device (torchtitan's float ``histc`` counts stay floats), or a list.

Beside tensor parallelism every rank of a tp group is given the same rows (the experts are whole to tp). Each then
keeps its 1/tp of them (:mod:`.tp_share`: the rows, and with them their counts or their tokens' choices), sends
only those over its expert group, and the outputs are gathered over tp: the experts' work of a tp group is divided
among its ranks (torchtitan's token split of a tp group), and each rank's expert gradient, from its share of the
rows, is summed over tp in the backward.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ...errors import ConfigError
from ...model.expert_compute import count_per_expert, fused_gate, grouped_mm_fits, run_fused_experts
from ...model.experts import TAKES_HOST_COUNTS, ExpertLayer, Routing, find_expert_layers
from .dispatch import exchange
from .tp_share import gather_over_tp, own_share, summed_over_tp


@dataclass(frozen=True)
class ExpertsLayer:
    """One routed-experts module of a model and what expert parallelism splits of it."""

    found: ExpertLayer
    split: tuple[str, ...]
    """Its own parameters whose dimension 0 is the expert: each rank holds a slice of them."""

    @property
    def name(self) -> str:
        return self.found.name

    @property
    def module(self) -> nn.Module:
        return self.found.module

    @property
    def experts(self) -> int:
        return self.found.experts


def find_experts(model: nn.Module, degree: int, required: bool = True) -> list[ExpertsLayer]:
    """Every routed-experts module of ``model`` (:func:`paratrain.model.experts.find_expert_layers`), checked to
    split evenly over ``degree`` ranks; a model without one (when ``required``: a pipeline stage may hold none), or
    experts that do not divide, is one line."""
    layers = [_layer(found) for found in find_expert_layers(model)]
    if not layers and required:
        raise ConfigError(
            f"ep={degree} splits a mixture of experts' routed experts, but {type(model).__name__} has no module "
            "with 3-D [experts, out, in] parameters called with the router's choice; drop ep for a dense model"
        )
    for layer in layers:
        if layer.experts % degree:
            raise ConfigError(
                f"ep={degree} must divide the {layer.experts} experts of {layer.name}; give an ep that "
                f"divides {layer.experts}"
            )
    return layers


def _layer(found: ExpertLayer) -> ExpertsLayer:
    params = dict(found.module.named_parameters(recurse=False))
    split = tuple(n for n, p in params.items() if p.dim() >= 1 and p.shape[0] == found.experts)
    whole = sorted(set(params) - set(split))
    if whole:
        raise ConfigError(
            f"ep cannot split {found.name}: its parameters {whole} have no expert dimension (dimension 0 of "
            f"size {found.experts}); keep only per-expert tensors in the routed-experts module"
        )
    return ExpertsLayer(found, split)


def dispatch_experts(
    layer: ExpertsLayer, group: dist.ProcessGroup, dtype: torch.dtype | None = None, tp: DeviceMesh | None = None
) -> None:
    """Replace ``layer.module``'s forward (on the instance) by one that runs over ``group``; its parameters must
    already hold this rank's slice (DTensors, whose local tensors the original forward is given, cast to ``dtype``
    when given: the compute dtype of mixed precision, where no FSDP unit casts them). ``tp``: the rank's tp group,
    whose ranks are given the same rows and each compute their share of them (the module docstring)."""
    module, original = layer.module, layer.module.forward
    n_local = layer.experts // dist.get_world_size(group)
    fused = fused_gate(module) is not None
    host_counts = getattr(module, TAKES_HOST_COUNTS, False)

    def run(given: Routing, rows: torch.Tensor, counts: torch.Tensor, host: list[int]) -> torch.Tensor:
        with _local(module, layer.split, n_local, dtype, tp) as held:
            if given.top_k and fused:  # transformers' fused experts, computed here: no host read of their own
                out = run_fused_experts(module, rows, counts, host)
            elif given.top_k:
                index = torch.arange(n_local, device=rows.device).repeat_interleave(counts, output_size=len(rows))
                index = index.to(torch.as_tensor(given.chosen).dtype)[:, None]  # the model's own index dtype
                out = original(rows, index, torch.ones((len(rows), 1), dtype=rows.dtype, device=rows.device))
            else:
                matrices = [t for t in held if t.dim() == 3]
                on_host = isinstance(given.chosen, list) or (host_counts and not grouped_mm_fits(rows, *matrices))
                out = original(rows, host if on_host else _like(counts, given.chosen))
        # Every parameter gets a gradient, zeros where no row came: one process's experts tensor always gets one (some
        # expert of the layer is hit), and an optimizer skips a parameter without one (no weight decay, no momentum).
        return out + sum(t[:0].sum() for t in held).to(out.dtype)

    def forward(*args: object, **kwargs: object) -> torch.Tensor:  # read by position, whatever the model names them
        given = layer.found.routing(args, kwargs)
        if given is None:
            raise ConfigError(
                f"ep split {layer.name} ({type(module).__name__}: 3-D parameters of {layer.experts} experts), but "
                f"its call carries neither counts per expert (rows, a tensor or list of {layer.experts}) nor each "
                "token's experts (hidden_states, index [tokens, k], weights); call it so, or drop ep"
            )
        if tp is None:
            return _routed(given, run, layer.experts, group)
        share = own_share(given, tp)
        return gather_over_tp(_routed(share, run, layer.experts, group), given, share, tp)

    forward.__signature__ = layer.found.signature  # type: ignore[attr-defined]  # hooks read calls as the model's
    module.forward = forward


def _routed(given: Routing, run: Callable, experts: int, group: dist.ProcessGroup) -> torch.Tensor:
    """``given``'s rows through their experts over ``group``: one output row per row (per counted row)."""
    computed = functools.partial(run, given)
    if given.top_k:
        return _topk_forward(given, computed, experts, group)
    return exchange(given.rows, torch.as_tensor(given.chosen, device=given.rows.device), group, computed)


def _like(counts: torch.Tensor, given: torch.Tensor | list[int]) -> torch.Tensor:
    """The local experts' ``counts`` (int64, on the rows' device) in the dtype the model gave its own, on its
    device (a copy on the device: nothing read)."""
    assert isinstance(given, torch.Tensor)
    return counts.to(device=given.device, dtype=given.dtype)


def _topk_forward(given: Routing, run: Callable, experts: int, group: dist.ProcessGroup) -> torch.Tensor:
    hidden_states, top_k_index, top_k_weights = given.rows, given.chosen, given.weights
    assert isinstance(top_k_index, torch.Tensor) and top_k_weights is not None
    chosen = top_k_index.flatten()
    slots = chosen.argsort(stable=True)  # index == experts, the sentinel the original forward skips, sorts last
    counts = count_per_expert(chosen, experts)
    routed = exchange(hidden_states[slots // top_k_index.shape[-1]], counts, group, run)
    slots = slots[: len(routed)]  # the sentinels' slots left out
    routed = routed * top_k_weights.flatten()[slots, None].to(routed.dtype)
    tokens = slots // top_k_index.shape[-1]
    return torch.zeros_like(hidden_states).index_add(0, tokens, routed.to(hidden_states.dtype))


@contextmanager
def _local(
    module: nn.Module, names: tuple[str, ...], n_local: int, dtype: torch.dtype | None, tp: DeviceMesh | None
) -> Iterator[list[torch.Tensor]]:
    """Within it, ``module``'s split parameters are their local tensors (autograd-aware ``to_local``, and cast to
    ``dtype``: gradients flow back into the DTensors in theirs; yielded; summed over ``tp`` on their way back, each
    tp rank having computed its share of the rows) and its ``num_experts`` counts the local experts."""
    params = {n: module._parameters[n] for n in names}
    had = "num_experts" in vars(module)
    count = getattr(module, "num_experts", None)
    try:
        for n, p in params.items():
            local = p.to_local() if isinstance(p, DTensor) else p  # compiled, hasattr left the DTensor in the graph
            local = summed_over_tp(local, tp) if tp is not None else local
            module._parameters[n] = local.to(dtype) if dtype is not None else local  # type: ignore[assignment]
        if count is not None:
            module.num_experts = n_local
        yield [module._parameters[n] for n in names]  # type: ignore[misc]
    finally:
        module._parameters.update(params)
        if had:
            module.num_experts = count
