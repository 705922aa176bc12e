"""A minimal decoder-only transformer (GPT-2 / LLaMA shaped, dense or with mixture-of-experts blocks) and the
built-in size configurations.

The shapes are the planner's (``planner.transformer.GPTConfig``: pure data, planned in closed form). The module
exists so that sizes can be built on the meta device (``with torch.device("meta"): GPT(cfg)``) and checked
against the planner's closed-form counts, and so that a tiny one can train for real. It keeps only
what changes parameter counts, FLOPs and activation memory: no dropout, no weight-init scheme, and the
LLaMA-like configuration leaves out rotary position embeddings (they add no parameters and negligible FLOPs).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError
from ..model.packed import document_lengths, each_document
from ..planner.moe import MoE
from ..planner.transformer import TRANSFORMERS, GPTConfig, moe_block
from .experts import MixtureOfExperts, activate

if TYPE_CHECKING:
    from ..distributed.tensor_parallel.plans import TPPlan


GPT_CONFIGS = MappingProxyType(
    {
        **TRANSFORMERS,
        "gpt-tiny": GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab=512),  # 0.17M, for tests
        "gpt-moe-tiny": GPTConfig(
            layers=2, hidden=64, heads=4, seq_len=64, vocab=512, bias=False, moe=MoE(experts=4, top_k=2, ffn=128)
        ),  # 0.20M: 4 experts of top 2 per block
    }
)
"""Built-in sizes: the planner's named shapes (``planner.transformer.TRANSFORMERS``) and a tiny one that trains for
real in the demos and tests."""


class RMSNorm(nn.Module):
    """Root-mean-square norm with a scale and no bias (LLaMA)."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class CausalAttention(nn.Module):
    """The attention kernel: q, k, v ``[b, h, s, d]`` -> ``[b, h, s, d]``, causal, on whole sequences. A module of its
    own so that context parallelism finds it by what it is (``is_attention_kernel``) and exchanges around it.
    ``documents`` (a packed batch: each row's document lengths) runs it once per document, no mask
    (``packs_documents``: context parallelism hands it the whole rows' documents, or under its all-gather none and
    masks the SDPA call per document itself)."""

    is_attention_kernel = True
    packs_documents = True

    def __init__(self, grouped: bool) -> None:
        super().__init__()
        self.grouped = grouped

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: list[list[int]] | None = None
    ) -> torch.Tensor:
        if documents is None:
            return self._attend(q, k, v)
        if sum(documents[0]) != q.shape[2]:
            raise ConfigError(
                f"packed positions describe {sum(documents[0])} tokens a row but attention sees {q.shape[2]} "
                "(a sequence split over ranks, cp); pad each document to its own row there"
            )
        return each_document(self._attend, q, k, v, documents, out_dim=2)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)


class Block(nn.Module):
    """Pre-norm attention and MLP with residuals.

    ``qkv``'s outputs are grouped per head (``q k v`` of head 0, then of head 1, …) and a gated ``fc``'s per unit
    (gate, up), so that a contiguous column split — tensor parallelism — gives each rank whole heads and units.
    With grouped-query attention (``kv_heads`` < ``heads``) the queries come from ``q`` and the keys and values
    from ``kv`` (``k v`` per key/value head): one fused output could not be viewed as heads without a copy of the
    queries, which autograd would save besides the projection's output. ``experts``: the MLP is the shape's
    mixture of experts (:mod:`.experts`) instead.
    """

    def __init__(self, cfg: GPTConfig, experts: bool = False) -> None:
        super().__init__()
        h, f, att = cfg.hidden, cfg.ffn_width, cfg.attention_width
        norm = (lambda: nn.LayerNorm(h)) if cfg.bias else (lambda: RMSNorm(h))
        self.head_dim = cfg.head_width
        self.gated = cfg.gated
        self.norm1 = norm()
        if cfg.key_value_heads == cfg.heads:
            self.qkv = nn.Linear(h, 3 * att, bias=cfg.has_qkv_bias)
        else:
            self.q = nn.Linear(h, att, bias=cfg.has_qkv_bias)
            self.kv = nn.Linear(h, 2 * cfg.kv_width, bias=cfg.has_qkv_bias)
        self.grouped = cfg.key_value_heads != cfg.heads
        self.attention = CausalAttention(self.grouped)
        self.q_norm, self.k_norm = (RMSNorm(self.head_dim), RMSNorm(self.head_dim)) if cfg.qk_norm else (None, None)
        self.proj = nn.Linear(att, h, bias=cfg.bias)
        self.norm2 = norm()
        self.moe = MixtureOfExperts(cfg, cfg.moe) if experts and cfg.moe is not None else None
        if self.moe is None:
            self.fc = nn.Linear(h, 2 * f if cfg.gated else f, bias=cfg.bias)
            self.out = nn.Linear(f, h, bias=cfg.bias)

    def forward(self, x: torch.Tensor, documents: list[list[int]] | None = None) -> torch.Tensor:
        """``documents``: a packed batch's document lengths per row (:class:`CausalAttention`)."""
        # Shapes come from the projections' outputs, not from x: under tensor parallelism x holds a slice of the
        # sequence and qkv this rank's heads.
        n = self.norm1(x)
        if self.grouped:
            kind = n.device.type
            # one 16-bit copy of the input for both projections, as a fused projection casts it once
            if kind != "meta" and torch.is_autocast_enabled(kind):
                n = n.to(torch.get_autocast_dtype(kind))
            q = self.q(n)
            b, t, _ = q.shape
            q = q.view(b, t, -1, self.head_dim).transpose(1, 2)
            k, v = self.kv(n).view(b, t, -1, 2 * self.head_dim).transpose(1, 2).chunk(2, dim=-1)
        else:
            qkv = self.qkv(n)
            b, t, _ = qkv.shape
            q, k, v = qkv.view(b, t, -1, 3 * self.head_dim).transpose(1, 2).chunk(3, dim=-1)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        y = self.attention(q, k, v) if documents is None else self.attention(q, k, v, documents=documents)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        if self.moe is not None:
            return x + self.moe(self.norm2(x))
        return x + self.out(activate(self.fc(self.norm2(x)), self.gated))


