"""Decoder-only transformers in closed form: their shape, the named sizes ``paratrain plan --model`` knows, and
the parameters, FLOPs and activations of a shape, in milliseconds and with no module built.

The shapes are pure data, so the planner plans GPT-2 or a 7B model without importing a model;
``workloads.gpt.GPT`` builds the same shapes for real, and tests/planner/test_planner_stats.py holds the counts here equal to
that module's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

from ..errors import ConfigError
from ..model.tables import TABLE_MIN_NUMEL
from .model_stats import ELEMENT_BYTES, ModelStats, TableStats, TPShape


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

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "seq_len", "vocab", "kv_heads", "ffn"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"transformer {name} must be >= 1, got {value}")
        if self.hidden % self.heads:
            raise ConfigError(f"hidden {self.hidden} is not divisible by heads {self.heads}: each head takes "
                              "hidden / heads of the width; give --heads that divides --hidden")
        if self.heads % self.key_value_heads:
            raise ConfigError(f"heads {self.heads} is not divisible by kv_heads {self.key_value_heads}: each key/value "
                              "head serves a whole group of query heads; give --kv-heads that divides --heads")

    @property
    def ffn_width(self) -> int:
        return self.ffn if self.ffn is not None else 4 * self.hidden

    @property
    def key_value_heads(self) -> int:
        return self.kv_heads if self.kv_heads is not None else self.heads

    @property
    def kv_width(self) -> int:
        """Width of the key (and of the value) projection's output: ``kv_heads x head_dim``."""
        return self.key_value_heads * (self.hidden // self.heads)

    @property
    def qkv_width(self) -> int:
        """Outputs of the fused query/key/value projection: h for the queries, 2 x ``kv_width`` for keys and values."""
        return self.hidden + 2 * self.kv_width

    @property
    def has_qkv_bias(self) -> bool:
        return self.bias if self.qkv_bias is None else self.qkv_bias


def _llama_ffn(hidden: int) -> int:
    """LLaMA's MLP width: 2/3 of 4h, rounded up to a multiple of 256 (11008 for h=4096)."""
    return 256 * math.ceil(8 * hidden / 3 / 256)


_ROTARY = dict(gated=True, bias=False, learned_positions=False, tied=False)
"""LLaMA-family blocks: RMSNorm, SwiGLU, no biases, rotary positions, an untied head."""

TRANSFORMERS = MappingProxyType({
    "gpt2": GPTConfig(layers=12, hidden=768, heads=12),                  # 124M
    "gpt2-medium": GPTConfig(layers=24, hidden=1024, heads=16),          # 355M
    "gpt2-large": GPTConfig(layers=36, hidden=1280, heads=20),           # 774M
    "gpt2-xl": GPTConfig(layers=48, hidden=1600, heads=25),              # 1.56B
    "llama-7b": GPTConfig(layers=32, hidden=4096, heads=32, seq_len=2048, vocab=32000, ffn=_llama_ffn(4096),
                          **_ROTARY),  # 6.74B
    # Brown et al. 2020, table 2.1: GPT-2's blocks at 96 x 12288, 2048 tokens
    "gpt3-175b": GPTConfig(layers=96, hidden=12288, heads=96, seq_len=2048),  # 174.6B
    # Dubey et al. 2024 ("The Llama 3 Herd of Models"), table 3; vocabulary 128256 as in the released config.json
    "llama3-8b": GPTConfig(layers=32, hidden=4096, heads=32, kv_heads=8, seq_len=8192, vocab=128256, ffn=14336,
                           **_ROTARY),  # 8.03B
    "llama3-70b": GPTConfig(layers=80, hidden=8192, heads=64, kv_heads=8, seq_len=8192, vocab=128256, ffn=28672,
                            **_ROTARY),  # 70.6B
    "llama3-405b": GPTConfig(layers=126, hidden=16384, heads=128, kv_heads=8, seq_len=8192, vocab=128256,
                             ffn=53248, **_ROTARY),  # 405.9B
    # Jiang et al. 2023 ("Mistral 7B"), table 1 (its 4096-token sliding window is not modelled: full attention)
    "mistral-7b": GPTConfig(layers=32, hidden=4096, heads=32, kv_heads=8, seq_len=8192, vocab=32000, ffn=14336,
                            **_ROTARY),  # 7.24B
    # Yang et al. 2024 ("Qwen2 Technical Report"), table 1; Qwen2-7B's config.json: biases on q, k, v alone
    "qwen2-7b": GPTConfig(layers=28, hidden=3584, heads=28, kv_heads=4, seq_len=4096, vocab=152064, ffn=18944,
                          qkv_bias=True, **_ROTARY),  # 7.62B
})
"""The named sizes planned in closed form: GPT-2's four published sizes, a LLaMA-7B-like shape, GPT-3 175B and the
grouped-query families (Llama 3, Mistral, Qwen2) at their published shapes, each with its pre-training context.
tests/planner/test_planner_presets.py holds each count within 1% of the published one."""


def transformer_params(cfg: GPTConfig) -> dict[str, int]:
    """Exact parameter counts of ``workloads.gpt.GPT(cfg)`` by part: embedding, one block, head (final norm
    and, when untied, the output matrix), and what tensor parallelism splits of a block (all but its norms and
    the row-parallel layers' biases, which are added after the reduction)."""
    h, f, v, q = cfg.hidden, cfg.ffn_width, cfg.vocab, cfg.qkv_width
    b = int(cfg.bias)
    norm = 2 * h if cfg.bias else h
    fc = 2 * f if cfg.gated else f
    block = 2 * norm + (h * q + q * cfg.has_qkv_bias) + (h * h + h * b) + (h * fc + fc * b) + (f * h + h * b)
    embedding = v * h + (cfg.seq_len * h if cfg.learned_positions else 0)
    head = norm + (0 if cfg.tied else v * h)
    return {"embedding": embedding, "block": block, "head": head, "total": embedding + cfg.layers * block + head,
            "block_split": block - 2 * norm - 2 * h * b}


def transformer_tensors(cfg: GPTConfig, block: int | None = None) -> tuple[int, ...]:
    """Sizes of ``workloads.gpt.GPT(cfg)``'s parameter tensors (``ModelStats.tensors``): the embedding tables,
    each block's norms, QKV (query and key/value apart under grouped-query attention), projection, MLP in and out
    with their biases, the final norm and an untied head. ``block``: a block's parameters when ``--params``
    overrides the count (each block tensor scaled to it). transformers' models split some of these further
    (Llama's q, k, v; gate and up): what matters to ZeRO-1's busiest rank is the largest tensors, which agree."""
    h, f, v, q = cfg.hidden, cfg.ffn_width, cfg.vocab, cfg.qkv_width
    b = int(cfg.bias)
    norm = (h, h) if cfg.bias else (h,)
    fc = 2 * f if cfg.gated else f
    attention = (h * q,) if cfg.key_value_heads == cfg.heads else (h * h, h * (q - h))
    one = (*norm, *attention, *(q,) * cfg.has_qkv_bias, h * h, *(h,) * b, *norm, h * fc, *(fc,) * b, f * h,
           *(h,) * b)
    if block is not None:
        one = tuple(max(1, t * block // sum(one)) for t in one)
    embedding = (v * h, *(cfg.seq_len * h,) * cfg.learned_positions)
    return (*embedding, *one * cfg.layers, *norm, *(v * h,) * (not cfg.tied))


def transformer_activations(cfg: GPTConfig, *, residual: int, act: int) -> tuple[float, float]:
    """Bytes autograd saves per sample for ``workloads.gpt.GPT(cfg)``: (one block, everything outside the blocks).

    ``residual`` is the element size of the residual stream and the norms, ``act`` that of the matrix products'
    inputs and outputs: 4 and 4 in fp32, 4 and 2 under autocast, 2 and 2 with FSDP's 16-bit parameters.
    Counted from what each operation saves, and equal to ``saved_tensors_hooks``' count on the real module
    (tests/planner/test_planner_stats.py). A block (s tokens, width h, MLP width f, a heads) keeps its input x, the input
    and output of the QKV projection (h + 2·kv_heads·head_dim wide: the fused kernels take grouped keys and values
    as they are, ``enable_gqa``), the attention output (the projection reads it in place) and a log-sum-exp of
    a·s fp32 values (``scaled_dot_product_attention``'s fused kernels store no s x s scores), the residual after
    attention, the MLP's input, its inner activation and its activation function's output (SwiGLU: gate and up,
    the SiLU output and the product); LayerNorm two fp32 statistics per token, RMSNorm its normalised input and one
    per token. Outside the blocks: the final norm's input, the head's input, log-softmax's fp32 output for the
    loss (4·V per token), the token ids and the targets.
    """
    s, h, a, f, v = cfg.seq_len, cfg.hidden, cfg.heads, cfg.ffn_width, cfg.vocab
    norm = 8 * s if cfg.bias else residual * s * h + residual * s  # LayerNorm: mean, rstd; RMSNorm: x·r and r
    mlp = act * s * f * (4 if cfg.gated else 2)
    block = (residual * s * h + norm + act * s * h + act * s * cfg.qkv_width + act * s * h + 4 * a * s
             + residual * s * h + norm + act * s * h + mlp)
    outside = residual * s * h + norm + act * s * h + 4 * s * v + 16 * s
    return float(block), float(outside)


def transformer_stats(cfg: GPTConfig, *, name: str, params: int | None = None) -> ModelStats:
    """Stats of a decoder-only transformer from its shape alone.

    FLOPs per sample (s tokens): ``6·N·s + 12·L·h·s²`` — 6 FLOPs per matmul weight per token for forward and
    backward (Kaplan et al. 2020) plus the attention scores and weighted sum (PaLM, Chowdhery et al. 2022,
    appendix B); N leaves out embedding lookups, which do no matmul. Within 1% of ``FlopCounterMode``.

    Activations: ``transformer_activations`` for fp32, autocast and 16-bit parameters. For GPT-2 shapes a block
    keeps 64·s·h bytes in fp32 and 36·s·h under autocast, where Korthikanti et al. (2022, eq. 1) count
    ``s·h·(34 + 5·a·s/h)`` for 16-bit training that stores the attention scores. With every block
    checkpointed: each block's input plus one block's activations during its recompute (same paper, section 5).

    An untied token embedding of at least ``TABLE_MIN_NUMEL`` elements is a table under ``Parallel("ps")``
    (looked up ``s`` times a sample); a tied one stays dense (the head reads every row).

    ``params`` replaces the exact count (``--params 7.5B``); the blocks then share what the embedding and head
    leave.
    """
    counts = transformer_params(cfg)
    h, s, n_layers, v = cfg.hidden, cfg.seq_len, cfg.layers, cfg.vocab
    total = counts["total"] if params is None else params
    block = counts["block"]
    if params is not None:
        block = (params - counts["embedding"] - counts["head"]) // n_layers
        if block < 1:
            raise ConfigError(f"--params {params:,} leaves nothing for {n_layers} layers after the "
                              f"{counts['embedding'] + counts['head']:,}-parameter embedding and head; "
                              "lower --vocab/--hidden or raise --params")
    non_matmul = (s * h if cfg.learned_positions else 0) + (0 if cfg.tied else v * h)
    flops = 6 * (total - non_matmul) * s + 12 * n_layers * h * s * s
    fc = (2 if cfg.gated else 1) * cfg.ffn_width
    q = cfg.qkv_width
    layers = [("wte", v * h), ("blocks.0.qkv", h * q + q * cfg.has_qkv_bias),
              ("blocks.0.fc", h * fc + fc * cfg.bias)]
    if not cfg.tied:
        layers.append(("head", v * h))
    units = (("embedding", counts["embedding"]), *((f"blocks.{i}", block) for i in range(n_layers)),
             ("head", counts["head"]))
    kv = cfg.key_value_heads
    shape = (f"{n_layers} layers, hidden {h}, {cfg.heads} heads" + (f" ({kv} key/value)" if kv != cfg.heads else "")
             + f", seq {s}, vocab {v}" + (f", MLP {cfg.ffn_width}" if cfg.ffn is not None else "")
             + (", SwiGLU" if cfg.gated else "") + ("" if cfg.tied else ", untied head"))

    def figures(residual: int, act: int) -> tuple[float, float, float]:
        per_block, outside = transformer_activations(cfg, residual=residual, act=act)
        return (n_layers * per_block + outside, n_layers * residual * s * h + per_block + outside,
                float(residual * s * h))

    def op_saved(residual: int, act: int) -> float:
        """Per-sample bytes kept under per-operation selective AC (torchtitan's "op" policy): each block's input,
        every other matrix product's output (half of QKV, attention-out, MLP-in and MLP-out's outputs) and the
        attention kernel's output and log-sum-exp; outside the blocks as without AC."""
        _, outside = transformer_activations(cfg, residual=residual, act=act)
        matmul_outputs = cfg.qkv_width + h + fc + h
        block_kept = residual * s * h + act * s * matmul_outputs / 2 + act * s * h + 4 * cfg.heads * s
        return n_layers * block_kept + outside

    fp32 = figures(*ELEMENT_BYTES["fp32"])
    block_split = counts["block_split"] * block // counts["block"]
    tp = TPShape(layers=n_layers, hidden=h, seq_len=s, divides=_tp_divides(cfg),
                 split=(v * h, *(block_split,) * n_layers, 0 if cfg.tied else v * h))
    matmul = n_layers * (h * q + h * h + h * (fc + cfg.ffn_width)) + v * h  # the head's (possibly tied) weight
    return ModelStats(name=name, params=total, units=units, largest_layer=max(layers, key=lambda x: x[1]),
                      flops_per_sample=float(flops), attention_flops_per_sample=float(12 * n_layers * h * s * s),
                      activation_bytes_per_sample=fp32[0],
                      checkpointed_bytes_per_sample=fp32[1], boundary_bytes_per_sample=fp32[2],
                      mixed={mode: figures(*ELEMENT_BYTES[mode]) for mode in ("autocast", "param_dtype")},
                      op_checkpointed={mode: op_saved(*ELEMENT_BYTES[mode])
                                       for mode in ("fp32", "autocast", "param_dtype")},
                      matmul_params=matmul, tp=tp, cut_between_blocks=True, pipeline_copy=v * h if cfg.tied else 0,
                      output_bytes_per_sample=4.0 * s * v, largest_activation_bytes_per_sample=4.0 * s * fc,
                      param_bytes={"float32": 4 * total},
                      tensors=transformer_tensors(cfg, None if params is None else block),
                      tables=(TableStats(name="wte", rows=v, dim=h, lookups_per_sample=s),)
                      if not cfg.tied and v * h >= TABLE_MIN_NUMEL else (),
                      source=f"closed-form transformer ({shape})")


def _tp_divides(cfg: GPTConfig) -> tuple[tuple[str, int], ...]:
    """What a tensor-parallel degree must divide: whole query heads per rank, whole key/value heads (each rank
    keeps the groups of its query heads, as Megatron's ``num_query_groups``), whole MLP units."""
    kv = (("key/value heads", cfg.key_value_heads),) if cfg.key_value_heads != cfg.heads else ()
    return (("heads", cfg.heads), *kv, ("MLP width", cfg.ffn_width))


def transformer_shape(params: float, *, layers: int | None = None, hidden: int | None = None,
                      heads: int | None = None, seq_len: int = 2048, vocab: int = 50257) -> GPTConfig:
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
