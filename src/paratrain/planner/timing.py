"""Step time: compute, the optimizer step, and each collective's bytes over its link.

A micro-batch's forward and backward take its FLOPs at the sustained rate plus the weights it streams through
memory (``device.weight_passes`` passes, whatever the batch: what makes small micro-batches slow); the
optimizer step streams ``Training.optimizer_step_bytes`` per parameter of the rank's shard. Each collective
takes its ring-algorithm time over its link (``collectives``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import context_parallel
from .collectives import all_gather_s, all_reduce_s, broadcast_s, p2p_s, reduce_scatter_s
from .hardware import Cluster
from .layout import Layout, stage_flops
from .expert_parallel import ep_comm_s, link_of as ep_link, moe_flops, sync_groups
from .memory import (activation_figures, activation_mode, optimizer_params, ranked_params, ranked_split,
                     sharded)
from .model_stats import ModelStats
from .tensor_parallel import collectives_per_micro_batch, tp_comm_s
from .training import Batching, Training

BACKWARD_SHARE = 2 / 3
"""Backward is about two thirds of a step's FLOPs (twice the forward's), the window gradient sync can hide in."""
DDP_BUCKET_PASSES = 6
"""Memory passes over the gradients DDP makes per synchronised step (``gradient_as_bucket_view=False``, its
default): copy into the bucket, divide by the world size, copy back out, each a read and a write."""


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle share of a pipeline step, (p−1)/v over m + (p−1)/v, for GPipe and 1F1B alike (v = 1: Huang et al. 2019;
    Narayanan et al. 2021) and interleaved 1F1B with v stages per rank (Narayanan et al. 2021, section 2.2.2):
    filling and draining p stages costs p−1 slots of a rank's share of a micro-batch, v times smaller chunks when
    each rank holds v stages."""
    fill = (stages - 1) / virtual_stages
    return fill / (micro_batches + fill)


def executed_flops_per_sample(stats: ModelStats, training: Training) -> float:
    """FLOPs a training step runs per sample: the model's, less the half of the attention matrices a causal kernel
    skips, plus what recomputation repeats (``full``: the forward, a third; ``selective``: the attention core's
    forward, a third of its part)."""
    executed = stats.flops_per_sample - stats.attention_flops_per_sample / 2
    if training.recompute_mode == "selective":
        return executed + stats.attention_flops_per_sample / 2 / 3
    if training.recompute_mode == "op":  # half the matrix products' forward again (the attention kernel is kept)
        return executed + (stats.flops_per_sample - stats.attention_flops_per_sample) / 6
    return executed * training.flops_factor


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank."""

    compute_s: float
    """Forward and backward of every micro-batch (FLOPs, the weights each one streams, FSDP's and DDP's buffer
    copies), bubble excluded."""
    bubble_s: float
    """Pipeline fill and drain."""
    optimizer_s: float
    """The optimizer step over the parameters (or the shard) this rank updates."""
    comm_s: float
    """All communication, hidden or not."""
    exposed_comm_s: float
    """Communication the step waits for."""
    tp_comm_s: float = 0.0
    """Of ``comm_s`` (and, never hidden, of ``exposed_comm_s``): tensor parallelism's activation collectives."""
    ep_comm_s: float = 0.0
    """Of ``comm_s`` (never hidden): expert parallelism's all-to-alls of the tokens to their experts and back."""
    cp_comm_s: float = 0.0
    """Of ``comm_s`` (never hidden): context parallelism's all-to-alls around attention."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.optimizer_s + self.exposed_comm_s

    def as_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "bubble_s": self.bubble_s, "optimizer_s": self.optimizer_s,
                "comm_s": self.comm_s, "exposed_comm_s": self.exposed_comm_s, "tp_comm_s": self.tp_comm_s,
                "ep_comm_s": self.ep_comm_s, "cp_comm_s": self.cp_comm_s, "step_s": self.step_s}


def weight_bytes(params: float, training: Training, cluster: Cluster) -> float:
    """Bytes a forward+backward streams for the weights of ``params`` parameters, whatever the batch."""
    return cluster.device.weight_passes * params * training.bytes.param


def activation_stream_bytes(stats: ModelStats, layout: Layout, training: Training, cluster: Cluster) -> float:
    """Bytes a rank's elementwise work (norms, activation functions, residual adds, casts, the loss) streams per
    sample of a micro-batch: ``device.activation_passes`` passes over the activations its stage would save without
    recomputation (a recomputed forward, full or per-op, repeats its share)."""
    passes = cluster.device.activation_passes
    if not passes:
        return 0.0
    whole = replace(training, recompute="none") if training.recompute_mode == "op" else training
    per_sample = activation_figures(stats, whole, layout)[0] / layout.stages
    return passes * per_sample * (4 / 3 if training.recompute_mode in ("full", "op") else 1.0)


def optimizer_step_bytes(params: float, training: Training) -> float:
    """Bytes one optimizer step streams for ``params`` parameters."""
    return params * training.optimizer_step_bytes


def fsdp_calls(zero: int) -> int:
    """Collective calls per wrap unit and micro-batch: zero2 gathers once and reduce-scatters, zero3 gathers twice."""
    return 3 if zero == 3 else 2


def fsdp_copy_bytes(params: float, zero: int, training: Training) -> float:
    """Bytes FSDP copies per micro-batch for ``params`` parameters: each gathered unit out of the all-gather's flat
    buffer and each gradient into the reduce-scatter's, a read and a write per collective."""
    return 2 * fsdp_calls(zero) * params * training.bytes.param


