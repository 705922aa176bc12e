"""Attention over whole padded sequences, in memory linear in the sequence for kernels that mask causally by
themselves (SDPA).

The model builds its masks for the rank's slice of the sequence (or none: transformers skips them for an attention
function it does not know), so the kernel is called here from the call's whole 2-D padding mask. A dense
``[b, 1, s, s]`` mask costs ``s^2`` per sample (16 GiB at 128k tokens; SDPA saves it for backward) and keeps SDPA off
its flash kernel. Instead each sample's valid tokens are gathered into one sequence that the kernel runs causally
(SDPA's ``is_causal``, no mask: the unpadding transformers' flash attention does), and every other row gets what the
dense mask gives it, with no mask larger than ``[b, 1, 1, s]``: a padded token attends to the valid tokens before it,
or, where there are none (left padding), is the kernel's row with every key masked. Eager attention adds its causal
mask to its scores, so it gets one for one sample's valid tokens at a time, ``[1, 1, n, n]``: its own scores are
heads times that. A packed row (many documents, :mod:`paratrain.model.packed`) is run the same way, one document at
a time (:func:`attend_documents`), so attention never crosses documents and no mask is larger than one document's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ...model.packed import document_starts, each_document, row_lengths

Kernel = Callable[..., tuple[torch.Tensor, Any]]
"""A transformers attention function: ``(module, q, k, v, mask, **kwargs) -> (out [b, s, h, d], weights)``."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """Where one sample's valid tokens are, and the runs of padding around them."""

    valid: torch.Tensor
    """Positions of the valid tokens, ascending."""
    runs: tuple[tuple[int, int, int], ...]
    """``(start, end, valid tokens before start)`` of each run of padded positions."""
    order: torch.Tensor
    """Where each position's row sits among the valid rows followed by the runs' rows (the inverse permutation)."""


@dataclasses.dataclass(frozen=True)
class Padding:
    """The current call's padding, read once per forward (one copy to the host), for every attention of it."""

    keys: torch.Tensor
    """``[b, s]`` bool, True where a token is valid."""
    samples: tuple[Sample, ...]


def read_padding(mask: torch.Tensor | None, device: torch.device) -> Padding | None:
    """The padding of a 2-D attention mask, or None where nothing is padded; its tensors on ``device`` (the
    inputs', where the kernel runs and indexes them)."""
    if mask is None:
        return None
    host = mask.to(device="cpu", dtype=torch.bool)
    if bool(host.all()):
        return None
    return Padding(host.to(device), tuple(_sample(row, device) for row in host))


@dataclasses.dataclass(frozen=True)
class Documents:
    """The current call's packed documents, read once per forward (one copy to the host), for every attention."""

    lengths: tuple[tuple[int, ...], ...]
    """Each row's document lengths, in order."""
    ids: torch.Tensor
    """``[b, s]`` the index of each token's document in its row (the all-gather's rows' masks compare them)."""


_DOCUMENT_KEYS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""What a kernel is handed that describes the rank's slice or the whole packed row, not the one document it runs."""


def read_documents(
    positions: torch.Tensor | None, cu_seq_lens: torch.Tensor | None, rows: int, length: int, device: torch.device
) -> Documents | None:
    """The documents of a packed call from its whole sequences' ``positions`` ``[b or 1, s]`` (restarting at each
    document) or ``cu_seq_lens`` (the flattening collator's), or None where no row holds more than one. The ids are
    computed where the positions are (no copy between host and device, which would wait for the device's queue),
    and moved to ``device`` (the inputs') only where the call gave them elsewhere."""
    if cu_seq_lens is not None:
        starts = torch.zeros(rows * length, dtype=torch.bool, device=cu_seq_lens.device)
        starts = starts.index_fill_(0, cu_seq_lens[:-1].long(), True).view(
            rows, length
        )  # rows' first tokens among them
    elif positions is not None and positions.dim() == 2:
        starts = document_starts(positions.expand(rows, -1))
    else:
        return None
    lengths = row_lengths({"position_ids": positions, "cu_seq_lens_q": cu_seq_lens}, rows, length)
    if all(len(row) == 1 for row in lengths):
        return None
    return Documents(tuple(tuple(row) for row in lengths), (starts.long().cumsum(-1) - 1).to(device))


