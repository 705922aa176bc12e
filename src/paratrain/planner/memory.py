"""Memory per rank: model states (ZeRO's accounting), activations, transients, communication buffers, overhead.

For mixed-precision Adam with Ψ parameters on N data-parallel ranks the model states come to the ZeRO
paper's figures (Rajbhandari et al. 2020, figure 1): 16Ψ (ddp), 4Ψ + 12Ψ/N (zero1), 2Ψ + 14Ψ/N (zero2) and
16Ψ/N (zero3) bytes. Tensor parallelism divides what its plan splits by its degree
(``tensor_parallel``). ZeRO-1 runs on ``ZeroRedundancyOptimizer``, which gives each rank whole parameters: where
the model's tensor sizes are known, its optimizer states are the busiest rank's (``zero1_busiest``), not 12Ψ/N
(``model_states(..., paper=True)`` keeps the paper's figure). FSDP cuts each tensor on its first dimension, which for a
mixture of experts' fused expert tensors is the experts: on more ranks than experts a rank keeps a whole expert's
share (``expert_parallel.expert_fraction``). Expert parallelism divides the routed experts by its degree; under ZeRO
they are sharded over the shard group's ranks holding the same experts, so ZeRO's bytes per rank stay about Ψ/N and
what ep saves is the experts FSDP gathers, the all-to-all buffers aside. Context parallelism's ranks join the shard
group (ZeRO shards over dp x cp) and hold 1/cp of every activation (``context_parallel``).
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, fields
from functools import lru_cache

from . import context_parallel
from .expert_parallel import dispatch_bytes, expert_fraction, held_experts, held_units
from .hardware import Cluster
from .layout import Layout, fullest_stage
from .model_stats import ModelStats
from .tensor_parallel import rank_activations, rank_params
from .training import Batching, Training


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one device holds at its peak, by what holds them.

    The peak comes at one of two moments: when ``backward`` starts (every activation saved, the loss's gradient
    just made) or during the ``optimizer step`` (every gradient, and the step's temporaries); the breakdown is
    the larger one's.
    """

    parameters: float
    gradients: float
    """Gradients alive at the peak: all of them during the optimizer step; when backward starts, only those of
    earlier micro-batches (accumulation) or DDP's gradient buckets."""
    optimizer_states: float
    """Optimizer states plus, under mixed precision, the fp32 master copy of the parameters."""
    activations: float
    """What autograd saved for backward (under autocast including its 16-bit copies of the weights)."""
    transient: float
    """Short-lived tensors at the peak: when backward starts, two gradients of the largest tensor it meets (the
    loss's: the logits' gradient and log-softmax's input gradient, fp32; or the largest saved activation's);
    during the optimizer step, its temporaries."""
    buffers: float
    """Communication buffers: DDP buckets, FSDP's gathered units, activations passed between stages."""
    overhead: float
    """CUDA context, library workspaces, allocator slack (or a CPU process's own footprint)."""
    phase: str = "backward"
    """``backward`` or ``optimizer step``: when the peak comes."""

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.transient + self.buffers + self.overhead

    @property
    def allocated(self) -> float:
        """What tensors hold at the peak, overhead excluded: ``torch.cuda.max_memory_allocated``'s measure."""
        return self.total - self.overhead

    def as_dict(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) for f in fields(self) if f.name != "phase"}, "total": self.total}


@dataclass(frozen=True, kw_only=True)
class ModelStates:
    """Bytes of the model states one device keeps across steps (ZeRO's accounting)."""

    parameters: float
    gradients: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states


def ranked_split(stats: ModelStats, layout: Layout) -> tuple[float, float]:
    """Parameters one device holds, as (the dense ones, the routed experts): all of them, or the fullest stage's
    when the layers are cut; of a tensor-parallel rank, its share of each split layer; of an expert-parallel rank,
    1/ep of the experts."""
    experts = held_experts(stats, layout.ep)
    if layout.stages == 1:
        away = stats.moe.expert_params - sum(experts) if stats.moe is not None else 0
        return float(rank_params(stats, layout.tp) - away - sum(experts)), float(sum(experts))
    units = held_units(stats, layout.tp, layout.ep)
    between = layout.pp > 1 and stats.cut_between_blocks  # a pipeline cuts between blocks; model_parallel layers
    copy = math.ceil(stats.pipeline_copy / layout.tp) if between else 0
    first, end, held = fullest_stage(units, layout.stages, between_blocks=between, copy=copy)
    return float(held - sum(experts[first:end])), float(sum(experts[first:end]))


def ranked_params(stats: ModelStats, layout: Layout) -> float:
    """Parameters one device holds (``ranked_split``, both parts)."""
    return sum(ranked_split(stats, layout))


