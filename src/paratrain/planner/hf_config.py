"""A transformers checkpoint's ``config.json`` as a planner shape (``paratrain plan --model-config PATH``).

Read as JSON from disk, with no transformers import and no hub access: the families whose blocks the closed forms
describe exactly (llama, mistral, qwen2, qwen3: RMSNorm, SwiGLU, grouped-query attention, rotary positions; their
mixtures of experts mixtral, qwen2_moe, qwen3_moe; gpt2: LayerNorm, GELU, biases, learned positions). Keys missing
from the file take the defaults of transformers' config class for that model type (``LlamaConfig``,
``Qwen3MoeConfig``, ``GPT2Config``, ...), as ``AutoConfig`` would.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .moe import MoE
from .transformer import GPTConfig

MOE_DEFAULTS = {"mixtral": (8, 2, 14336, 0), "qwen2_moe": (60, 4, 1408, 5632), "qwen3_moe": (128, 8, 768, 0)}
"""The mixture-of-experts families, with their config classes' defaults: experts, top k, expert width, shared
width."""
ROTARY_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_DEFAULTS)
SUPPORTED = (*ROTARY_TYPES, "gpt2")
_GIVE = f"give the config.json of a {', '.join(SUPPORTED[:-1])} or {SUPPORTED[-1]} checkpoint"


def read_model_config(path: str | Path) -> GPTConfig:
    """The shape a ``config.json`` (or a checkpoint directory holding one) describes; a one-line ``ConfigError``
    for anything else. The context is the pre-training one when the file records it (Llama 3.1's
    ``rope_scaling.original_max_position_embeddings``), else ``max_position_embeddings``: ``--seq-len`` overrides."""
    return config_from_dict(_load(Path(path)), path)


def config_from_dict(raw: dict[str, Any], path: str | Path) -> GPTConfig:
    """``read_model_config`` of a config already read (a ``PretrainedConfig.to_dict()``); ``path`` names it in
    errors."""
    kind = raw.get("model_type")
    if kind not in SUPPORTED:
        raise ConfigError(
            f"--model-config {path}: model_type {kind!r} is not planned in closed form (supported: "
            f"{', '.join(SUPPORTED)}); plan it with --model module:factory"
        )
    try:
        return _gpt2(raw) if kind == "gpt2" else _rotary(raw, kind, path)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(
            f"--model-config {path}: {kind} config without a usable {e}; "
            "give the config.json a checkpoint was saved with"
        ) from None


def _load(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--model-config {path}: no such file; give a config.json or the directory holding one"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"--model-config {path}: not a transformers config.json ({type(e).__name__}); {_GIVE}"
        ) from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"--model-config {path}: not a transformers config.json (no model_type); {_GIVE}")
    return raw


def _rotary(raw: dict[str, Any], kind: str, path: str | Path) -> GPTConfig:
    """llama, mistral, qwen2, qwen3 and their mixtures of experts: no biases but Qwen2's on q, k and v
    (``Qwen2Attention``), Qwen3's query/key norms, the experts ``_moe`` reads; an untied head unless
    ``tie_word_embeddings`` says otherwise (their config classes default it to False)."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError(
            f"--model-config {path}: attention_bias/mlp_bias are not planned in closed form; "
            "plan it with --model module:factory"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(
            f"--model-config {path}: hidden_act {raw['hidden_act']!r}: the closed forms plan a "
            "SwiGLU MLP (silu) for this family"
        )
    scaling = raw.get("rope_scaling") or {}
    context = scaling.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048)
    layers, head_dim = int(raw["num_hidden_layers"]), raw.get("head_dim")
    return GPTConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=None if head_dim is None or int(head_dim) * heads == hidden else int(head_dim),
        qk_norm=kind.startswith("qwen3"),
        seq_len=int(context),
        vocab=int(raw["vocab_size"]),
        ffn=int(raw["intermediate_size"]),
        gated=True,
        bias=False,
        learned_positions=False,
        tied=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=kind.startswith("qwen2"),
        moe=_moe(raw, kind, layers),
    )


def _moe(raw: dict[str, Any], kind: str, layers: int) -> MoE | None:
    """The experts of a mixtral, qwen2_moe or qwen3_moe config (None for the dense families): Mixtral's experts
    are ``intermediate_size`` wide, Qwen's ``moe_intermediate_size``, and Qwen keeps a dense MLP in the blocks
    ``mlp_only_layers`` names and those ``decoder_sparse_step`` skips (as ``Qwen3MoeDecoderLayer`` decides);
    Qwen2-MoE adds a gated shared expert."""
    if kind not in MOE_DEFAULTS:
        return None
    experts, top_k, width, shared = MOE_DEFAULTS[kind]
    experts = int(raw.get("num_local_experts") or raw.get("num_experts") or experts)
    width = int(raw.get("intermediate_size" if kind == "mixtral" else "moe_intermediate_size") or width)
    shared = int(raw.get("shared_expert_intermediate_size", shared) or 0) if kind == "qwen2_moe" else 0
    step, only = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or ())
    dense = tuple(i for i in range(layers) if i in only or (i + 1) % step)
    return MoE(
        experts=experts,
        top_k=int(raw.get("num_experts_per_tok") or top_k),
        ffn=width,
        shared=shared,
        shared_gate=bool(shared),
        dense_layers=dense,
    )


def _gpt2(raw: dict[str, Any]) -> GPTConfig:
    """GPT-2's keys and ``GPT2Config``'s defaults (the 124M model)."""
    hidden = int(raw.get("n_embd", 768))
    return GPTConfig(
        layers=int(raw.get("n_layer", 12)),
        hidden=hidden,
        heads=int(raw.get("n_head", 12)),
        seq_len=int(raw.get("n_positions", 1024)),
        vocab=int(raw.get("vocab_size", 50257)),
        ffn=int(raw.get("n_inner") or 4 * hidden),
        tied=bool(raw.get("tie_word_embeddings", True)),
    )
