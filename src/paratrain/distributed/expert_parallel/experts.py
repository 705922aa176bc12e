"""The routed experts of a mixture-of-experts model, found and made to run over an expert group.

A routed-experts module is one named ``experts`` holding fused 3-D parameters whose dimension 0 is the expert (as
transformers' Mixtral, Qwen-MoE, OLMoE and GPT-OSS hold them, and :class:`paratrain.workloads.experts.Experts`).
Its block's routing code stays as it is: only the module's ``forward`` is replaced, on the instance, by one that
sends each row to the rank holding its expert (:func:`.dispatch.exchange`), computes it there with the local slice
of the experts (local expert indices), and brings the outputs back. The computation is the module's ORIGINAL
forward, except for transformers' fused experts (``gate_up_proj``/``down_proj``, marked by transformers 5's
``use_experts_implementation``), which :func:`paratrain.model.expert_compute.run_fused_experts` runs as they do,
with grouped GEMM where the device has it and without the host reads of their own loop. A layer reads its counts on
the host once per forward (the all-to-all's splits), nothing more. Two interfaces:

- transformers': ``forward(hidden_states, top_k_index, top_k_weights)``; each (token, k) slot is sent, computed with
  weight 1, and weighted and added in token order on its own rank (the expert's output times the weight, as the
  original forward computes it); an index equal to ``num_experts`` is a sentinel and skipped, as there.
- ours: ``forward(rows sorted by expert, counts)``: the rows are sent as they are.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ...errors import ConfigError
from ...model.expert_compute import count_per_expert, fused_gate, grouped_mm_fits, run_fused_experts
from ...model.experts import ExpertLayer, find_expert_layers
from .dispatch import exchange


@dataclass(frozen=True)
class ExpertsLayer:
    """One routed-experts module of a model and what expert parallelism splits of it."""

    name: str
    module: nn.Module
    experts: int
    split: tuple[str, ...]
    """Its own parameters whose dimension 0 is the expert: each rank holds a slice of them."""
    interface: str
    """``"topk"`` (transformers: hidden_states, top_k_index, top_k_weights) or ``"rows"`` (rows, counts)."""


def find_experts(model: nn.Module, degree: int, required: bool = True) -> list[ExpertsLayer]:
    """Every routed-experts module of ``model`` (:func:`paratrain.model.experts.find_expert_layers`), checked to
    split evenly over ``degree`` ranks; a model without one (when ``required``: a pipeline stage may hold none), or
    experts that do not divide, is one line."""
    layers = [_layer(found) for found in find_expert_layers(model)]
    if not layers and required:
        raise ConfigError(
            f"ep={degree} splits a mixture of experts' routed experts, but {type(model).__name__} has "
            "no module named 'experts' with 3-D [experts, out, in] parameters; drop ep for a dense model"
        )
    for layer in layers:
        if layer.experts % degree:
            raise ConfigError(
                f"ep={degree} must divide the {layer.experts} experts of {layer.name}; give an ep that "
                f"divides {layer.experts}"
            )
    return layers


def _layer(found: ExpertLayer) -> ExpertsLayer:
    name, module, experts = found.name, found.module, found.experts
    params = dict(module.named_parameters(recurse=False))
    split = tuple(n for n, p in params.items() if p.dim() >= 1 and p.shape[0] == experts)
    whole = sorted(set(params) - set(split))
    if whole:
        raise ConfigError(
            f"ep cannot split {name}: its parameters {whole} have no expert dimension (dimension 0 of "
            f"size {experts}); keep only per-expert tensors in an 'experts' module"
        )
    arguments = list(inspect.signature(module.forward).parameters)
    if "counts" in arguments:
        interface = "rows"
    elif len(arguments) >= 3:
        interface = "topk"
    else:
        raise ConfigError(
            f"ep does not know how to call {name} ({type(module).__name__}.forward{tuple(arguments)}); "
            "it takes (hidden_states, top_k_index, top_k_weights) or (rows, counts)"
        )
    return ExpertsLayer(name, module, experts, split, interface)


def dispatch_experts(layer: ExpertsLayer, group: dist.ProcessGroup, dtype: torch.dtype | None = None) -> None:
    """Replace ``layer.module``'s forward (on the instance) by one that runs over ``group``; its parameters must
    already hold this rank's slice (DTensors, whose local tensors the original forward is given, cast to ``dtype``
    when given: the compute dtype of mixed precision, where no FSDP unit casts them)."""
    module, original = layer.module, layer.module.forward
    n_local = layer.experts // dist.get_world_size(group)

    fused = layer.interface == "topk" and fused_gate(module) is not None

    def run(rows: torch.Tensor, counts: torch.Tensor, host: list[int]) -> torch.Tensor:
        with _local(module, layer.split, n_local, dtype) as held:
            if fused:  # transformers' fused experts, computed here from the counts: no host read of their own
                out = run_fused_experts(module, rows, counts, host)
            elif layer.interface == "rows":  # the device counts where grouped GEMM takes them, else the host's
                out = original(rows, counts if grouped_mm_fits(rows, *(t for t in held if t.dim() == 3)) else host)
            else:
                index = torch.arange(n_local, device=rows.device).repeat_interleave(counts, output_size=len(rows))
                out = original(rows, index[:, None], torch.ones((len(rows), 1), dtype=rows.dtype, device=rows.device))
        # Every parameter gets a gradient, zeros where no row came: one process's experts tensor always gets one (some
        # expert of the layer is hit), and an optimizer skips a parameter without one (no weight decay, no momentum).
        return out + sum(t[:0].sum() for t in held).to(out.dtype)

    route = _rows_forward if layer.interface == "rows" else _topk_forward
    signature = inspect.signature(original)

    def forward(*args: object, **kwargs: object) -> torch.Tensor:  # by position, whatever the model names them
        return route(run, layer.experts, group, *signature.bind(*args, **kwargs).arguments.values())

    module.forward = forward


def _rows_forward(
    run: Callable, experts: int, group: dist.ProcessGroup, rows: torch.Tensor, counts: torch.Tensor | list[int]
) -> torch.Tensor:
    return exchange(rows, torch.as_tensor(counts, device=rows.device), group, run)


def _topk_forward(
    run: Callable,
    experts: int,
    group: dist.ProcessGroup,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
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
    module: nn.Module, names: tuple[str, ...], n_local: int, dtype: torch.dtype | None
) -> Iterator[list[torch.Tensor]]:
    """Within it, ``module``'s split parameters are their local tensors (autograd-aware ``to_local``, and cast to
    ``dtype``: gradients flow back into the DTensors in theirs; yielded) and its ``num_experts`` counts the local
    experts."""
    params = {n: module._parameters[n] for n in names}
    had = "num_experts" in vars(module)
    count = getattr(module, "num_experts", None)
    try:
        for n, p in params.items():
            local = p.to_local() if isinstance(p, DTensor) else p  # compiled, hasattr left the DTensor in the graph
            module._parameters[n] = local.to(dtype) if dtype is not None else local  # type: ignore[assignment]
        if count is not None:
            module.num_experts = n_local
        yield [module._parameters[n] for n in names]  # type: ignore[misc]
    finally:
        module._parameters.update(params)
        if had:
            module.num_experts = count