def unit_count(stats: ModelStats) -> int:
    """Wrap units that hold parameters: one FSDP group (and collective call) each."""
    return sum(1 for _, n in stats.units if n > 0)


def fsdp_call_from(overhead_s: float, stats: ModelStats, zero: int, training: Training, bandwidth: float) -> float:
    """``Device.fsdp_call_s`` from FSDP's measured overhead at world 1: a one-rank step of the ``zero`` stage minus a
    plain one (same model and batch, one micro-batch), less the copies the model counts (at ``bandwidth``, the
    measuring thread's), over the calls. Never below 0: a one-rank FSDP step may even run faster."""
    copies_s = fsdp_copy_bytes(stats.params, zero, training) / bandwidth
    return max(0.0, (overhead_s - copies_s) / (unit_count(stats) * fsdp_calls(zero)))


def step_time(stats: ModelStats, layout: Layout, batch: Batching, training: Training, cluster: Cluster) -> StepTime:
    """Step time of ``layout``: compute, the optimizer step, and the communication compute cannot hide.

    Pipeline stages compute different micro-batches at once (m + (p − 1)/v slots of the busiest stage's share of a
    micro-batch: its units' FLOPs when the model was traced, else 1/p; v stages per rank under interleaved 1F1B,
    each sending and receiving every micro-batch); the FLOPs are those the step executes
    (``executed_flops_per_sample``: causal attention computes half its matrices, recomputation adds);
    model-parallel stages take turns, so a process computes as fast as one of its GPUs and streams all of its
    stages' weights. ddp and zero1 all-reduce gradients once per step, hidden in up to ``device.overlap`` of a
    micro-batch's backward; zero1 steps the optimizer on its shard, then every rank broadcasts its updated
    shard (not hidden). zero2 and zero3 gather parameters (zero3 twice: forward and backward) and
    reduce-scatter gradients every micro-batch, one call per wrap unit (each call after the first costs
    ``Link.call_s``), prefetched into up to ``overlap`` of its
    compute, and copy each gathered unit out of (each gradient into) the collective's flat buffer: a read and a
    write per collective, and pay ``Device.fsdp_call_s`` of host-side machinery per unit and call (tensor
    parallelism ``Device.tp_call_s`` per activation collective); hsdp adds an
    all-reduce of the shard across nodes. DDP's buckets cost
    ``DDP_BUCKET_PASSES`` passes over the gradients. Stage-to-stage sends (one per forward and per backward, per slot)
    are not hidden. Tensor-parallel ranks compute 1/tp of each micro-batch's FLOPs and wait for its activation
    collectives (``tensor_parallel.tp_comm_s``, not hidden; a pipeline stage its 1/p share of them in every
    slot) over the link of tp consecutive ranks; the
    data-parallel and pipeline groups are then tp times further apart. A mixture of experts' MoE blocks are not
    split by tp: every rank of a tp group computes them whole for all its tokens (``expert_parallel.moe_flops``).
    Expert-parallel ranks hold 1/ep of the experts (fewer weights to stream and step), sync them over the ranks
    holding the same ones and wait for their
    all-to-alls (``expert_parallel.ep_comm_s``, not hidden; a pipeline stage those of its blocks in every slot) over
    the link of ep data-parallel neighbours, a pipeline's stages and a tp group apart.
    Context-parallel ranks compute 1/cp of each micro-batch's FLOPs (but stream every weight), wait for the
    all-to-alls around attention (``context_parallel.cp_comm_s``, not hidden) over the link of cp ranks a tp group
    apart, and reduce their gradients with the data-parallel ranks' (dp x cp; ZeRO's shard group is dp x cp). On a
    shared CPU host every rank gets
    1/ranks of the host's compute and memory bandwidth. Parameter servers' workers communicate through the
    servers, not with each other: here they compute, and ``param_server.serving`` adds the rest.
    """
    ranks_per_node = cluster.ranks_per_node if layout.world_size > 1 else 1
    rate = cluster.flops_per_s(training.precision, ranks_per_node)
    bandwidth = cluster.stream_bytes_per_s(ranks_per_node)
    psi = ranked_params(stats, layout)
    streamed = stats.params if layout.mp > 1 else psi
    gathers = 2 if layout.zero == 3 else 1
    copies = fsdp_copy_bytes(psi, layout.zero, training) if layout.zero >= 2 else 0.0
    units = unit_count(stats)
    machinery_s = (units * fsdp_calls(layout.zero) * cluster.device.fsdp_call_s if layout.zero >= 2 else 0.0)
    if layout.tp > 1:  # a stage runs its share of the blocks' DTensor operations
        machinery_s += collectives_per_micro_batch(stats, training.checkpointing) * cluster.device.tp_call_s / layout.pp
    machinery_s *= cluster.device.serial_slowdown(ranks_per_node)
    traced = layout.pp > 1 and stats.unit_flops
    per_sample = executed_flops_per_sample(stats, training)
    stage_flops_per_sample = (stage_flops(stats.units, stats.unit_flops, layout.pp) * per_sample
                              / stats.flops_per_sample if traced else per_sample / layout.pp)
    # a tp group's ranks each compute the MoE blocks of all its tokens whole (tensor parallelism splits the rest)
    whole = min(moe_flops(stats) * training.flops_factor / layout.pp, stage_flops_per_sample)
    rank_flops = (stage_flops_per_sample - whole) / layout.tp + whole
    micro_s = (rank_flops * batch.micro_batch / layout.cp / rate
               + (weight_bytes(streamed, training, cluster) + copies
                  + activation_stream_bytes(stats, layout, training, cluster) * batch.micro_batch) / bandwidth
               + machinery_s)
    optimizer_s = optimizer_step_bytes(optimizer_params(stats, layout), training) / bandwidth  # the busiest rank's
    ddp = layout.zero <= 1 and layout.grad_ranks > 1 and not layout.servers  # ps workers: param_server
    # DDP copies each gradient into its bucket, divides the bucket by the world size and copies it back
    bucket_s = DDP_BUCKET_PASSES * psi * training.bytes.grad / bandwidth if ddp else 0.0
    m = batch.micro_batches
    overlap = cluster.device.overlap
    boundary = activation_figures(stats, training, layout)[2] * batch.micro_batch
    if not training.sequence_parallel:  # each tp rank sends 1/tp of it (Narayanan et al. 2021, scatter/gather)
        boundary /= layout.tp
    inner = layout.stages * layout.tp  # data-parallel peers are this many ranks apart
    hidden_in_backward = overlap * BACKWARD_SHARE * micro_s

    total = exposed = 0.0

    def add(seconds: float, window: float = 0.0, times: float = 1) -> None:
        nonlocal total, exposed
        total += times * seconds
        exposed += times * max(0.0, seconds - window)

    dense, experts = ranked_split(stats, layout)
    if ddp:  # under ep the experts sync over the ranks holding the same ones (expert_parallel.sync_groups)
        groups = [(n, ranks, cluster.link_for(ranks, inner * apart))
                  for n, ranks, apart in sync_groups(dense, experts, layout.grad_ranks, layout)]
        add(sum(all_reduce_s(n * training.bytes.grad, ranks, link) for n, ranks, link in groups), hidden_in_backward)
        if layout.zero == 1:
            add(sum(broadcast_s(n * training.bytes.param, ranks, link) for n, ranks, link in groups))
    if layout.zero >= 2:
        groups = [(n, ranks, cluster.link_for(ranks, inner * apart))
                  for n, ranks, apart in sync_groups(dense, experts, layout.shard_ranks, layout)]
        shard_link = groups[0][2]
        calls = (units - 1) * fsdp_calls(layout.zero) * shard_link.call_s(layout.shard_ranks)
        # under a pipeline the stage stays gathered and syncs its gradients once, after the last micro-batch
        # (memory.fsdp_under_pipeline); otherwise every micro-batch gathers and reduce-scatters
        once = layout.pp > 1
        add(sum((1 if once else gathers) * all_gather_s(n * training.bytes.param, ranks, link)
                + reduce_scatter_s(n * training.bytes.grad, ranks, link) for n, ranks, link in groups) + calls,
            overlap * micro_s, times=1 if once else m)
        replica_link = cluster.link_for(layout.replicas, inner * layout.shard_ranks)
        add(all_reduce_s(sharded(stats, layout, 2) * training.bytes.grad, layout.replicas, replica_link),
            hidden_in_backward)
    v = training.stages_per_rank if layout.pp > 1 else 1
    if layout.pp > 1:  # each of a rank's v stages receives and sends every micro-batch, forward and backward
        add(2 * p2p_s(boundary, cluster.link_for(layout.pp, layout.mp * layout.tp)), times=v * m + layout.pp - 1)
    if layout.mp > 1:
        add(2 * (layout.mp - 1) * p2p_s(boundary, cluster.intra), times=m)
    # a stage runs its share of the blocks' collectives in every slot, as it sends its activations
    fill = (layout.pp - 1) / v
    slots = m + fill
    mode = activation_mode(training, layout)
    tp_s = tp_comm_s(stats, mode, batch.micro_batch, layout.tp, cluster.link_for(layout.tp, 1),
                     training.checkpointing) / layout.pp
    add(tp_s, times=slots)
    ep_s = ep_comm_s(stats, mode, batch.micro_batch, layout.ep, ep_link(cluster, layout), training.checkpointing,
                     layout.pp)
    add(ep_s, times=slots)
    cp_s = context_parallel.cp_comm_s(stats, mode, batch.micro_batch, layout.tp, layout.cp,
                                      context_parallel.link_of(cluster, layout.tp, layout.cp), training.checkpointing)
    add(cp_s, times=m)
    return StepTime(compute_s=m * micro_s + bucket_s, bubble_s=fill * micro_s, optimizer_s=optimizer_s,
                    comm_s=total, exposed_comm_s=exposed, tp_comm_s=slots * tp_s, ep_comm_s=slots * ep_s,
                    cp_comm_s=m * cp_s)
