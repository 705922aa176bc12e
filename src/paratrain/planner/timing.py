"""Step time: compute, the optimizer step, and each collective's bytes over its link.

A micro-batch's forward and backward take its FLOPs at the sustained rate plus the weights it streams through
memory (``device.weight_passes`` passes, whatever the batch: what makes small micro-batches slow); the
optimizer step streams ``Training.optimizer_step_bytes`` per parameter of the rank's shard. Each collective
takes its ring-algorithm time over its link (``collectives``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from . import context_parallel
from .collectives import all_gather_s, all_reduce_s, broadcast_s, p2p_s, reduce_scatter_s
from .expert_parallel import ep_comm_s, moe_flops, sync_groups, tp_share_comm_s
from .expert_parallel import link_of as ep_link
from .hardware import Cluster, Link
from .layout import Layout, stage_flops
from .memory import activation_figures, activation_mode, optimizer_params, ranked_params, ranked_split, sharded
from .model_stats import ModelStats
from .tensor_parallel import collectives_per_micro_batch, tp_comm_s
from .training import Batching, Training

BACKWARD_SHARE = 2 / 3
"""Backward is about two thirds of a step's FLOPs (twice the forward's), the window gradient sync can hide in."""
DDP_BUCKET_PASSES = 6
"""Memory passes over the gradients DDP makes per synchronised step (``gradient_as_bucket_view=False``, its
default): copy into the bucket, divide by the world size, copy back out, each a read and a write."""


def pipeline_fill(stages: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """A rank's micro-batch times of filling and draining a pipeline of p ranks: p−1 for GPipe and 1F1B (Huang et
    al. 2019; Narayanan et al. 2021), (p−1)/v for interleaved 1F1B with v stages per rank (Narayanan et al. 2021,
    section 2.2.2). The zero-bubble schedules fill part of it with weight gradients, taking a forward, an input
    gradient and a weight gradient to cost alike (a matrix product's three products; Qi et al. 2023):
    ``interleaved-zb`` (ZB-H1, looped) idles (p−1)(F + B − W) of the 3 units of a micro-batch, a third of
    interleaved 1F1B's; ``zbv`` (ZB-V) (p−1)(F + B − 2W) per half-stage chunk, none; ``dualpipev``
    (p−1)(F&B + B_full − 3W) per chunk (DeepSeek-AI 2024, table 2; without overlap F&B = F + B_full), 2 of a
    micro-batch's 6 chunk units: (p−1)/3, a third of 1F1B's."""
    return (stages - 1) / virtual_stages * ZERO_BUBBLE_FILL.get(schedule, 1.0)


ZERO_BUBBLE_FILL = {"interleaved-zb": 1 / 3, "zbv": 0.0, "dualpipev": 2 / 3}
"""The share of its looped twin's fill, (p−1)/v, a zero-bubble schedule leaves idle (:func:`pipeline_fill`;
``dualpipev`` holds v = 2 stages per rank)."""


def bubble_fraction(stages: int, micro_batches: int, virtual_stages: int = 1, schedule: str = "1f1b") -> float:
    """Idle share of a pipeline step: :func:`pipeline_fill` over m plus it."""
    fill = pipeline_fill(stages, virtual_stages, schedule)
    return fill / (micro_batches + fill) if fill else 0.0


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
    """Of ``comm_s`` (never hidden): context parallelism's exchanges around attention (all-to-alls, or all-gathers
    of the keys and values past the heads)."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.optimizer_s + self.exposed_comm_s

    def as_dict(self) -> dict[str, float]:
        return {
            "compute_s": self.compute_s,
            "bubble_s": self.bubble_s,
            "optimizer_s": self.optimizer_s,
            "comm_s": self.comm_s,
            "exposed_comm_s": self.exposed_comm_s,
            "tp_comm_s": self.tp_comm_s,
            "ep_comm_s": self.ep_comm_s,
            "cp_comm_s": self.cp_comm_s,
            "step_s": self.step_s,
        }


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


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """One step of a layout as every cost term reads it: the model, the layout, its batching, the training setup and
    the cluster, and the figures several terms share."""

    stats: ModelStats
    layout: Layout
    batch: Batching
    training: Training
    cluster: Cluster

    @cached_property
    def ranks_per_node(self) -> int:
        """Ranks sharing a node's host (1 for a single rank, which has the host to itself)."""
        return self.cluster.ranks_per_node if self.layout.world_size > 1 else 1

    @cached_property
    def bandwidth(self) -> float:
        """Bytes per second one rank streams through memory."""
        return self.cluster.stream_bytes_per_s(self.ranks_per_node)

    @cached_property
    def psi(self) -> float:
        """Parameters one rank holds (``memory.ranked_params``)."""
        return ranked_params(self.stats, self.layout)

    @property
    def micro_batches(self) -> int:
        return self.batch.micro_batches

    @property
    def ddp(self) -> bool:
        """Gradients all-reduced once per step (ddp, zero1; ``ps`` workers sync through ``param_server``)."""
        return self.layout.zero <= 1 and self.layout.grad_ranks > 1 and not self.layout.servers

    @property
    def inner(self) -> int:
        """How many ranks apart data-parallel peers are: a pipeline's stages and a tp group."""
        return self.layout.stages * self.layout.tp

    @property
    def virtual_stages(self) -> int:
        """Pipeline stages per rank (interleaved schedules, a V), 1 without a pipeline."""
        return self.training.stages_per_rank if self.layout.pp > 1 else 1

    @property
    def fill(self) -> float:
        """Slots of the pipeline's fill and drain, (p − 1)/v, less what a zero-bubble schedule fills
        (:func:`pipeline_fill`)."""
        return pipeline_fill(self.layout.pp, self.virtual_stages, self.training.schedule)

    @property
    def slots(self) -> float:
        """Slots a pipeline stage computes in, m + (p − 1)/v (m without a pipeline)."""
        return self.micro_batches + self.fill

    @property
    def mode(self) -> str:
        """How the layout trains (``memory.activation_mode``)."""
        return activation_mode(self.training, self.layout)


