"""Korthikanti et al. (2022, "Reducing Activation Recomputation in Large Transformer Models", table 2) in closed form:
the activation bytes one transformer layer keeps on one tensor-parallel rank, by how it recomputes and whether
tensor parallelism is sequence parallel.

Their accounting is Megatron's GPT in 16-bit with dropout and stored attention scores: per layer of s tokens, b
samples, width h, a heads, ``sbh(34 + 5as/h)`` bytes — 34·sbh for the linear layers, norms, GELU and the three
dropout masks, 5·as²b for QKᵀ, softmax, its dropout mask and output. Tensor parallelism over t ranks splits
everything but the norms' inputs and the two dropouts after the row-parallel layers (10·sbh) unless sequence
parallelism shards those too; selective recomputation drops the 5as/h term (the attention core is recomputed in
backward); full recomputation keeps the layer's input alone, 2·sbh (sharded by sequence parallelism).

The planner's own closed forms (``transformer.transformer_activations``) count what paratrain's GPT saves: a fused
attention kernel stores no s x s tensor (it recomputes the scores in backward), so selective recomputation
saves nothing there and costs the attention core's forward (``timing.executed_flops_per_sample``); without
sequence parallelism the residuals and norms are kept whole on every rank (``tensor_parallel.rank_activations``).
This module gives the paper's figures for comparison (``paratrain plan`` prints neither: they are Megatron's).
"""
from __future__ import annotations

from ..errors import ConfigError
from .training import RECOMPUTE


def layer_activation_bytes(*, seq_len: int, micro_batch: int, hidden: int, heads: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none") -> float:
    """Bytes one transformer layer keeps for backward on one of ``tp`` ranks (Korthikanti et al. 2022, table 2)."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"unknown recompute {recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
    if min(seq_len, micro_batch, hidden, heads, tp) < 1:
        raise ConfigError("sequence, micro-batch, hidden, heads and tp must be >= 1")
    s, b, h, a, t = seq_len, micro_batch, hidden, heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    scores = 0.0 if recompute == "selective" else 5 * a * s / h
    if sequence_parallel:
        return sbh * (34 + scores) / t
    return sbh * (10 + (24 + scores) / t)


def pipeline_first_stage_bytes(*, layers: int, pp: int, virtual_stages: int = 1, micro_batches: int | None = None,
                               **layer: object) -> float:
    """Activation bytes the first pipeline stage keeps at its peak under 1F1B (virtual_stages 1) or interleaved 1F1B:
    p micro-batches of its L/p layers — L layers' worth, whatever p — times 1 + (p−1)/(p·v) when each rank holds
    v >= 2 stages (Korthikanti et al. 2022, section 4.2.3), or all m when fewer than that are in flight."""
    per_layer = layer_activation_bytes(**layer)  # type: ignore[arg-type]
    in_flight = pp * (1 + (pp - 1) / (pp * virtual_stages)) if virtual_stages > 1 else pp
    if micro_batches is not None:
        in_flight = min(in_flight, micro_batches)
    return per_layer * layers / pp * in_flight
