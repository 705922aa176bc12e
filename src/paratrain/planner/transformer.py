"""Decoder-only transformers in closed form: their shape, the named sizes ``paratrain plan --model`` knows, and
the parameters, FLOPs and activations of a shape, in milliseconds and with no module built.

The shapes are pure data, so the planner plans GPT-2 or a 7B model without importing a model;
``workloads.gpt.GPT`` builds the same shapes for real, and tests/planner/test_planner_stats.py holds the counts here
equal to that module's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import ConfigError
from ..model.tables import TABLE_MIN_NUMEL
from .model_stats import ELEMENT_BYTES, CPShape, ModelStats, MoEShape, TableStats, TPShape
from .moe import MoE, idle_params, mlp_activations, mlp_params, mlp_tensors, routed_width


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """The shape of a decoder-only transformer."""

    layers: int
    """Transformer blocks."""
    hidden: int
    """Model width (d_model)."""
    heads: int
    """Attention (query) heads; ``hidden`` must divide evenly."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention, Ainslie et al. 2023: each serves ``heads / kv_heads`` query
    heads); default ``heads`` (multi-head attention)."""
    seq_len: int = 1024
    """Tokens per sample (context length)."""
    vocab: int = 50257
    """Vocabulary size (GPT-2's tokenizer by default)."""
    ffn: int | None = None
    """MLP inner width; default 4 x hidden."""
    gated: bool = False
    """SwiGLU MLP (three matrices, LLaMA) instead of GELU (two matrices, GPT-2)."""
    bias: bool = True
    """Linear layers and norms carry biases (GPT-2 yes, LLaMA no: RMSNorm and bias-free linears)."""
    learned_positions: bool = True
    """A learned position table of ``seq_len x hidden`` (GPT-2); LLaMA uses rotary embeddings instead."""
    tied: bool = True
    """The output projection shares the token embedding's weights (GPT-2)."""
    qkv_bias: bool | None = None
    """Biases on the query, key and value projections; default ``bias`` (Qwen2: yes, with ``bias`` off)."""
    head_dim: int | None = None
    """Width of one attention head; default hidden / heads. Qwen3 and GPT-OSS widen them (32 heads of 128 over a
    2048-wide stream): the attention's inner width, heads x head_dim, then differs from ``hidden``."""
    qk_norm: bool = False
    """An RMSNorm over each query and key head before attention (Qwen3): head_dim weights each, a block."""
    moe: MoE | None = None
    """The blocks' MLPs are mixtures of experts of this shape (but ``moe.dense_layers``); None: dense MLPs."""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "kv_heads", "ffn", "head_dim"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"transformer {name} must be >= 1, got {value}")
        if self.head_dim is None and self.hidden % self.heads:
            raise ConfigError(
                f"hidden {self.hidden} is not divisible by heads {self.heads}: each head takes "
                "hidden / heads of the width; give --heads that divides --hidden"
            )
        if self.heads % self.key_value_heads:
            raise ConfigError(
                f"heads {self.heads} is not divisible by kv_heads {self.key_value_heads}: each key/value "
                "head serves a whole group of query heads; give --kv-heads that divides --heads"
            )
        if self.moe is not None and any(i >= self.layers for i in self.moe.dense_layers):
            raise ConfigError(f"MoE dense_layers {self.moe.dense_layers} name blocks beyond the {self.layers} layers")

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def head_width(self) -> int:
        """One attention head's width: ``head_dim``, or hidden / heads."""
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """The queries' and the attention output's width: heads x head_dim (``hidden`` unless ``head_dim`` says)."""
        return self.heads * self.head_width

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection's output: ``kv_heads x head_dim``."""
        return self.key_value_heads * self.head_width

    @property
    def qkv_width(self) -> int:
        """Outputs of the fused query/key/value projection: ``attention_width`` for the queries, 2 x ``kv_width`` for
        keys and values."""
        return self.attention_width + 2 * self.kv_width

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias


