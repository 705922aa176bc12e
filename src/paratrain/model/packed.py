"""Packed batches: many documents in one row, attention kept within each document.

transformers' ``DataCollatorWithFlattening`` packs documents into one row and marks where each starts by
``position_ids`` that restart at 0 (and, where asked, by ``cu_seq_lens_q``). Only its flash-attention and flex paths
keep attention within each document without a dense ``s x s`` mask; ``sdpa`` and ``eager`` either build that mask
(``s^2`` memory per row) or, given a padding mask too, attend across documents. :data:`PACKED_ATTENTION` is an
attention function registered in transformers' ``AttentionInterface`` that runs the model's own SDPA call once per
document (causal, no mask): any SDPA backend, memory linear in the row. :func:`use_packed_attention` switches a
model to it when a packed batch arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

PACKED_ATTENTION = "paratrain_packed"
"""The ``attn_implementation`` name of the per-document attention."""

_SWITCHED = ("sdpa", "eager")
"""Implementations that would attend across documents or build a dense mask: switched to :data:`PACKED_ATTENTION`."""
_ISOLATING = ("flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention", PACKED_ATTENTION)
"""Implementations that keep a packed row's documents apart themselves (varlen kernels, block masks)."""


def document_starts(position_ids: torch.Tensor) -> torch.Tensor:
    """``[b, s]`` bool: True where a document starts (position 0 of a row, and wherever the positions do not go
    forward: the collator's restarts). A jump forward is no new document: a context-parallel rank's head-tail
    slice (chunks ``i`` and ``2C-1-i``) jumps so."""
    step = torch.diff(position_ids, dim=-1) <= 0
    return torch.cat([torch.ones_like(position_ids[..., :1], dtype=torch.bool), step], dim=-1)


def is_packed(kwargs: Mapping[str, Any]) -> bool:
    """Whether a forward's keyword inputs are a packed batch: ``cu_seq_lens_q`` given, or ``position_ids``
    (transformers') or ``positions`` (torchtitan's, our GPT's) that restart inside a row (a host sync: the answer
    decides the attention path). They are read as the attention reads them (:func:`row_lengths`), so the forward
    that follows finds their document lengths already read."""
    if kwargs.get("cu_seq_lens_q") is not None:
        return True
    positions = kwargs.get("position_ids", kwargs.get("positions"))
    if not isinstance(positions, torch.Tensor) or positions.dim() != 2 or positions.shape[-1] < 2:
        return False
    found = row_lengths({"position_ids": positions}, positions.shape[0], positions.shape[-1])
    return any(len(row) > 1 for row in found)


class _LastRead:
    """The document lengths read for the last forward's positions: every attention layer of one forward is handed
    the same tensor, so the lengths are read to the host once a forward, not once a layer."""

    source: torch.Tensor | None = None
    shape: tuple[int, int, int] = (-1, 0, 0)
    lengths: list[list[int]] = []


def row_lengths(kwargs: Mapping[str, Any], rows: int, length: int) -> list[list[int]]:
    """Each row's document lengths (one host read per forward: :class:`_LastRead`, shared by finding the batch
    packed, context parallelism's cut and the attention)."""
    source = kwargs.get("cu_seq_lens_q")
    source = kwargs.get("position_ids") if source is None else source
    if not isinstance(source, torch.Tensor):
        return [[length]] * rows
    shape = (source._version, rows, length)
    if source is not _LastRead.source or shape != _LastRead.shape:
        _LastRead.lengths = read_lengths(kwargs, rows, length)
        _LastRead.source, _LastRead.shape = source, shape
    return _LastRead.lengths