@lru_cache(maxsize=256)
def zero1_busiest(tensors: tuple[int, ...], ranks: int) -> int:
    """Parameters whose optimizer states the busiest rank keeps under ``ZeroRedundancyOptimizer``'s partition
    (torch's ``_partition_parameters``, one parameter group): tensors largest first, each whole to the rank with the
    fewest so far. At least the largest tensor (an embedding of 50257 x 1024 on one rank, where Ψ/N may be 1/20 of
    it) and at most Ψ/N plus one tensor."""
    loads = [(0, r) for r in range(ranks)]
    for size in sorted(tensors, reverse=True):
        load, rank = heapq.heappop(loads)
        heapq.heappush(loads, (load + size, rank))
    return max(load for load, _ in loads)


def sharded(stats: ModelStats, layout: Layout, stage: int) -> float:
    """Parameters one device keeps of what ZeRO shards from ``stage`` on (3 parameters, 2 gradients, 1 optimizer
    states): all it holds below that stage; from it, 1/shard of the dense ones and its share of its experts
    (``expert_parallel.expert_fraction``: 1/(shard/ep); without ep in whole experts, as FSDP cuts them)."""
    dense, experts = ranked_split(stats, layout)
    if layout.zero < stage:
        return dense + experts
    return dense / layout.shard_ranks + experts * expert_fraction(stats, layout)


def optimizer_params(stats: ModelStats, layout: Layout, *, paper: bool = False) -> float:
    """Parameters whose optimizer states one device keeps: all it holds, its shard of them from ZeRO-1 on
    (``sharded``), and for ZeRO-1 over whole tensors (no stages, no tp or ep, sizes known) the busiest rank's
    (``zero1_busiest``) unless ``paper`` asks for the ZeRO paper's even split."""
    if layout.zero == 1 and not paper and stats.tensors and layout.stages == 1 and layout.tp == 1 and layout.ep == 1:
        return float(zero1_busiest(stats.tensors, layout.shard_ranks))
    return sharded(stats, layout, 1)


def model_states(stats: ModelStats, layout: Layout, training: Training, *, paper: bool = False) -> ModelStates:
    """Parameters, gradients and optimizer states of one device: sharded over the shard group from ZeRO stage
    3, 2 and 1 on (``sharded``; an ep rank's experts over the shard/ep ranks holding the same ones); a stage holds
    its layers'. ZeRO-1's optimizer states: see ``optimizer_params``."""
    b = training.bytes
    return ModelStates(
        parameters=sharded(stats, layout, 3) * b.param,
        gradients=sharded(stats, layout, 2) * b.grad,
        optimizer_states=optimizer_params(stats, layout, paper=paper) * training.optimizer_bytes,
    )


def in_flight(layout: Layout, batch: Batching, training: Training) -> float:
    """Micro-batches whose activations a rank holds at once, in whole-stage units: GPipe all m, 1F1B at most p
    (the first stage), interleaved 1F1B with v stages per rank p·(1 + (p−1)/(p·v)) = p + (p−1)/v (Korthikanti et
    al. 2022, section 4.2.3: its warm-up runs (p−1)/v more micro-batches' worth of chunks), never more than m. The
    zero-bubble schedules hold what their twins hold (Qi et al. 2023: ZB-H1 and ZB-V within 1F1B's memory; the
    weight gradients they defer keep their inputs, which the forward kept anyway): ``interleaved-zb`` interleaved
    1F1B's, ``zbv`` p (2p half-stage chunks), ``dualpipev`` 2p + 1 chunks, p + 1/2 (DeepSeek-AI's DualPipe
    table)."""
    if layout.pp == 1:
        return 1
    m, p = batch.micro_batches, layout.pp
    if training.schedule == "gpipe":
        return m
    if training.schedule in ("interleaved-1f1b", "interleaved-zb"):
        return min(m, p + (p - 1) / training.stages_per_rank)
    if training.schedule == "dualpipev":
        return min(m, p + 0.5)
    return min(m, p)


def activation_mode(training: Training, layout: Layout) -> str:
    """How ``layout`` trains: ``fp32``, ``autocast`` or, for the FSDP strategies under mixed precision, in their
    16-bit parameters (``param_dtype``)."""
    if training.precision == "fp32":
        return "fp32"
    return "param_dtype" if layout.zero >= 2 else "autocast"


def activation_figures(stats: ModelStats, training: Training, layout: Layout) -> tuple[float, float, float]:
    """Per-sample (activations, checkpointed activations, stage boundary) bytes as ``layout`` trains
    (``activation_mode``), on one tensor- and context-parallel rank; half the fp32 figures where the model's stats do
    not say (a traced model: approximate, autocast keeps some tensors in fp32)."""
    fp32 = (stats.activation_bytes_per_sample, stats.checkpointed_bytes_per_sample, stats.boundary_bytes_per_sample)
    mode = activation_mode(training, layout)
    figures = fp32 if mode == "fp32" else stats.mixed.get(mode) or (fp32[0] / 2, fp32[1] / 2, fp32[2] / 2)
    if training.recompute_mode == "op" and mode in stats.op_checkpointed:  # what per-op selective AC keeps
        figures = (stats.op_checkpointed[mode], *figures[1:])
    figures = rank_activations(stats, figures, mode, layout.tp, training.sequence_parallel)
    return context_parallel.rank_activations(stats, figures, layout.cp, mode, layout.tp)