def _llama_ffn(hidden: int) -> int:
    """LLaMA's MLP width: 2/3 of 4h, rounded up to a multiple of 256 (11008 for h=4096)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


_ROTARY = dict(gated=True, bias=False, learned_positions=False, tied=False)
"""LLaMA-family blocks: RMSNorm, SwiGLU, no biases, rotary positions, an untied head."""

TRANSFORMERS = MappingProxyType(
    {
        "gpt2": GPTConfig(layers=12, hidden=768, heads=12),  # 124M
        "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16),  # 355M
        "gpt2-large": GPTConfig(layers=36, hidden=1280, heads=20),  # 774M
        "gpt2-xl": GPTConfig(layers=48, hidden=1600, heads=25),  # 1.56B
        "llama-7b": GPTConfig(
            layers=32, hidden=4096, heads=32, seq_len=2048, vocab=32000, ffn=_llama_ffn(4096), **_ROTARY
        ),  # 6.74B
        # Brown et al. 2020, table 2.1: GPT-2's blocks at 96 x 12288, 2048 tokens
        "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, seq_len=2048),  # 174.6B
        # Dubey et al. 2024 ("The Llama 3 Herd of Models"), table 3; vocabulary 128256 as in the released config.json
        "llama3-8b": GPTConfig(
            layers=32, hidden=4096, heads=32, kv_heads=8, seq_len=8192, vocab=128256, ffn=14336, **_ROTARY
        ),  # 8.03B
        "llama3-70b": GPTConfig(
            layers=80, hidden=8192, heads=64, kv_heads=8, seq_len=8192, vocab=128256, ffn=28672, **_ROTARY
        ),  # 70.6B
        "llama3-405b": GPTConfig(
            layers=126, hidden=16384, heads=128, kv_heads=8, seq_len=8192, vocab=128256, ffn=53248, **_ROTARY
        ),  # 405.9B
        # Jiang et al. 2023 ("Mistral 7B"), table 1 (its 4096-token sliding window is not modelled: full attention)
        "mistral-7b": GPTConfig(
            layers=32, hidden=4096, heads=32, kv_heads=8, seq_len=8192, vocab=32000, ffn=14336, **_ROTARY
        ),  # 7.24B
        # Yang et al. 2024 ("Qwen2 Technical Report"), table 1; Qwen2-7B's config.json: biases on q, k, v alone
        "qwen2-7b": GPTConfig(
            layers=28,
            hidden=3584,
            heads=28,
            kv_heads=4,
            seq_len=4096,
            vocab=152064,
            ffn=18944,
            qkv_bias=True,
            **_ROTARY,
        ),  # 7.62B
        # Jiang et al. 2024 ("Mixtral of Experts"), table 1, and mistralai/Mixtral-8x7B-v0.1's config.json: Mistral 7B's
        # blocks with 8 experts of SwiGLU 14336, top 2, trained at 32k tokens
        "mixtral-8x7b": GPTConfig(
            layers=32,
            hidden=4096,
            heads=32,
            kv_heads=8,
            seq_len=32768,
            vocab=32000,
            moe=MoE(experts=8, top_k=2, ffn=14336),
            **_ROTARY,
        ),  # 46.7B, 12.9B active
        # Qwen/Qwen3-30B-A3B's config.json (Qwen3 Technical Report, 2025, table 2): 128 experts of 768, top 8, no shared
        # expert; 32 query heads of 128 over a 2048-wide stream, query/key norms; its 4096-token general pre-training
        "qwen3-30b-a3b": GPTConfig(
            layers=48,
            hidden=2048,
            heads=32,
            kv_heads=4,
            head_dim=128,
            qk_norm=True,
            seq_len=4096,
            vocab=151936,
            moe=MoE(experts=128, top_k=8, ffn=768),
            **_ROTARY,
        ),  # 30.5B, 3.3B active
        # openai/gpt-oss-20b's config.json (OpenAI 2025, "gpt-oss-120b & gpt-oss-20b Model Card", table 1): 32 experts
        # of 2880, top 4, biases on q, k, v, the router and the experts; 64 heads of 64 over 2880; the 4096-token
        # pre-training context (rope_scaling's original_max_position_embeddings). Not modelled: the alternating
        # 128-token sliding window, the attention output's bias and the attention sinks (71K parameters)
        "gpt-oss-20b": GPTConfig(
            layers=24,
            hidden=2880,
            heads=64,
            kv_heads=8,
            head_dim=64,
            seq_len=4096,
            vocab=201088,
            qkv_bias=True,
            moe=MoE(experts=32, top_k=4, ffn=2880, bias=True),
            **_ROTARY,
        ),  # 20.9B, 3.6B active
    }
)
"""The named sizes planned in closed form: GPT-2's four published sizes, a LLaMA-7B-like shape, GPT-3 175B, the
grouped-query families (Llama 3, Mistral, Qwen2) and three mixtures of experts (Mixtral 8x7B, Qwen3-30B-A3B,
GPT-OSS-20B) at their published shapes, each with its pre-training context. tests/planner/test_planner_presets.py
holds each dense count within 1% of the published one, and each MoE's total and active counts within 2%."""


