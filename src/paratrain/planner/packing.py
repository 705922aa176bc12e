"""Packed rows as the planner prices them: documents laid end to end in a row, attention kept within each.

A row of S tokens holding documents of L tokens computes each document's L x L attention, S/L of them: S·L of the
S x S scores and weighted sums one sequence of S tokens computes, a share L/S (:func:`.attention.document_share`,
the one rule). What else a token computes (its products with the weights, elementwise work) does not depend on where
its document ends, and neither does memory: the planner counts attention as the fused kernels keep it (a log-sum-exp
a token, no s x s tensor), so packing changes the attention FLOPs alone. The closed forms' are scaled here
(:func:`packed`), a trace's call by call (:func:`.attention.attention_flops`); context parallelism's exchanges move
every token's queries, keys and values whatever the documents, and its ranks compute 1/cp of the FLOPs so scaled.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .attention import document_share

if TYPE_CHECKING:
    from .model_stats import ModelStats


def packed(stats: ModelStats, document_tokens: int | None) -> ModelStats:
    """``stats`` of rows packed with documents of ``document_tokens`` tokens: the attention FLOPs of the closed forms
    (``ModelStats.attention_flops_per_sample``, over each sample's whole s x s) scaled by :func:`document_share` and
    what they lose taken off the model's FLOPs. A trace counted its attention per document already and keeps no
    attention FLOPs apart: its stats are returned as they are."""
    attention = stats.attention_flops_per_sample
    if stats.cp is None or not attention:
        return stats
    share = document_share(stats.cp.seq_len, document_tokens)
    if share == 1.0:
        return stats
    kept = attention * share
    return replace(stats, flops_per_sample=stats.flops_per_sample - (attention - kept), attention_flops_per_sample=kept)