@dataclass(frozen=True, kw_only=True)
class Comm:
    """One communication term of a step: seconds a call takes, the compute it may hide in, and calls per step."""

    seconds: float = 0.0
    window: float = 0.0
    """Seconds of compute a call overlaps: only what exceeds it is waited for."""
    times: float = 1
    """Calls per step."""

    @property
    def total_s(self) -> float:
        return self.times * self.seconds

    @property
    def exposed_s(self) -> float:
        return self.times * max(0.0, self.seconds - self.window)


def rank_flops_per_sample(s: StepInputs) -> float:
    """FLOPs the busiest rank executes per sample of a micro-batch (before cp's split).

    The FLOPs are those the step executes (``executed_flops_per_sample``); a pipeline stage's share is its units'
    FLOPs when the model was traced, else 1/p. Tensor-parallel ranks compute 1/tp of them, except a mixture of
    experts' MoE blocks, which tp does not split: every rank of a tp group computes them whole for all its tokens,
    or beside ep the routed experts of its 1/tp share of them (``expert_parallel.moe_flops``)."""
    stats, layout, training = s.stats, s.layout, s.training
    traced = layout.pp > 1 and stats.unit_flops
    per_sample = executed_flops_per_sample(stats, training)
    stage_flops_per_sample = (
        stage_flops(stats.units, stats.unit_flops, layout.pp) * per_sample / stats.flops_per_sample
        if traced
        else per_sample / layout.pp
    )
    moe = moe_flops(stats)
    whole = min(moe * training.flops_factor / layout.pp, stage_flops_per_sample)
    kept = whole * moe_flops(stats, layout.tp if layout.ep > 1 else 1) / moe if moe else 0.0
    return (stage_flops_per_sample - whole) / layout.tp + kept


