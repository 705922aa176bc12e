"""A transformers checkpoint's ``config.json`` as a planner shape (``paratrain plan --model-config PATH``).

Read as JSON from disk, with no transformers import and no hub access: the families whose blocks the closed forms
describe exactly (llama, mistral, qwen2: RMSNorm, SwiGLU, grouped-query attention, rotary positions; gpt2:
LayerNorm, GELU, biases, learned positions). Keys missing from the file take the defaults of transformers' config
class for that model type (``LlamaConfig``, ``GPT2Config``, ...), as ``AutoConfig`` would.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .transformer import GPTConfig

ROTARY_TYPES = ("llama", "mistral", "qwen2")
SUPPORTED = (*ROTARY_TYPES, "gpt2")


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
        raise ConfigError(f"--model-config {path}: model_type {kind!r} is not planned in closed form (supported: "
                          f"{', '.join(SUPPORTED)}); plan it with --model module:factory")
    try:
        return _gpt2(raw) if kind == "gpt2" else _rotary(raw, kind, path)
    except (KeyError, TypeError, ValueError) as e:
        raise ConfigError(f"--model-config {path}: {kind} config without a usable {e}; "
                          "give the config.json a checkpoint was saved with") from None


def _load(path: Path) -> dict[str, Any]:
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--model-config {path}: no such file; give a config.json or the directory holding "
                          "one") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model-config {path}: not a transformers config.json ({type(e).__name__}); give "
                          "the config.json of a llama, mistral, qwen2 or gpt2 checkpoint") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ConfigError(f"--model-config {path}: not a transformers config.json (no model_type); give the "
                          "config.json of a llama, mistral, qwen2 or gpt2 checkpoint")
    return raw


def _rotary(raw: dict[str, Any], kind: str, path: str | Path) -> GPTConfig:
    """llama, mistral and qwen2: no biases but Qwen2's on q, k and v (``Qwen2Attention``); an untied head unless
    ``tie_word_embeddings`` says otherwise (their config classes default it to False)."""
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if raw.get("attention_bias") or raw.get("mlp_bias"):
        raise ConfigError(f"--model-config {path}: attention_bias/mlp_bias are not planned in closed form; "
                          "plan it with --model module:factory")
    head_dim = raw.get("head_dim")
    if head_dim is not None and int(head_dim) * heads != hidden:
        raise ConfigError(f"--model-config {path}: head_dim {head_dim} x {heads} heads != hidden_size {hidden}; "
                          "the closed forms take head_dim = hidden / heads: plan it with --model module:factory")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"--model-config {path}: hidden_act {raw['hidden_act']!r}: the closed forms plan a "
                          "SwiGLU MLP (silu) for this family")
    scaling = raw.get("rope_scaling") or {}
    context = scaling.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048)
    return GPTConfig(layers=int(raw["num_hidden_layers"]), hidden=hidden, heads=heads,
                     kv_heads=int(raw.get("num_key_value_heads") or heads), seq_len=int(context),
                     vocab=int(raw["vocab_size"]), ffn=int(raw["intermediate_size"]), gated=True, bias=False,
                     learned_positions=False, tied=bool(raw.get("tie_word_embeddings", False)),
                     qkv_bias=kind == "qwen2")


def _gpt2(raw: dict[str, Any]) -> GPTConfig:
    """GPT-2's keys and ``GPT2Config``'s defaults (the 124M model)."""
    hidden = int(raw.get("n_embd", 768))
    return GPTConfig(layers=int(raw.get("n_layer", 12)), hidden=hidden, heads=int(raw.get("n_head", 12)),
                     seq_len=int(raw.get("n_positions", 1024)), vocab=int(raw.get("vocab_size", 50257)),
                     ffn=int(raw.get("n_inner") or 4 * hidden), tied=bool(raw.get("tie_word_embeddings", True)))
