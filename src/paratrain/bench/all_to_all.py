"""What expert parallelism's all-to-all costs one step of a mixture-of-experts workload, timed on the bench's group.

The bench's rows run without ``ep=``: this is the all-to-all ``ep=`` would add to them, measured on the same ranks. In
each MoE layer the forward sends every token copy (each token once per expert it is routed to: tokens x top_k x
hidden) to its expert's rank and brings the results back (two all-to-alls), and the backward does the same with
the gradients (two more). One forward of the step's batch, with pre-hooks on the routed-experts modules
(:func:`paratrain.model.experts.dispatched_bytes`), gives each layer's bytes; torch's ``all_to_all_single`` of
that many bytes, split evenly over the ranks (routing in balance), is timed, median of a few, on every rank.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..model.experts import ExpertLayer, dispatched_bytes, find_expert_layers

PER_LAYER = 4
"""All-to-alls per MoE layer and step: dispatch and combine, in the forward and again in the backward."""


def dispatch_bytes(model: nn.Module, forward: Callable[[], Any]) -> list[int]:
    """Bytes each MoE layer of ``model`` sends its experts in one ``forward()`` (run once, without gradients)."""
    sizes: dict[int, int] = {}
    handles = []
    for i, layer in enumerate(find_expert_layers(model)):

        def hook(
            _m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], i: int = i, layer: ExpertLayer = layer
        ) -> None:
            sizes[i] = sizes.get(i, 0) + dispatched_bytes(layer.routing(args, kwargs))

        handles.append(layer.module.register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    return [sizes[i] for i in sorted(sizes)]


def time_all_to_all(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median seconds of one ``all_to_all_single`` of ``nbytes`` per rank (fp32, even splits) on the default group
    (a collective: every rank calls it with the same size)."""
    world = dist.get_world_size()
    numel = -(-max(nbytes // 4, world) // world) * world
    send = torch.ones(numel, device=device)
    receive = torch.empty_like(send)
    dist.all_to_all_single(receive, send)  # the first call sets the connections up
    times = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(receive, send)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_all_to_all(model: nn.Module, forward: Callable[[], Any], device: torch.device) -> tuple[float, int] | None:
    """(seconds, bytes per rank) the all-to-alls of one step of ``model`` would take under expert parallelism over
    every rank of the default group; None for a model without experts or a job of one rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1) or not find_expert_layers(model):
        return None
    sizes = dispatch_bytes(model, forward)
    timed = {n: time_all_to_all(n, device) for n in sorted(set(sizes))}
    return PER_LAYER * sum(timed[n] for n in sizes), PER_LAYER * sum(sizes)