def machinery_s(s: StepInputs) -> float:
    """Host-side machinery of one micro-batch: ``Device.fsdp_call_s`` per FSDP unit and call (zero2, zero3) and
    ``Device.tp_call_s`` per activation collective of the stage's share of the blocks' DTensor operations, slowed
    down as one-threaded work is when ranks share a host (``Device.serial_slowdown``)."""
    layout, device = s.layout, s.cluster.device
    seconds = unit_count(s.stats) * fsdp_calls(layout.zero) * device.fsdp_call_s if layout.zero >= 2 else 0.0
    if layout.tp > 1:
        seconds += collectives_per_micro_batch(s.stats, s.training.checkpointing) * device.tp_call_s / layout.pp
    return seconds * device.serial_slowdown(s.ranks_per_node)


def micro_batch_s(s: StepInputs) -> float:
    """One micro-batch's forward and backward on the busiest rank.

    Its FLOPs (``rank_flops_per_sample``; context-parallel ranks compute 1/cp of them but stream every weight) at the
    sustained rate, plus what it streams through memory: the weights (a model-parallel process all of its stages':
    its GPUs take turns), zero2's and zero3's copies of each gathered unit out of (each gradient into) the
    collective's flat buffer, and the elementwise work's activations; plus ``machinery_s``. On a shared CPU host
    every rank gets 1/ranks of the host's compute and memory bandwidth."""
    layout, training, cluster = s.layout, s.training, s.cluster
    rate = cluster.flops_per_s(training.precision, s.ranks_per_node)
    streamed = s.stats.params if layout.mp > 1 else s.psi
    copies = fsdp_copy_bytes(s.psi, layout.zero, training) if layout.zero >= 2 else 0.0
    return (
        rank_flops_per_sample(s) * s.batch.micro_batch / layout.cp / rate
        + (
            weight_bytes(streamed, training, cluster)
            + copies
            + activation_stream_bytes(s.stats, layout, training, cluster) * s.batch.micro_batch
        )
        / s.bandwidth
        + machinery_s(s)
    )


def optimizer_step_s(s: StepInputs) -> float:
    """The optimizer step over the parameters (or the shard) the busiest rank updates."""
    return optimizer_step_bytes(optimizer_params(s.stats, s.layout), s.training) / s.bandwidth


def ddp_bucket_s(s: StepInputs) -> float:
    """DDP's buckets: ``DDP_BUCKET_PASSES`` passes over the gradients (copy in, divide by the world size, copy out)."""
    return DDP_BUCKET_PASSES * s.psi * s.training.bytes.grad / s.bandwidth if s.ddp else 0.0


def _sync_groups(s: StepInputs, ranks: int) -> list[tuple[float, int, Link]]:
    """(parameters, ranks, link) of each group a rank syncs over: all its parameters over ``ranks`` data-parallel
    ranks, or under ep the experts over the ranks holding the same ones (``expert_parallel.sync_groups``), each over
    the link of its ranks' spacing."""
    dense, experts = ranked_split(s.stats, s.layout)
    return [
        (n, size, s.cluster.link_for(size, s.inner * apart))
        for n, size, apart in sync_groups(dense, experts, ranks, s.layout)
    ]


def _hidden_in_backward(s: StepInputs, micro_s: float) -> float:
    """Seconds of a micro-batch's backward a gradient sync can hide in: up to ``device.overlap`` of it."""
    return s.cluster.device.overlap * BACKWARD_SHARE * micro_s


def dp_all_reduce(s: StepInputs, micro_s: float) -> Comm:
    """ddp's and zero1's gradient all-reduce, once per step, hidden in up to ``device.overlap`` of a micro-batch's
    backward; context-parallel ranks reduce with the data-parallel ones (dp x cp)."""
    if not s.ddp:
        return Comm()
    groups = _sync_groups(s, s.layout.grad_ranks)
    return Comm(
        seconds=sum(all_reduce_s(n * s.training.bytes.grad, ranks, link) for n, ranks, link in groups),
        window=_hidden_in_backward(s, micro_s),
    )