class GPT(nn.Module):
    """Token ids (batch, seq) → logits (batch, seq, vocab)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq_len, cfg.hidden) if cfg.learned_positions else None
        self.blocks = nn.ModuleList(Block(cfg, moe_block(cfg, i)) for i in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden) if cfg.bias else RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``positions``: the global positions of ``idx``'s tokens, ``[seq]``, ``[1, seq]`` or ``[batch, seq]``
        (default ``0 … seq-1``); a rank that holds a slice of the sequence (context parallelism) passes its slice's.
        Positions that restart inside a row mark packed documents: each attends only within itself (their lengths
        are read to the host once here, not once a layer)."""
        x = self.wte(idx)
        documents = None if positions is None else document_lengths(positions, idx.shape[0])
        if positions is not None and positions.dim() == 2 and positions.shape[0] == 1:
            positions = positions[0]  # one row for the batch: the position table's rows are the sequence's
        if self.wpe is not None:
            x = x + self.wpe(positions if positions is not None else torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x) if documents is None else block(x, documents)
        return self.head(self.norm(x))

    def paratrain_tp_plan(self) -> TPPlan:
        """The tensor-parallel plan (see :mod:`paratrain.distributed.tensor_parallel.plans`): ``qkv`` and a gated
        ``fc`` are laid out per head / per unit, so a plain column split keeps them whole (no gather, unlike GPT-2's
        ``c_attn``). Imported here, when asked for: tensor parallelism takes a second to import. A mixture-of-experts
        block runs whole on every rank on the gathered sequence (its routing sees every token, as one process's
        does). Query/key norms have no plan yet: one line says so."""
        if self.cfg.qk_norm:
            raise ConfigError("paratrain's GPT has no tensor-parallel plan for query/key norms; train it without tp")
        from ..distributed.tensor_parallel.names import head, style
        from ..distributed.tensor_parallel.plans import TPPlan

        # The embedding's partial sums are reduce-scattered straight into sequence slices (torchtitan's layout), not
        # all-reduced and then sliced; the position table hands each rank its positions' rows.
        styles: dict[str, object] = {"wte": style("rowwise(output=sequence)")}
        if self.wpe is not None:
            styles["wpe"] = style("replicate(output_shard=0)")
        styles.update(
            {
                "blocks.*.norm1": style("sequence_parallel"),
                **{
                    f"blocks.*.{name}": style("colwise(input=sequence)")  # grouped: q and kv each gather the input
                    for name in (("q", "kv") if self.cfg.key_value_heads != self.cfg.heads else ("qkv",))
                },
                "blocks.*.proj": style("rowwise(output=sequence)"),
                "blocks.*.norm2": style("sequence_parallel"),
            }
        )
        if any(b.moe is not None for b in self.blocks):
            styles["blocks.*.moe"] = style("whole_sequence")
        if any(b.moe is None for b in self.blocks):
            styles.update(
                {"blocks.*.fc": style("colwise(input=sequence)"), "blocks.*.out": style("rowwise(output=sequence)")}
            )
        styles.update({"norm": style("sequence_parallel"), "head": head()})
        return TPPlan(
            name="paratrain GPT",
            sequence_parallel=True,
            styles=styles,
            divisible=lambda m: {
                "heads": m.cfg.heads,
                "kv_heads": m.cfg.key_value_heads,
                **({"ffn": m.cfg.ffn_width} if "blocks.*.fc" in styles else {}),
            },
        )