def fsdp_under_pipeline(psi: float, layout: Layout, training: Training) -> float:
    """Bytes a stage sharded by FSDP keeps between its micro-batches: torch's pipelining defers FSDP's resharding
    and gradient sync to the last micro-batch (``PipelineStage`` sets ``set_reshard_after_backward(False)`` and
    ``set_requires_gradient_sync(False)`` before the others), and torchtitan keeps the parameters gathered after
    forward under a pipeline, so a rank holds its stage's parameters gathered (zero3) and their gradients unsharded,
    accumulated in FSDP's fp32 reduce dtype under mixed precision."""
    grad_bytes = training.bytes.grad if training.precision == "fp32" else 4
    return (psi * training.bytes.param if layout.zero >= 3 else 0.0) + psi * grad_bytes


def memory_per_rank(
    stats: ModelStats, layout: Layout, batch: Batching, training: Training, cluster: Cluster
) -> MemoryBreakdown:
    """Peak bytes on the busiest device of ``layout``: the larger of the backward and optimizer-step peaks.

    Model states follow ``model_states``. When backward starts a device holds its parameters and optimizer
    states, the activations of its micro-batches in flight (a stage 1/stages of each; under autocast also the
    16-bit weight copies), two gradients of the largest tensor backward meets first (the loss's fp32 output, or
    the largest saved activation), its buffers, and gradients only where
    they outlive ``zero_grad(set_to_none=True)``: accumulated over several micro-batches or in DDP's buckets.
    During the optimizer step it holds every state and the step's temporaries (Adam: a parameter-sized
    denominator). Buffers: DDP's two 25 MiB buckets in flight (with ``gradient_as_bucket_view=False`` DDP keeps
    a whole second gradient-sized copy, not counted), FSDP's gathered largest unit (the one computing and the
    one prefetched) and its unsharded gradient, and a stage's outgoing and incoming activations. A
    tensor-parallel rank holds 1/tp of the split layers (so of the 16-bit weight copies, all of which are split),
    of most activations (``tensor_parallel.rank_activations``), of the vocab-sharded logits and of the MLP's
    inner activation, the largest tensor saved. A context-parallel rank holds 1/cp of the activations
    (``context_parallel.rank_activations``) and of the logits, and one layer's all-to-all buffers.
    """
    states = model_states(stats, layout, training)
    psi = ranked_params(stats, layout)
    b = training.bytes
    per_sample, checkpointed, boundary = activation_figures(stats, training, layout)
    saved = (checkpointed if training.checkpointing else per_sample) * batch.micro_batch
    activations = saved * in_flight(layout, batch, training) / layout.stages
    if training.precision != "fp32" and layout.zero < 2:
        activations += 2 * stats.matmul_params / layout.tp * psi / rank_params(stats, layout.tp)
    ddp = layout.grad_ranks > 1 and layout.zero < 2
    ddp_buckets = min(2 * training.bucket_mb * 2**20, states.gradients) if ddp else 0.0
    if layout.zero >= 2 and layout.pp > 1:  # FSDP under a pipeline: see fsdp_under_pipeline
        buffers = fsdp_under_pipeline(psi, layout, training)
    elif layout.zero >= 3:
        unit = max(n for _, n in held_units(stats, layout.tp, layout.ep))
        buffers = 2 * unit * b.param + unit * b.grad
    else:
        buffers = ddp_buckets
    buffers += 2 * boundary * batch.micro_batch if layout.stages > 1 else 0.0
    if layout.ep > 1:  # one MoE block's all-to-all send and receive buffers
        buffers += 2 * dispatch_bytes(stats, activation_mode(training, layout), batch.micro_batch, layout.tp)
    buffers += context_parallel.buffer_bytes(
        stats, activation_mode(training, layout), batch.micro_batch, layout.tp, layout.cp
    )
    kept = batch.micro_batches > 1 or ddp_buckets > 0
    overhead = cluster.device.overhead_gib * 2**30
    largest = stats.largest_activation_bytes_per_sample * (1.0 if training.precision == "fp32" else 0.5)
    at_backward = MemoryBreakdown(
        parameters=states.parameters,
        gradients=states.gradients if kept else 0.0,
        optimizer_states=states.optimizer_states,
        activations=activations,
        transient=2 * max(stats.output_bytes_per_sample, largest) * batch.micro_batch / (layout.tp * layout.cp),
        buffers=buffers,
        overhead=overhead,
    )
    at_step = MemoryBreakdown(
        parameters=states.parameters,
        gradients=states.gradients,
        optimizer_states=states.optimizer_states,
        activations=0.0,
        transient=optimizer_params(stats, layout) * training.optimizer_temp_bytes,
        buffers=ddp_buckets,
        overhead=overhead,
        phase="optimizer step",
    )
    return max(at_backward, at_step, key=lambda m: m.total)
