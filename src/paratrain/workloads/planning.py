"""What ``paratrain plan``'s model options name, resolved for the planner: a built-in GPT size, a demo model
(``mlp``, ``cnn``), ``module:factory``, or ``--params 7.5B``.

The planner plans what it is handed (``planner.make_plan``: stats, or a model it may build) and never imports the
demo models; the names that build one are this layer's to resolve.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

from torch import nn

from ..errors import ConfigError
from ..factory import load_callable
from ..planner import InputSpec, ModelStats, RunnableModel, transformer_shape, transformer_stats
from .digits import digits_cnn
from .gpt import GPT, GPT_CONFIGS
from .synthetic import mlp

SMALL_MODELS = MappingProxyType({"mlp": (mlp, "784"), "cnn": (digits_cnn, "1x8x8")})
"""Traced built-ins: factory and one sample's input."""


def model_names() -> list[str]:
    return [*SMALL_MODELS, *GPT_CONFIGS]


def parse_count(text: str) -> float:
    """``7.5B`` → 7.5e9; also K, M, T suffixes and plain numbers."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbt]?)\s*", text.lower())
    if not match:
        raise ConfigError(f"cannot read {text!r} as a parameter count; write e.g. 7.5B, 350M or 124000000")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}[match.group(2)]


def resolve_model(model: str | None = None, *, params: str | None = None, layers: int | None = None,
                  hidden: int | None = None, heads: int | None = None, seq_len: int | None = None,
                  vocab: int | None = None, input_spec: str | None = None) -> ModelStats | RunnableModel:
    """The model the CLI's model options name, as ``planner.make_plan`` takes it.

    ``--params`` gives closed-form stats (shape figures given, the rest guessed); a built-in GPT size a model with
    its closed-form stats (shape figures override the built-in ones); ``mlp``, ``cnn`` and ``module:factory`` a
    model the planner traces on the meta device. ``--measure`` runs any of the models.
    """
    if model is not None and params is not None:
        raise ConfigError("give --model or --params, not both")
    if model is None and params is None:
        raise ConfigError(f"give --model (one of {', '.join(model_names())}, or module:factory) or --params")
    shape = {k: v for k, v in dict(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab).items()
             if v is not None}
    if params is not None:
        n = parse_count(params)
        return transformer_stats(transformer_shape(n, **shape), name=f"{params} transformer", params=round(n))
    assert model is not None
    factory, example = model_input(model, shape=shape, input_spec=input_spec)
    stats = transformer_stats(replace(GPT_CONFIGS[model], **shape), name=model) if model in GPT_CONFIGS else None
    return RunnableModel(name=model, factory=factory, example=example, stats=stats)


def model_input(model: str, *, shape: dict[str, int] | None = None,
                input_spec: str | None = None) -> tuple[Callable[[], nn.Module], InputSpec]:
    """The factory of a model the CLI names and one sample's input (``--input``, or the built-in's own)."""
    shape, high = shape or {}, None
    if shape and model not in GPT_CONFIGS:
        raise ConfigError(f"--layers/--hidden/--heads/--seq-len/--vocab shape transformers; {model!r} is not one")
    if model in GPT_CONFIGS:
        cfg = replace(GPT_CONFIGS[model], **shape)
        factory, default_input, high = (lambda: GPT(cfg)), f"long:{cfg.seq_len}", cfg.vocab
    elif model in SMALL_MODELS:
        factory, default_input = SMALL_MODELS[model]
    elif ":" in model:
        factory, default_input = load_callable(model, "--model"), None
    else:
        raise ConfigError(f"unknown model {model!r}; choose one of: {', '.join(model_names())}, or module:factory")
    text = input_spec or default_input
    if text is None:
        raise ConfigError(f"--model {model} needs --input: one sample's shape, e.g. 3x224x224 or long:1024")
    return factory, replace(InputSpec.parse(text), high=high if input_spec is None else None)
