"""Memory per rank: model states (ZeRO's accounting), activations, communication buffers and overhead.

For mixed-precision Adam with Ψ parameters on N data-parallel ranks the model states come to the ZeRO
paper's figures (Rajbhandari et al. 2020, figure 1): 16Ψ (ddp), 4Ψ + 12Ψ/N (zero1), 2Ψ + 14Ψ/N (zero2) and
16Ψ/N (zero3 / fsdp) bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .hardware import Cluster
from .layout import Layout, stage_params
from .model_stats import ModelStats
from .training import Batching, Training


@dataclass(frozen=True, kw_only=True)
class MemoryBreakdown:
    """Bytes one device holds at its peak (end of the forward pass of the last in-flight micro-batch)."""

    parameters: float
    gradients: float
    optimizer_states: float
    """Optimizer states plus, under mixed precision, the fp32 master copy of the parameters."""
    activations: float
    buffers: float
    """Communication buffers: DDP buckets, FSDP's gathered unit, activations passed between stages."""
    overhead: float
    """CUDA context, library workspaces, allocator slack (or a CPU process's own footprint)."""

    @property
    def model_states(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    @property
    def total(self) -> float:
        return self.model_states + self.activations + self.buffers + self.overhead

    def as_dict(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) for f in fields(self)}, "total": self.total}


def ranked_params(stats: ModelStats, layout: Layout) -> float:
    """Parameters one device holds: all of them, or the fullest stage's when the layers are cut."""
    return stats.params if layout.stages == 1 else stage_params(stats.units, layout.stages)


def in_flight(layout: Layout, batch: Batching, training: Training) -> int:
    """Micro-batches whose activations a stage holds at once: GPipe all m, 1F1B at most p (the first stage)."""
    if layout.pp == 1:
        return 1
    return batch.micro_batches if training.schedule == "gpipe" else min(batch.micro_batches, layout.pp)


def activation_scale(stats: ModelStats, training: Training) -> float:
    """From the element size the stats were found at to the precision's (fp32 trace → 16-bit: x0.5, approximate:
    autocast keeps some tensors, e.g. norm statistics, in fp32)."""
    return training.bytes.activation / stats.activation_dtype_bytes


def memory_per_rank(stats: ModelStats, layout: Layout, batch: Batching, training: Training,
                    cluster: Cluster) -> MemoryBreakdown:
    """Peak bytes on the busiest device of ``layout``.

    Sharded states divide by the shard group; a stage holds its layers' states and activations (balanced
    stages: 1/stages of the activations of each micro-batch in flight). Buffers: DDP's two 25 MiB buckets
    in flight (with ``gradient_as_bucket_view=False`` DDP keeps a whole second gradient-sized copy, not
    counted), FSDP's gathered largest unit (the one computing and the one prefetched) and its unsharded
    gradient, and a stage's outgoing and incoming activations.
    """
    psi = ranked_params(stats, layout)
    b = training.bytes
    shard3 = layout.shard if layout.zero >= 3 else 1
    shard2 = layout.shard if layout.zero >= 2 else 1
    shard1 = layout.shard if layout.zero >= 1 else 1
    grads = psi * b.grad / shard2
    scale = activation_scale(stats, training)
    per_sample = stats.checkpointed_bytes_per_sample if training.checkpointing else stats.activation_bytes_per_sample
    activations = per_sample * scale * batch.micro_batch * in_flight(layout, batch, training) / layout.stages
    boundary = stats.boundary_bytes_per_sample * scale * batch.micro_batch
    if layout.zero >= 3:
        unit = stats.largest_unit[1]
        buffers = 2 * unit * b.param + unit * b.grad
    elif layout.dp > 1:
        buffers = min(2 * training.bucket_mb * 2**20, grads)
    else:
        buffers = 0.0
    buffers += 2 * boundary if layout.stages > 1 else 0.0
    return MemoryBreakdown(parameters=psi * b.param / shard3, gradients=grads,
                           optimizer_states=psi * training.optimizer_bytes / shard1, activations=activations,
                           buffers=buffers, overhead=cluster.device.overhead_gib * 2**30)
