"""The all-gather exchange: attention for any head count (Ulysses needs heads that divide by tp x cp).

Each of the ``C`` ranks keeps its own queries and gathers every rank's keys and values, ``[b, kv, s/C, d] ->
[b, kv, s, d]``, with torch's functional ``all_gather_single_autograd`` (its backward is the reduce-scatter of the
gradients, so autograd needs nothing of ours). The kernel (any: SDPA, eager, a model's own) then computes this rank's
rows of attention, one call per piece of the sequence the rank holds, on the keys up to that piece's end and a mask
of those rows only (``[pieces, keys]``, never ``[s, s]``). Causal work grows along the sequence, so the sequence is
cut head-tail (:class:`~.sequence.SequenceSplit` ``balanced``): of ``2C`` pieces rank ``i`` holds ``i`` and
``2C-1-i``, and every rank computes the same number of query-key pairs. torch's own ring attention
(``torch.distributed.tensor.experimental.context_parallel``) has no CPU kernels (torch 2.13:
``_scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy) and takes SDPA only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.distributed._functional_collectives import all_gather_single_autograd, wait_tensor
from torch.nn import functional as F

from ...errors import ConfigError
from ...model.attention import SDPACall
from .masks import key_mask
from .sequence import SequenceSplit

Rows = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], tuple[torch.Tensor, Any]]
"""A kernel on one piece's queries, the keys and values it may see, and the mask of its rows (None: no mask):
``(out, weights or None)``, ``out`` with the sequence on dimension 2 (``[b, h, rows, d]``)."""


def gather_sequence(x: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """``[b, h, s/C, d]`` (this rank's pieces) -> ``[b, h, s, d]`` (every rank's, in sequence order)."""
    return in_order(wait_tensor(all_gather_single_autograd(x.contiguous(), 0, split.group)), split)


def in_order(gathered: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """Every rank's ``[b, h, s/C, d]`` stacked on dimension 0 (``[C * b, ...]``) -> ``[b, h, s, d]`` in sequence
    order."""
    ranks = split.ranks
    _, h, local, d = gathered.shape
    b, size = gathered.shape[0] // ranks, local // (2 if split.balanced else 1)
    by_rank = gathered.view(ranks, b, h, local // size, size, d).permute(1, 2, 0, 3, 4, 5)  # [b, h, C, pieces, ...]
    if not split.balanced:
        return by_rank.reshape(b, h, ranks * local, d)
    heads, tails = by_rank[:, :, :, 0], by_rank[:, :, :, 1].flip(2)  # pieces 0..C-1, then C..2C-1
    return torch.cat([heads, tails], dim=2).reshape(b, h, ranks * local, d)


def row_masks(
    split: SequenceSplit,
    length: int,
    keys: torch.Tensor | None,
    causal: bool,
    form: str,
    dtype: torch.dtype,
    device: torch.device,
    documents: torch.Tensor | None = None,
) -> Iterator[tuple[int, int, torch.Tensor | None]]:
    """For each piece this rank holds of a sequence of ``length`` tokens: where its rows sit in the rank's slice,
    how many keys they are given (causal SDPA: up to the piece's end), and their mask in ``form`` (``[b or 1, 1, rows,
    keys]``; None where every key is seen). ``keys``: ``[b, s]`` bool, True for a valid token (None: no padding);
    ``documents``: ``[b, s]``, each token's document in a packed row, whose rows see their own document's keys only
    (None: not packed). Eager attention gets every key: a row with every key masked (left padding) is its mean over
    all of them, as the dense mask gives it."""
    size = length // split.pieces
    for at, start in enumerate(split.chunks(length)):
        seen = start + size if causal and form == "bool" else length
        allowed = torch.ones(size, seen, dtype=torch.bool, device=device).tril(start)[None, None] if causal else None
        for within in _within(keys, documents, start, size, seen):
            allowed = within if allowed is None else allowed & within
        yield at * size, seen, None if allowed is None else key_mask(allowed, form, dtype)


def _within(
    keys: torch.Tensor | None, documents: torch.Tensor | None, start: int, size: int, seen: int
) -> Iterator[torch.Tensor]:
    """The ``[b, 1, rows or 1, seen]`` conditions besides causality a piece's rows attend under: valid keys, and
    keys of the row's own document."""
    if keys is not None:
        yield keys[:, None, None, :seen]
    if documents is not None:
        yield documents[:, None, start : start + size, None] == documents[:, None, None, :seen]


def attend_rows(
    run: Rows,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    split: SequenceSplit,
    keys: torch.Tensor | None,
    causal: bool,
    form: str,
    documents: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's rows of attention: ``q`` ``[b, h, s/C, d]`` (its pieces) over ``k``, ``v`` ``[b, kv, s, d]``
    (the whole sequence), ``keys`` and ``documents`` as :func:`row_masks` takes them; ``out`` ``[b, h, s/C, d]``
    and the weights ``[b, h, s/C, s]`` (None if the kernel gives none)."""
    length = k.shape[2]
    size = length // split.pieces
    outs, weights = [], []
    for row, seen, mask in row_masks(split, length, keys, causal, form, q.dtype, q.device, documents):
        out, w = run(q[:, :, row : row + size], k[:, :, :seen], v[:, :, :seen], mask)
        outs.append(out)
        weights.append(None if w is None else F.pad(w, (0, length - seen)))
    whole = None if any(w is None for w in weights) else torch.cat(weights, dim=2)
    return torch.cat(outs, dim=2), whole


def allgather_sdpa(split: SequenceSplit, where: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """One SDPA call on q, k, v ``[b, h, s/C, d]`` (this rank's pieces): this rank's rows over the gathered keys and
    values, with the call's own causality, scale, grouping and dropout; ``where``: the calling module, for errors."""
    call = SDPACall(*args, **kwargs)
    if call.attn_mask is not None:
        raise ConfigError(
            f"{where} calls scaled_dot_product_attention with an explicit attn_mask, which cp cannot rebuild for "
            "whole sequences (it was made for this rank's slice); use is_causal=True, or train without cp"
        )
    options = {**call.options(), "is_causal": False}
    k, v = (gather_sequence(t, split) for t in (call.key, call.value))

    def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, None]:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **options), None

    documents = None if split.documents is None else split.documents.ids  # a packed row's, kept apart
    return attend_rows(run, call.query, k, v, split, None, call.is_causal, "bool", documents)[0]