def zero1_broadcast(s: StepInputs) -> Comm:
    """zero1 steps the optimizer on its shard, then every rank broadcasts its updated shard (not hidden)."""
    if not (s.ddp and s.layout.zero == 1):
        return Comm()
    groups = _sync_groups(s, s.layout.grad_ranks)
    return Comm(seconds=sum(broadcast_s(n * s.training.bytes.param, ranks, link) for n, ranks, link in groups))


def fsdp_gather_scatter(s: StepInputs, micro_s: float) -> Comm:
    """zero2's and zero3's parameter all-gathers (zero3 two: forward and backward) and gradient reduce-scatters over
    the shard group (dp x cp), one call per wrap unit (each after the first costs ``Link.call_s``), prefetched into up
    to ``device.overlap`` of the micro-batch's compute: every micro-batch, or under a pipeline once per step (the
    stage stays gathered and syncs after its last micro-batch, ``memory.fsdp_under_pipeline``)."""
    layout, training = s.layout, s.training
    if layout.zero < 2:
        return Comm()
    groups = _sync_groups(s, layout.shard_ranks)
    calls = (unit_count(s.stats) - 1) * fsdp_calls(layout.zero) * groups[0][2].call_s(layout.shard_ranks)
    once = layout.pp > 1
    gathers = 1 if once else 2 if layout.zero == 3 else 1
    return Comm(
        seconds=sum(
            gathers * all_gather_s(n * training.bytes.param, ranks, link)
            + reduce_scatter_s(n * training.bytes.grad, ranks, link)
            for n, ranks, link in groups
        )
        + calls,
        window=s.cluster.device.overlap * micro_s,
        times=1 if once else s.micro_batches,
    )


def hsdp_all_reduce(s: StepInputs, micro_s: float) -> Comm:
    """zero2 and zero3 all-reduce the gradient shard across their replicas (hsdp: across nodes), hidden in backward as
    ddp's; nothing with one replica."""
    layout = s.layout
    if layout.zero < 2:
        return Comm()
    link = s.cluster.link_for(layout.replicas, s.inner * layout.shard_ranks)
    return Comm(
        seconds=all_reduce_s(sharded(s.stats, layout, 2) * s.training.bytes.grad, layout.replicas, link),
        window=_hidden_in_backward(s, micro_s),
    )


def _boundary_bytes(s: StepInputs) -> float:
    """Bytes of a micro-batch's activations at a stage boundary a rank sends; without sequence parallelism each tp
    rank sends 1/tp of them (Narayanan et al. 2021, scatter/gather)."""
    boundary = activation_figures(s.stats, s.training, s.layout)[2] * s.batch.micro_batch
    return boundary if s.training.sequence_parallel else boundary / s.layout.tp


def pipeline_p2p(s: StepInputs) -> Comm:
    """Stage-to-stage sends, not hidden: each of a rank's v stages receives and sends every micro-batch, forward and
    backward (v·m + p − 1 slots), over the link of p stages a tp group apart."""
    layout = s.layout
    if layout.pp == 1:
        return Comm()
    link = s.cluster.link_for(layout.pp, layout.mp * layout.tp)
    return Comm(seconds=2 * p2p_s(_boundary_bytes(s), link), times=s.virtual_stages * s.micro_batches + layout.pp - 1)


def model_parallel_p2p(s: StepInputs) -> Comm:
    """A model-parallel process's sends between its k GPUs: 2(k − 1) per micro-batch within the node, not hidden."""
    mp = s.layout.mp
    if mp == 1:
        return Comm()
    return Comm(seconds=2 * (mp - 1) * p2p_s(_boundary_bytes(s), s.cluster.intra), times=s.micro_batches)