def read_lengths(kwargs: Mapping[str, Any], rows: int, length: int) -> list[list[int]]:
    """Each row's document lengths, from ``cu_seq_lens_q`` (cumulative over the flattened batch) or the
    ``position_ids`` restarts."""
    cu = kwargs.get("cu_seq_lens_q")
    if cu is not None:
        bounds = [int(b) for b in cu.tolist()]
        flat = [b - a for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        return _split_rows(flat, rows, length)
    starts = document_starts(kwargs["position_ids"].expand(rows, -1))
    out = []
    for row in starts.tolist():
        begin = [i for i, s in enumerate(row) if s] + [length]
        out.append([b - a for a, b in zip(begin[:-1], begin[1:])])
    return out


def _split_rows(flat: list[int], rows: int, length: int) -> list[list[int]]:
    """Document lengths over the flattened batch, cut back into rows of ``length`` (a document never spans rows)."""
    out, row, used = [], [], 0
    for n in flat:
        row.append(n)
        used += n
        if used == length:
            out.append(row)
            row, used = [], 0
    if len(out) != rows or row:
        raise ConfigError(
            f"cu_seq_lens_q describes documents that do not fill {rows} rows of {length} tokens; give "
            "position_ids that restart at each document instead"
        )
    return out


def packed_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature (``query`` ``[b, heads, s, d]``, output ``[b, s, heads, d]``):
    causal SDPA within each document of each row. A padding mask (an unpacked batch) goes to transformers' SDPA
    unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    found = row_lengths(kwargs, query.shape[0], query.shape[2])
    window = kwargs.get("sliding_window")
    if window and max(max(row) for row in found) > window:
        raise ConfigError(
            f"a packed document is longer than this layer's sliding window ({window} tokens), which per-document "
            "attention does not apply; use attn_implementation='flash_attention_2' or shorter documents"
        )

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(module, q, k, v, None, dropout, scaling, is_causal=True)[0]

    return each_document(attend, query, key, value, found, out_dim=1), None


def each_document(
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    lengths: list[list[int]],
    out_dim: int,
) -> torch.Tensor:
    """``attend`` (causal, no mask) on each document of each row of ``query``/``key``/``value`` (``[b, heads, s,
    d]``), the outputs put back in order along their sequence dimension ``out_dim``: attention never crosses a
    document and no ``s x s`` mask exists."""
    rows = []
    for r, row in enumerate(lengths):
        parts, at = [], 0
        for n in row:
            doc = slice(at, at + n)
            parts.append(attend(query[r : r + 1, :, doc], key[r : r + 1, :, doc], value[r : r + 1, :, doc]))
            at += n
        rows.append(torch.cat(parts, dim=out_dim))
    return torch.cat(rows, dim=0)


def document_lengths(positions: torch.Tensor, rows: int) -> list[list[int]] | None:
    """Each of ``rows`` rows' document lengths from ``positions`` (``[seq]``, ``[1, seq]`` for every row, or ``[rows,
    seq]``) that restart at each document; None when no row restarts (a whole sequence, or a context-parallel slice:
    on by one, or jumping forward from its head chunk to its tail). One host read, for a model to make once a forward
    and hand to every attention layer."""
    if positions.device.type == "meta":
        return None  # a shape-only forward (the planner's): nothing to read
    positions = positions if positions.dim() == 2 else positions.reshape(1, -1)
    found = row_lengths({"position_ids": positions}, positions.shape[0], positions.shape[-1])  # is_packed's read
    found = found * rows if positions.shape[0] == 1 else found  # one row's read serves a batch that shares it
    return found if any(len(row) > 1 for row in found) else None


def _packed_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a packed row (the documents are found from the positions); SDPA's padding mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    return None if kwargs.get("attention_mask") is None else sdpa_mask(*args, **kwargs)


def register_packed_attention() -> None:
    """Register :data:`PACKED_ATTENTION` with transformers (idempotent: the registry is transformers' own)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    AttentionMaskInterface.register(PACKED_ATTENTION, _packed_mask)


def use_packed_attention(model: nn.Module) -> None:
    """Before a packed batch's forward: a transformers model on ``sdpa``/``eager`` switches to
    :data:`PACKED_ATTENTION` (every sub-config that names an implementation; the first found is the model's own, or
    under a pipeline its blocks' attention's: the same object); a model that isolates documents
    itself is left alone (a transformers kernel that does, or an attention module marked ``packs_documents``, as
    paratrain's GPT's is: it reads the documents from its ``positions``); anything else is a one-line error."""
    configs = (getattr(m, "config", None) for m in model.modules())
    config = next((c for c in configs if hasattr(c, "_attn_implementation")), None)
    found = getattr(config, "_attn_implementation", None)
    if found in _ISOLATING or (config is None and any(getattr(m, "packs_documents", False) for m in model.modules())):
        return
    if found not in _SWITCHED:
        what = f"attn_implementation={found!r}" if config is not None else f"{type(model).__name__} (not transformers)"
        raise ConfigError(
            f"packed batch (position_ids restart inside a row) given to {what}: its attention would cross "
            f"documents; build the model with attn_implementation='sdpa', 'eager', 'flash_attention_2' or "
            f"'flex_attention', or pad each document to its own row"
        )
    register_packed_attention()
    for sub in model.modules():
        cfg = getattr(sub, "config", None)
        if getattr(cfg, "_attn_implementation", None) in _SWITCHED:
            cfg._attn_implementation = PACKED_ATTENTION
