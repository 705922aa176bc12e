"""Rows to the rank that holds their expert and back: the token exchange of expert parallelism.

Each rank of an expert group holds ``n_local`` consecutive experts (rank r: experts ``r*n_local ..``). Rows arrive
sorted by expert with a count per expert; the counts go first (a fixed-size all-to-all), so every rank knows how
many rows it sends to and receives from each other rank, then the rows themselves go in one all-to-all with
variable splits, autograd-aware (``all_to_all_single_autograd`` of torch's functional collectives, which torch 2.13
names in place of the deprecated ``torch.distributed.nn.functional.all_to_all_single``: its backward sends the
gradients the opposite way). No row is dropped: there is no capacity, every row is computed by its expert.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd

LocalRun = Callable[[torch.Tensor, torch.Tensor, list[int]], torch.Tensor]
"""``(rows sorted by local expert, count per local expert on the device, the same counts on the host) -> one output
row per row``: the experts this rank holds (the device counts for grouped GEMM, the host ones for a loop)."""


def exchange(rows: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup, run: LocalRun) -> torch.Tensor:
    """``rows`` (sorted by expert, ``counts[e]`` of them expert e's, over every expert of the layer; rows past
    ``counts.sum()`` are left out) through their experts, wherever those are held in ``group``; returns one output
    row per row counted, in ``rows``' order.

    The host reads the counts once (what the variable splits of the all-to-all need), both ways at a time: every
    further size is taken from that one read."""
    ranks = dist.get_world_size(group)
    sent = counts.to(torch.int64).view(ranks, -1)  # [destination rank, its local expert]
    received = torch.empty_like(sent)
    dist.all_to_all_single(received, sent, group=group)
    sent_host, received_host = torch.stack((sent, received)).tolist()  # the layer's one device->host read
    send_splits, recv_splits = [sum(r) for r in sent_host], [sum(r) for r in received_host]
    local_host = [sum(column) for column in zip(*received_host)]
    arrived = _all_to_all(rows[: sum(send_splits)], recv_splits, send_splits, group)
    n_local = sent.shape[1]
    # arrived rows are grouped by source rank, each source's sorted by local expert: regroup them by local expert
    expert_of_row = (
        torch.arange(n_local, device=rows.device)
        .repeat(ranks)
        .repeat_interleave(received.flatten(), output_size=sum(recv_splits))
    )  # its size given: CUDA would read it on the host
    order = expert_of_row.argsort(stable=True)
    computed = run(arrived[order], received.sum(0), local_host)
    back = computed[order.argsort()]
    returned = _all_to_all(back, send_splits, recv_splits, group)
    # the collective hands back a view of its buffer; a module's output that is a view loses FSDP's backward hook
    # to an in-place op of the caller's (FSDP2 warns), so the experts' output is a tensor of its own
    return returned.clone() if returned._is_view() else returned


def _all_to_all(
    rows: torch.Tensor, recv_splits: list[int], send_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """``rows`` cut by ``send_splits`` to each rank of ``group``; what arrives, ``recv_splits`` from each, waited."""
    out = all_to_all_single_autograd(rows.contiguous(), recv_splits, send_splits, group)
    return out.wait() if hasattr(out, "wait") else out