def tp_comm(s: StepInputs) -> Comm:
    """Tensor parallelism's activation collectives (``tensor_parallel.tp_comm_s``), not hidden, over the link of tp
    consecutive ranks: a pipeline stage runs its 1/p share of them in every slot, as it sends its activations."""
    layout, training = s.layout, s.training
    seconds = (
        tp_comm_s(
            s.stats, s.mode, s.batch.micro_batch, layout.tp, s.cluster.link_for(layout.tp, 1), training.checkpointing
        )
        / layout.pp
    )
    return Comm(seconds=seconds, times=s.slots)


def ep_comm(s: StepInputs) -> Comm:
    """Expert parallelism's all-to-alls (``expert_parallel.ep_comm_s``), not hidden, over the link of ep
    data-parallel neighbours: a pipeline stage those of its blocks in every slot; beside tp, the tp share's gathers
    and gradient sums over the tp link (``expert_parallel.tp_share_comm_s``)."""
    layout = s.layout
    tp_link = s.cluster.link_for(layout.tp, 1)
    share = tp_share_comm_s(
        s.stats, s.mode, s.batch.micro_batch, layout.tp, layout.ep, tp_link, s.training.checkpointing, layout.pp
    )
    seconds = share + ep_comm_s(
        s.stats,
        s.mode,
        s.batch.micro_batch,
        layout.ep,
        ep_link(s.cluster, layout),
        s.training.checkpointing,
        layout.pp,
        layout.tp,
    )
    return Comm(seconds=seconds, times=s.slots)


def cp_comm(s: StepInputs) -> Comm:
    """Context parallelism's exchanges around attention (``context_parallel.cp_comm_s``), not hidden, over the link
    of cp ranks a tp group apart, every micro-batch."""
    layout = s.layout
    seconds = context_parallel.cp_comm_s(
        s.stats,
        s.mode,
        s.batch.micro_batch,
        layout.tp,
        layout.cp,
        context_parallel.link_of(s.cluster, layout.tp, layout.cp),
        s.training.checkpointing,
    )
    return Comm(seconds=seconds, times=s.micro_batches)


def comm_terms(s: StepInputs, micro_s: float) -> dict[str, Comm]:
    """Every communication term of a step, by name, in the order ``step_time`` adds them."""
    return {
        "dp_all_reduce": dp_all_reduce(s, micro_s),
        "zero1_broadcast": zero1_broadcast(s),
        "fsdp_gather_scatter": fsdp_gather_scatter(s, micro_s),
        "hsdp_all_reduce": hsdp_all_reduce(s, micro_s),
        "pipeline_p2p": pipeline_p2p(s),
        "model_parallel_p2p": model_parallel_p2p(s),
        "tp": tp_comm(s),
        "ep": ep_comm(s),
        "cp": cp_comm(s),
    }


def step_time(stats: ModelStats, layout: Layout, batch: Batching, training: Training, cluster: Cluster) -> StepTime:
    """Step time of ``layout`` on its busiest rank: the compute of every micro-batch (``micro_batch_s``) and DDP's
    buckets, the pipeline's bubble (m + (p − 1)/v slots of a micro-batch, the fill and drain idle), the optimizer step,
    and the communication compute cannot hide (``comm_terms``, one function per collective). Parameter servers'
    workers communicate through the servers, not with each other: here they compute, and ``param_server.serving``
    adds the rest."""
    s = StepInputs(stats=stats, layout=layout, batch=batch, training=training, cluster=cluster)
    micro_s = micro_batch_s(s)
    comms = comm_terms(s, micro_s)
    total = exposed = 0.0
    for comm in comms.values():
        total += comm.total_s
        exposed += comm.exposed_s
    return StepTime(
        compute_s=s.micro_batches * micro_s + ddp_bucket_s(s),
        bubble_s=s.fill * micro_s,
        optimizer_s=optimizer_step_s(s),
        comm_s=total,
        exposed_comm_s=exposed,
        tp_comm_s=comms["tp"].total_s,
        ep_comm_s=comms["ep"].total_s,
        cp_comm_s=comms["cp"].total_s,
    )