def transformer_params(cfg: GPTConfig) -> dict[str, int]:
    """Exact parameter counts of ``workloads.gpt.GPT(cfg)`` by part: embedding, the first block, head (final norm
    and, when untied, the output matrix), what tensor parallelism splits of the first block (all but its norms, the
    row-parallel layers' biases, which are added after the reduction, and an MoE's router and routed experts), the
    routed experts of every MoE block (``experts``) and the parameters one token uses (``active``: all but the
    experts it skips). Each block's own: ``block_params``."""
    blocks = block_params(cfg)
    embedding = cfg.vocab * cfg.hidden + (cfg.seq_len * cfg.hidden if cfg.learned_positions else 0)
    head = (2 * cfg.hidden if cfg.bias else cfg.hidden) + (0 if cfg.tied else cfg.vocab * cfg.hidden)
    total = embedding + sum(n for n, _, _ in blocks) + head
    idle = 0 if cfg.moe is None else idle_params(cfg.moe, cfg.hidden, cfg.gated)
    return {
        "embedding": embedding,
        "block": blocks[0][0],
        "head": head,
        "total": total,
        "block_split": blocks[0][1],
        "experts": sum(x for _, _, x in blocks),
        "active": total - idle * sum(1 for _, _, x in blocks if x),
    }


def moe_block(cfg: GPTConfig, index: int) -> bool:
    """Whether block ``index`` is a mixture of experts (else a dense MLP of ``cfg.ffn``)."""
    return cfg.moe is not None and index not in cfg.moe.dense_layers


def block_params(cfg: GPTConfig) -> tuple[tuple[int, int, int], ...]:
    """Per block: (parameters, what tensor parallelism splits, routed experts)."""
    h, f, q, att = cfg.hidden, cfg.ffn_width, cfg.qkv_width, cfg.attention_width
    b = int(cfg.bias)
    norm = 2 * h if cfg.bias else h
    qk_norms = 2 * cfg.head_width * cfg.qk_norm
    attention = h * q + q * cfg.has_qkv_bias + att * h + h * b
    fc = 2 * f if cfg.gated else f
    dense = (h * fc + fc * b + f * h + h * b, h * fc + fc * b + f * h, 0)
    sparse = (
        dense if cfg.moe is None else (lambda r, o, sp: (r + o, sp, r))(*mlp_params(cfg.moe, h, cfg.gated, cfg.bias))
    )
    out = []
    for i in range(cfg.layers):
        mlp, split, routed = sparse if moe_block(cfg, i) else dense
        out.append((2 * norm + qk_norms + attention + mlp, attention - h * b + split, routed))
    return tuple(out)


