"""Collectives' time: each collective's bytes over its link, and a link's figures from measured collectives.

Collectives follow the ring algorithm's alpha-beta cost for N ranks and S bytes over the all-reduce bus bandwidth
B (Patarasuk & Yuan 2009; the "bus bandwidth" of nccl-tests): all-reduce 2(N−1)/N·S/B, all-gather and
reduce-scatter (N−1)/N·S/(B·e) (S the full, unsharded size), a broadcast S/(B·e), an all-to-all (N−1)/N·S/B (S
what each rank sends), plus the link latency once per ring step; e is the link's measured efficiency of that
collective against the all-reduce. Step time (``timing``), tensor parallelism's activation traffic
(``tensor_parallel``) and expert parallelism's (``expert_parallel``) price their collectives here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

from .hardware import GB, Link


def all_reduce_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-reduce: a reduce-scatter then an all-gather, each N−1 steps moving S/N."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) * link.latency_us * 1e-6 + 2 * (ranks - 1) / ranks * nbytes / link.bytes_per_s


def all_gather_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring all-gather of a tensor of ``nbytes`` in total (each rank starts with nbytes/N)."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / (
        link.bytes_per_s * link.all_gather_eff
    )


def reduce_scatter_s(nbytes: float, ranks: int, link: Link) -> float:
    """Ring reduce-scatter of a tensor of ``nbytes`` in total: the all-gather's bytes in the other direction."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / (
        link.bytes_per_s * link.reduce_scatter_eff
    )


def broadcast_s(nbytes: float, ranks: int, link: Link) -> float:
    """Broadcasting ``nbytes`` in total to every rank (ZeRO-1's parameter sync: each rank broadcasts its
    shard): a pipelined ring moves every byte over each link once."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency_us * 1e-6 + nbytes / (link.bytes_per_s * link.broadcast_eff)


def all_to_all_s(nbytes: float, ranks: int, link: Link) -> float:
    """An all-to-all in which every rank sends ``nbytes`` spread over the N ranks: (N−1)/N of them leave it, at
    the link's bus bandwidth (nccl-tests' alltoall bus bandwidth is its algorithm bandwidth x (N−1)/N), in N−1
    steps of the link's latency."""
    if ranks <= 1:
        return 0.0
    return (ranks - 1) * link.latency_us * 1e-6 + (ranks - 1) / ranks * nbytes / link.bytes_per_s


def p2p_s(nbytes: float, link: Link) -> float:
    """One send between two ranks (pipeline stages)."""
    return link.p2p_latency_s + nbytes / link.p2p_bytes_per_s


def measured_link(link: Link, ranks: int, timings: Mapping[str, tuple[float, ...]]) -> Link:
    """``link`` with the figures measured on ``ranks`` ranks: collective name -> (bytes, seconds).

    ``all_reduce`` sets the bus bandwidth; ``all_gather``, ``reduce_scatter`` and ``broadcast`` their
    efficiencies against it; ``p2p`` (a large send) and ``p2p_small`` (a small one) the point-to-point bandwidth
    and latency; ``all_reduce_small`` (a few bytes) the collectives' latency, which is otherwise the
    point-to-point one. ``all_gather_split`` and ``reduce_scatter_split`` -> (bytes, seconds, calls): the same
    bytes as ``all_gather`` / ``reduce_scatter`` moved in ``calls`` calls, as FSDP issues them (one per wrap
    unit); what each further call added, averaged over the two, sets ``Link.call_us``. Each inverts this module's
    formula for that collective, so a plan made with the result reproduces the timings it was given. Missing
    names keep ``link``'s figures.
    """
    out, alpha = link, link.latency_us * 1e-6
    if "p2p" in timings and "p2p_small" in timings:
        (big, t_big), (small, t_small) = timings["p2p"], timings["p2p_small"]
        per_byte = max(t_big - t_small, 1e-12) / max(big - small, 1)
        alpha = max(t_small - small * per_byte, 0.0)
        out = replace(out, latency_us=alpha * 1e6, p2p_latency_us=alpha * 1e6, p2p_gbs=1 / per_byte / GB)
    elif "p2p" in timings:
        size, seconds = timings["p2p"]
        out = replace(out, p2p_gbs=size / max(seconds - out.p2p_latency_s, 1e-9) / GB)
    if "all_reduce_small" in timings and ranks > 1:
        alpha = timings["all_reduce_small"][1] / (2 * (ranks - 1))  # a few bytes: latency alone
        out = replace(out, latency_us=alpha * 1e6)
    if "all_reduce" in timings:
        size, seconds = timings["all_reduce"]
        moved = 2 * (ranks - 1) / ranks * size
        out = replace(out, bandwidth_gbs=moved / max(seconds - 2 * (ranks - 1) * alpha, 1e-9) / GB)
    unit = out.bytes_per_s
    for name, factor in (
        ("all_gather", (ranks - 1) / ranks),
        ("reduce_scatter", (ranks - 1) / ranks),
        ("broadcast", 1.0),
    ):
        if name in timings:
            size, seconds = timings[name]
            out = replace(out, **{f"{name}_eff": factor * size / unit / max(seconds - (ranks - 1) * alpha, 1e-9)})
    per_call = [
        (timings[f"{name}_split"][1] - timings[name][1]) / (timings[f"{name}_split"][2] - 1)
        for name in ("all_gather", "reduce_scatter")
        if name in timings and f"{name}_split" in timings and timings[f"{name}_split"][2] > 1
    ]
    if per_call:
        out = replace(out, call_us=max(0.0, sum(per_call) / len(per_call)) * 1e6)
    return replace(out, name=f"{link.name} (measured)")
