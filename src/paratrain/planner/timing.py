"""Step time: compute from FLOPs and the sustained rate, communication from each collective's bytes and link.

Collectives follow the ring algorithm's alpha-beta cost for N ranks and S bytes over bandwidth B
(Patarasuk & Yuan 2009; the "bus bandwidth" of nccl-tests): all-reduce 2(N−1)/N·S/B, all-gather and
reduce-scatter (N−1)/N·S/B (S the full, unsharded size), plus the link latency once per ring step.
"""
from __future__ import annotations

from dataclasses import dataclass

from .hardware import Cluster, Link
from .layout import Layout
from .memory import activation_scale, ranked_params
from .model_stats import ModelStats
from .training import Batching, Training

BACKWARD_SHARE = 2 / 3
"""Backward is about two thirds of a step's FLOPs (twice the forward's), the window gradient sync can hide in."""


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, each N−1 steps moving S/N."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * link.latency_us * 1e-6 + 2 * (ranks - 1) / ranks * nbytes / link.bytes_per_s


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-gather of a tensor of ``nbytes`` in total (each rank starts with nbytes/N)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / link.bytes_per_s


reduce_scatter_s = all_gather_s
"""Ring reduce-scatter moves the same bytes as an all-gather, in the other direction."""


def p2p_s(nbytes: float, link: Link) -> float:
    """One send between two ranks (pipeline stages)."""
    return link.latency_us * 1e-6 + nbytes / link.p2p_bytes_per_s


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a pipeline step, (p−1)/(m+p−1), for GPipe and 1F1B alike (Huang et al. 2019;
    Narayanan et al. 2021): filling and draining p stages costs p−1 micro-batch slots out of m+p−1."""
    return (stages - 1) / (micro_batches + stages - 1)


@dataclass(frozen=True, kw_only=True)
class StepTime:
    """Seconds of one optimizer step on the busiest rank."""

    compute_s: float
    """Forward and backward of every micro-batch, pipeline bubble excluded."""
    bubble_s: float
    """Pipeline fill and drain."""
    comm_s: float
    """All communication, hidden or not."""
    exposed_comm_s: float
    """Communication the step waits for."""

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    def as_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "bubble_s": self.bubble_s, "comm_s": self.comm_s,
                "exposed_comm_s": self.exposed_comm_s, "step_s": self.step_s}


def step_time(stats: ModelStats, layout: Layout, batch: Batching, training: Training, cluster: Cluster) -> StepTime:
    """Step time of ``layout``: compute plus the communication compute cannot hide.

    Pipeline stages compute different micro-batches at once (m + p − 1 slots of 1/p of a micro-batch each);
    model-parallel stages take turns, so a process computes as fast as one of its GPUs. ddp and zero1
    all-reduce gradients once per step, hidden in up to ``device.overlap`` of a micro-batch's backward; zero1
    then gathers the updated parameters (not hidden). zero2 and fsdp gather parameters (fsdp twice: forward
    and backward) and reduce-scatter gradients every micro-batch, prefetched into up to ``overlap`` of its
    compute; hsdp adds an all-reduce of the shard across nodes. Stage-to-stage sends (one per forward and per
    backward, per slot) are not hidden.
    """
    ranks_per_node = cluster.ranks_per_node if layout.world_size > 1 else 1
    rate = cluster.flops_per_s(training.precision, ranks_per_node)
    micro_s = stats.flops_per_sample * training.flops_factor * batch.micro_batch / layout.pp / rate
    m = batch.micro_batches
    overlap = cluster.device.overlap
    psi = ranked_params(stats, layout)
    grads, params = psi * training.bytes.grad, psi * training.bytes.param
    boundary = stats.boundary_bytes_per_sample * activation_scale(stats, training) * batch.micro_batch
    inner = layout.stages  # data-parallel peers are this many ranks apart
    hidden_in_backward = overlap * BACKWARD_SHARE * micro_s

    total = exposed = 0.0

    def add(seconds: float, window: float = 0.0, times: int = 1) -> None:
        nonlocal total, exposed
        total += times * seconds
        exposed += times * max(0.0, seconds - window)

    if layout.zero <= 1 and layout.dp > 1:
        dp_link = cluster.link_for(layout.dp, inner)
        add(all_reduce_s(grads, layout.dp, dp_link), hidden_in_backward)
        if layout.zero == 1:
            add(all_gather_s(params, layout.dp, dp_link))
    if layout.zero >= 2:
        shard_link = cluster.link_for(layout.shard, inner)
        gathers = (2 if layout.zero == 3 else 1) * all_gather_s(params, layout.shard, shard_link)
        add(gathers + reduce_scatter_s(grads, layout.shard, shard_link), overlap * micro_s, times=m)
        replica_link = cluster.link_for(layout.replicas, inner * layout.shard)
        add(all_reduce_s(grads / layout.shard, layout.replicas, replica_link), hidden_in_backward)
    if layout.pp > 1:
        add(2 * p2p_s(boundary, cluster.link_for(layout.pp, layout.mp)), times=m + layout.pp - 1)
    if layout.mp > 1:
        add(2 * (layout.mp - 1) * p2p_s(boundary, cluster.intra), times=m)
    return StepTime(compute_s=m * micro_s, bubble_s=(layout.pp - 1) * micro_s, comm_s=total, exposed_comm_s=exposed)