def transformer_tensors(cfg: GPTConfig, block: int | None = None) -> tuple[int, ...]:
    """Sizes of ``workloads.gpt.GPT(cfg)``'s parameter tensors (``ModelStats.tensors``): the embedding tables,
    each block's norms, QKV (query and key/value apart under grouped-query attention), projection, MLP in and out
    with their biases (an MoE block's: ``moe.mlp_tensors``), the final norm and an untied head. ``block``: a
    block's parameters when ``--params`` overrides the count (each block tensor scaled to it). transformers'
    models split some of these further (Llama's q, k, v; gate and up): what matters to ZeRO-1's busiest rank is
    the largest tensors, which agree."""
    h, f, v, q, att = cfg.hidden, cfg.ffn_width, cfg.vocab, cfg.qkv_width, cfg.attention_width
    b = int(cfg.bias)
    norm = (h, h) if cfg.bias else (h,)
    fc = 2 * f if cfg.gated else f
    attention = (h * q,) if cfg.key_value_heads == cfg.heads else (h * att, h * (q - att))
    attend = (
        *norm,
        *attention,
        *(q,) * cfg.has_qkv_bias,
        *(cfg.head_width,) * (2 * cfg.qk_norm),
        att * h,
        *(h,) * b,
        *norm,
    )
    dense = (h * fc, *(fc,) * b, f * h, *(h,) * b)
    sparse = dense if cfg.moe is None else mlp_tensors(cfg.moe, h, cfg.gated, cfg.bias)
    if block is not None:
        whole = sum(attend) + sum(dense)
        attend, dense = (tuple(max(1, t * block // whole) for t in part) for part in (attend, dense))
    blocks = tuple(t for i in range(cfg.layers) for t in (*attend, *(sparse if moe_block(cfg, i) else dense)))
    embedding = (v * h, *(cfg.seq_len * h,) * cfg.learned_positions)
    return (*embedding, *blocks, *norm, *(v * h,) * (not cfg.tied))


def transformer_activations(cfg: GPTConfig, *, residual: int, act: int, experts: bool = False) -> tuple[float, float]:
    """Bytes autograd saves per sample for ``workloads.gpt.GPT(cfg)``: (one block, everything outside the blocks);
    ``experts``: an MoE block's (its MLP: ``moe.mlp_activations``).

    ``residual`` is the element size of the residual stream and the norms, ``act`` that of the matrix products'
    inputs and outputs: 4 and 4 in fp32, 4 and 2 under autocast, 2 and 2 with FSDP's 16-bit parameters.
    Counted from what each operation saves, and equal to ``saved_tensors_hooks``' count on the real module
    (tests/planner/test_planner_stats.py). A block (s tokens, width h, MLP width f, a heads) keeps its input x, the
    input and output of the QKV projection (h + 2·kv_heads·head_dim wide: the fused kernels take grouped keys and values
    as they are, ``enable_gqa``), the attention output (the projection reads it in place) and a log-sum-exp of
    a·s fp32 values (``scaled_dot_product_attention``'s fused kernels store no s x s scores), the residual after
    attention, the MLP's input, its inner activation and its activation function's output (SwiGLU: gate and up,
    the SiLU output and the product); LayerNorm two fp32 statistics per token, RMSNorm its normalised input and one
    per token. Query/key norms keep the normalised product and one statistic per head, and hand attention new
    queries and keys: act·s·(2·(heads + kv_heads)·head_dim + heads + kv_heads). Outside the blocks: the final
    norm's input, the head's input, log-softmax's fp32 output for the loss (4·V per token), the token ids and the
    targets.
    """
    s, h, a, f, v = cfg.seq_len, cfg.hidden, cfg.heads, cfg.ffn_width, cfg.vocab
    norm = 8 * s if cfg.bias else residual * s * h + residual * s  # LayerNorm: mean, rstd; RMSNorm: x·r and r
    if experts and cfg.moe is not None:
        mlp = s * mlp_activations(cfg.moe, h, cfg.gated, act=act)
    else:
        mlp = act * s * f * (4 if cfg.gated else 2)
    heads = a + cfg.key_value_heads
    qk_norms = act * s * (2 * cfg.head_width * heads + heads) if cfg.qk_norm else 0
    block = (
        residual * s * h
        + norm
        + act * s * h
        + act * s * cfg.qkv_width
        + qk_norms
        + act * s * cfg.attention_width
        + 4 * a * s
        + residual * s * h
        + norm
        + act * s * h
        + mlp
    )
    outside = residual * s * h + norm + act * s * h + 4 * s * v + 16 * s
    return float(block), float(outside)


def transformer_stats(cfg: GPTConfig, *, name: str, params: int | None = None) -> ModelStats:
    """Stats of a decoder-only transformer from its shape alone.

    FLOPs per sample (s tokens): ``6·N·s + 12·L·a·d·s²`` — 6 FLOPs per matmul weight a token uses, forward and
    backward (Kaplan et al. 2020), plus the attention scores and weighted sum over a heads of width d (PaLM,
    Chowdhery et al. 2022, appendix B); N leaves out embedding lookups, which do no matmul, and the experts of an
    MoE block a token skips (N is the active count). Within 1% of ``FlopCounterMode``.

    Activations: ``transformer_activations`` for fp32, autocast and 16-bit parameters. For GPT-2 shapes a block
    keeps 64·s·h bytes in fp32 and 36·s·h under autocast, where Korthikanti et al. (2022, eq. 1) count
    ``s·h·(34 + 5·a·s/h)`` for 16-bit training that stores the attention scores. With every block
    checkpointed: each block's input plus the largest block's activations during its recompute (same paper,
    section 5).

    An untied token embedding of at least ``TABLE_MIN_NUMEL`` elements is a table under ``Parallel("ps")``
    (looked up ``s`` times a sample); a tied one stays dense (the head reads every row).

    ``params`` replaces the exact count of a dense shape (``--params 7.5B``); the blocks then share what the
    embedding and head leave.
    """
    counts, blocks = transformer_params(cfg), block_params(cfg)
    h, s, n_layers, v = cfg.hidden, cfg.seq_len, cfg.layers, cfg.vocab
    sizes, splits = tuple(n for n, _, _ in blocks), tuple(t for _, t, _ in blocks)
    total = counts["total"] if params is None else params
    if params is not None:
        if cfg.moe is not None:
            raise ConfigError(
                "--params sizes a dense transformer; a mixture of experts is counted from its shape: drop --params"
            )
        block = (params - counts["embedding"] - counts["head"]) // n_layers
        if block < 1:
            raise ConfigError(
                f"--params {params:,} leaves nothing for {n_layers} layers after the "
                f"{counts['embedding'] + counts['head']:,}-parameter embedding and head; "
                "lower --vocab/--hidden or raise --params"
            )
        sizes, splits = (block,) * n_layers, (counts["block_split"] * block // counts["block"],) * n_layers
    non_matmul = (s * h if cfg.learned_positions else 0) + (0 if cfg.tied else v * h)
    attention_flops = 12 * n_layers * cfg.attention_width * s * s
    flops = 6 * (total - (counts["total"] - counts["active"]) - non_matmul) * s + attention_flops
    experts = [i for i in range(n_layers) if moe_block(cfg, i)]
    units = (
        ("embedding", counts["embedding"]),
        *((f"blocks.{i}", n) for i, n in enumerate(sizes)),
        ("head", counts["head"]),
    )

    def figures(residual: int, act: int) -> tuple[float, float, float]:
        (dense, sparse), outside = _block_activations(cfg, residual, act)
        per_block = [sparse if i in experts else dense for i in range(n_layers)]
        return (
            sum(per_block) + outside,
            n_layers * residual * s * h + max(per_block) + outside,
            float(residual * s * h),
        )

    def op_saved(residual: int, act: int) -> float:
        """Per-sample bytes kept under per-operation selective AC (torchtitan's "op" policy): each block's input,
        every other matrix product's output (half of QKV, attention-out, MLP-in and MLP-out's outputs) and the
        attention kernel's output and log-sum-exp; outside the blocks as without AC."""
        _, outside = transformer_activations(cfg, residual=residual, act=act)
        kept = sum(
            residual * s * h
            + act * s * (cfg.qkv_width + h + _mlp_outputs(cfg, i in experts)) / 2
            + act * s * cfg.attention_width
            + 4 * cfg.heads * s
            for i in range(n_layers)
        )
        return kept + outside

    fp32 = figures(*ELEMENT_BYTES["fp32"])
    tp = TPShape(
        layers=n_layers, hidden=h, seq_len=s, divides=_tp_divides(cfg), split=(v * h, *splits, 0 if cfg.tied else v * h)
    )
    moe = (
        None
        if cfg.moe is None
        else MoEShape(
            experts=cfg.moe.experts,
            top_k=cfg.moe.top_k,
            layers=len(experts),
            hidden=h,
            seq_len=s,
            unit_experts=(0, *(x for _, _, x in blocks), 0),
            active=counts["active"],
            whole=len(experts) * mlp_params(cfg.moe, h, cfg.gated, cfg.bias)[1],
            mlp_activations={
                mode: len(experts) * s * mlp_activations(cfg.moe, h, cfg.gated, act=ELEMENT_BYTES[mode][1])
                for mode in ("fp32", "autocast", "param_dtype")
            },
        )
    )
    return ModelStats(
        name=name,
        params=total,
        units=units,
        largest_layer=_largest_layer(cfg, blocks),
        flops_per_sample=float(flops),
        attention_flops_per_sample=float(attention_flops),
        activation_bytes_per_sample=fp32[0],
        checkpointed_bytes_per_sample=fp32[1],
        boundary_bytes_per_sample=fp32[2],
        mixed={mode: figures(*ELEMENT_BYTES[mode]) for mode in ("autocast", "param_dtype")},
        op_checkpointed={mode: op_saved(*ELEMENT_BYTES[mode]) for mode in ("fp32", "autocast", "param_dtype")},
        matmul_params=_matmul_params(cfg),
        tp=tp,
        cut_between_blocks=True,
        pipeline_stages=n_layers,
        cp=CPShape(layers=n_layers, seq_len=s, heads=cfg.heads, kv_heads=cfg.key_value_heads, head_dim=cfg.head_width),
        pipeline_copy=v * h if cfg.tied else 0,
        output_bytes_per_sample=4.0 * s * v,
        largest_activation_bytes_per_sample=4.0 * s * _widest(cfg, bool(experts)),
        param_bytes={"float32": 4 * total},
        tensors=transformer_tensors(cfg, None if params is None else sizes[0]),
        moe=moe,
        tables=(TableStats(name="wte", rows=v, dim=h, lookups_per_sample=s),)
        if not cfg.tied and v * h >= TABLE_MIN_NUMEL
        else (),
        source=f"closed-form transformer ({_describe(cfg)})",
    )


def _block_activations(cfg: GPTConfig, residual: int, act: int) -> tuple[tuple[float, float], float]:
    """((a dense block's, an MoE block's) activations, everything outside the blocks), per sample."""
    dense, outside = transformer_activations(cfg, residual=residual, act=act)
    sparse = transformer_activations(cfg, residual=residual, act=act, experts=True)[0]
    return (dense, sparse), outside


def _mlp_outputs(cfg: GPTConfig, experts: bool) -> int:
    """Elements a token's MLP matrix products output: fc and out, or an MoE's router, its k experts' two and the
    shared experts' two."""
    g = 2 if cfg.gated else 1
    if not experts or cfg.moe is None:
        return g * cfg.ffn_width + cfg.hidden
    m = cfg.moe
    return m.experts + m.top_k * (g * m.ffn + cfg.hidden) + (g * m.shared + cfg.hidden if m.shared else 0)


def _matmul_params(cfg: GPTConfig) -> int:
    """Weights of the matrix products (what autocast copies to 16 bits): attention, MLPs (every expert of an MoE
    block), the head's (possibly tied) weight."""
    h, g = cfg.hidden, 2 if cfg.gated else 1
    attention = h * cfg.qkv_width + cfg.attention_width * h
    dense = (g + 1) * cfg.ffn_width * h
    sparse = (
        dense
        if cfg.moe is None
        else (
            cfg.moe.experts * h
            + cfg.moe.experts * (g + 1) * cfg.moe.ffn * h
            + (g + 1) * cfg.moe.shared * h
            + h * cfg.moe.shared_gate
        )
    )
    return sum(attention + (sparse if moe_block(cfg, i) else dense) for i in range(cfg.layers)) + cfg.vocab * h


def _widest(cfg: GPTConfig, experts: bool) -> int:
    """Elements per token of the largest tensor a block saves: an MLP's inner activation (dense, a token's k routed
    experts' together, or the shared experts')."""
    g = 2 if cfg.gated else 1
    dense = g * cfg.ffn_width if cfg.moe is None or len(cfg.moe.dense_layers) else 0
    if not experts or cfg.moe is None:
        return dense
    return max(dense, routed_width(cfg.moe, cfg.gated), g * cfg.moe.shared)


def _largest_layer(cfg: GPTConfig, blocks: tuple[tuple[int, int, int], ...]) -> tuple[str, int]:
    """The module holding the most parameters directly: the token table, a QKV or MLP matrix, the head, or an MoE
    block's experts (its fused expert tensors)."""
    h, q = cfg.hidden, cfg.qkv_width
    fc = (2 if cfg.gated else 1) * cfg.ffn_width
    layers = [("wte", cfg.vocab * h), ("blocks.0.qkv", h * q + q * cfg.has_qkv_bias)]
    dense = [i for i in range(cfg.layers) if not moe_block(cfg, i)]
    if dense:
        layers.append((f"blocks.{dense[0]}.fc", h * fc + fc * cfg.bias))
    routed = [(i, x) for i, (_, _, x) in enumerate(blocks) if x]
    if routed:
        layers.append((f"blocks.{routed[0][0]}.moe.experts", routed[0][1]))
    if not cfg.tied:
        layers.append(("head", cfg.vocab * h))
    return max(layers, key=lambda x: x[1])


def _describe(cfg: GPTConfig) -> str:
    """The shape in words, for a plan's model line."""
    kv, m = cfg.key_value_heads, cfg.moe
    experts = (
        ""
        if m is None
        else (
            f", MoE {m.experts} experts (top {m.top_k}, width {m.ffn})"
            + (f" + shared {m.shared}" if m.shared else "")
            + (f" in {cfg.layers - len(m.dense_layers)} of {cfg.layers} blocks" if m.dense_layers else "")
        )
    )
    return (
        f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads"
        + (f" ({kv} key/value)" if kv != cfg.heads else "")
        + (f" of {cfg.head_dim}" if cfg.head_dim is not None else "")
        + f", seq {cfg.seq_len}, vocab {cfg.vocab}"
        + (f", MLP {cfg.ffn_width}" if cfg.ffn is not None else "")
        + (", SwiGLU" if cfg.gated else "")
        + experts
        + ("" if cfg.tied else ", untied head")
    )


def _tp_divides(cfg: GPTConfig) -> tuple[tuple[str, int], ...]:
    """What a tensor-parallel degree must divide: whole query heads per rank, whole key/value heads (each rank
    keeps the groups of its query heads, as Megatron's ``num_query_groups``), whole MLP units (of the dense MLPs
    and the shared experts; routed experts are not split)."""
    kv = (("key/value heads", cfg.key_value_heads),) if cfg.key_value_heads != cfg.heads else ()
    dense = cfg.moe is None or bool(cfg.moe.dense_layers)
    mlp = (("MLP width", cfg.ffn_width),) if dense else ()
    shared = (("shared expert width", cfg.moe.shared),) if cfg.moe is not None and cfg.moe.shared else ()
    return (("heads", cfg.heads), *kv, *mlp, *shared)


def transformer_shape(
    params: float,
    *,
    layers: int | None = None,
    hidden: int | None = None,
    heads: int | None = None,
    seq_len: int = 2048,
    vocab: int = 50257,
) -> GPTConfig:
    """A plausible GPT shape for ``params`` parameters when only some figures are known.

    Uses N ≈ 12·L·h² (a block's four h×h-equivalent matrices and its 4h MLP) for the missing one, and when
    both are missing the aspect ratio h ≈ 128·L of GPT-3's family, with h a multiple of 128 and 128-wide heads.
    """
    if params <= 0:
        raise ConfigError(f"--params must be > 0, got {params:g}")
    if hidden is None and layers is None:
        layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    if hidden is None:
        hidden = max(128, 128 * round((params / (12 * layers)) ** 0.5 / 128))
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    if heads is None:
        heads = max(1, hidden // 128) if hidden % 128 == 0 else 1
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab)