def _sample(row: torch.Tensor, device: torch.device) -> Sample:
    valid = row.nonzero().flatten()
    edges = torch.diff((~row).int(), prepend=torch.zeros(1, dtype=torch.int), append=torch.zeros(1, dtype=torch.int))
    starts, ends = (edges == 1).nonzero().flatten().tolist(), (edges == -1).nonzero().flatten().tolist()
    before = row.cumsum(0).tolist()
    runs = tuple((a, b, before[a - 1] if a else 0) for a, b in zip(starts, ends, strict=True))
    rows = torch.cat([valid, *(torch.arange(a, b) for a, b, _ in runs)])
    return Sample(valid.to(device), runs, rows.argsort().to(device))


def attend(
    kernel: Kernel,
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    padding: Padding | None,
    causal: bool,
    form: str,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """``kernel`` on whole sequences ``[b, h, s, d]``, causal where the module is and padded keys masked, as one
    dense mask would have it. ``form``: ``"bool"`` (True attends: SDPA, which masks causally by itself) or
    ``"additive"`` (eager attention, which does not)."""
    if padding is None:
        mask = causal_mask(q.shape[2], q.dtype, q.device) if causal and form == "additive" else None
        return kernel(module, q, k, v, mask, **kwargs)
    if not causal:
        return kernel(module, q, k, v, key_mask(padding.keys[:, None, None, :], form, q.dtype), **kwargs)
    parts = [
        _causal_sample(kernel, module, q[i : i + 1], k[i : i + 1], v[i : i + 1], sample, form, kwargs)
        for i, sample in enumerate(padding.samples)
    ]
    out = torch.cat([o for o, _ in parts])
    weights = [w for _, w in parts]
    return out, None if any(w is None for w in weights) else torch.cat(weights)


def attend_documents(
    kernel: Kernel,
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    documents: Documents,
    causal: bool,
    form: str,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, None]:
    """``kernel`` on whole packed rows ``[b, h, s, d]``, once per document (as :func:`attend` runs one unpadded
    sequence): out ``[b, s, h, d]``; no weights (each document's are its own)."""
    kwargs = {key: value for key, value in kwargs.items() if key not in _DOCUMENT_KEYS}

    def one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attend(kernel, module, q, k, v, None, causal, form, kwargs)[0]

    return each_document(one, q, k, v, documents.lengths, out_dim=1), None


def _causal_sample(
    kernel: Kernel,
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sample: Sample,
    form: str,
    kwargs: dict[str, Any],
) -> tuple[torch.Tensor, Any]:
    """One sample's rows: its valid tokens gathered and run causally, then each run of padding over the valid tokens
    before it (none: every key masked, the row a dense mask gives)."""
    s, n = q.shape[2], sample.valid.numel()
    kc, vc = k.index_select(2, sample.valid), v.index_select(2, sample.valid)
    pieces = []  # (out [1, rows, h, d], weights [1, h, rows, keys] or None, row positions, key positions or all)
    if n:
        mask = causal_mask(n, q.dtype, q.device) if form == "additive" else None
        out, w = kernel(module, q.index_select(2, sample.valid), kc, vc, mask, **{**kwargs, "is_causal": True})
        pieces.append((out, w, sample.valid, sample.valid))
    for start, end, before in sample.runs:
        rows, at = q[:, :, start:end], torch.arange(start, end, device=q.device)
        if before:
            out, w = kernel(module, rows, kc[:, :, :before], vc[:, :, :before], None, **{**kwargs, "is_causal": False})
            pieces.append((out, w, at, sample.valid[:before]))
        else:
            none = torch.zeros(1, 1, 1, s, dtype=torch.bool, device=q.device)
            pieces.append((*kernel(module, rows, k, v, key_mask(none, form, q.dtype), **kwargs), at, None))
    out = torch.cat([p[0] for p in pieces], dim=1).index_select(1, sample.order)
    if any(p[1] is None for p in pieces):
        return out, None
    return out, _whole_weights(pieces, s)


def _whole_weights(pieces: list, s: int) -> torch.Tensor:
    """The ``[1, h, s, s]`` attention weights a dense mask's call returns (eager), from the pieces'."""
    first = pieces[0][1]
    whole = first.new_zeros(1, first.shape[1], s, s)
    for _, w, rows, keys in pieces:
        keys = torch.arange(s, device=first.device) if keys is None else keys
        whole[:, :, rows[:, None], keys[None, :]] = w
    return whole


def causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[1, 1, length, length]`` additive causal mask (0 or the dtype's minimum, added to the scores)."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    return key_mask(allowed[None, None], "additive", dtype)


def key_mask(allowed: torch.Tensor, form: str, dtype: torch.dtype) -> torch.Tensor:
    """``allowed`` (True attends) in the kernel's form."""
    if form == "bool":
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)
