"""What ``paratrain plan``'s model options name, resolved for the planner: a built-in GPT size, a demo model
(``mlp``, ``cnn``), ``module:factory``, or ``--params 7.5B``.

The planner plans what it is handed (``planner.make_plan``: stats, or a model it may build) and never imports the
demo models; the names that build one are this layer's to resolve.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn

from ..errors import ConfigError
from ..factory import load_callable
from ..planner import (
    InputSpec,
    ModelSpec,
    ModelStats,
    RunnableModel,
    TrainingCall,
    transformer_shape,
    transformer_stats,
)
from ..planner.auto import closed_form_shape
from ..planner.hf_config import read_model_config
from ..strategies.split_shapes import runtime_splits
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


def resolve_model(spec: ModelSpec | str) -> ModelStats | RunnableModel:
    """The model ``spec`` names (a plain string: a model name), as ``planner.make_plan`` takes it.

    ``--params`` gives closed-form stats (shape figures given, the rest guessed); a built-in GPT size or a
    transformers ``config.json`` (``--model-config``) a model with its closed-form stats (shape figures override
    the named ones); ``mlp``, ``cnn`` and ``module:factory`` a model the planner traces on the meta device.
    ``--measure`` runs any of the models (a config's shape as ``workloads.gpt.GPT``). ``--targets``: how a model is
    called, as ``planner.TrainingCall.parse`` reads it.
    """
    spec = ModelSpec(model=spec) if isinstance(spec, str) else spec
    given = [
        flag
        for flag, value in (("--model", spec.model), ("--model-config", spec.model_config), ("--params", spec.params))
        if value is not None
    ]
    if len(given) > 1:
        raise ConfigError(f"give {' or '.join(given)}, not {'both' if len(given) == 2 else 'all three'}")
    if not given:
        raise ConfigError(
            f"give --model (one of {', '.join(model_names())}, or module:factory), --model-config or --params"
        )
    shape = spec.shape
    if spec.params is not None:
        n = parse_count(spec.params)
        guessed = {k: v for k, v in shape.items() if k in ("layers", "hidden", "heads", "seq_len", "vocab")}
        cfg = replace(transformer_shape(n, **guessed), **{k: v for k, v in shape.items() if k not in guessed})
        return transformer_stats(cfg, name=f"{spec.params} transformer", params=round(n))
    if spec.model_config is not None:
        return _from_config(spec)
    assert spec.model is not None
    factory, example = model_input(spec.model, shape=shape, input_spec=spec.input_spec)
    if spec.model in GPT_CONFIGS:
        stats = transformer_stats(replace(GPT_CONFIGS[spec.model], **shape), name=spec.model)
    else:
        stats = experts_in_closed_form(factory, spec.model, example) if ":" in spec.model else None
    call = TrainingCall.parse(example, spec.targets)
    splits = runtime_splits(factory, call) if stats is None else None  # traced: tp and cp as the runtime splits it
    return RunnableModel(name=spec.model, factory=factory, call=call, stats=stats, splits=splits)


def experts_in_closed_form(factory: Callable[[], nn.Module], name: str, example: InputSpec) -> ModelStats | None:
    """The closed-form stats of a mixture of experts whose ``config`` the closed forms read exactly (a transformers
    Mixtral, Qwen2-MoE or Qwen3-MoE: ``planner.auto.closed_form_shape``), at the input's length: routing needs
    real tensors, so such a model cannot be traced on the meta device. None for any other model, traced as before."""
    with torch.device("meta"):
        model = factory()
    cfg = closed_form_shape(model) if isinstance(model, nn.Module) else None
    if cfg is None or cfg.moe is None:
        return None
    tokens = example.shape[0] if example.is_ids and len(example.shape) == 1 else cfg.seq_len
    return transformer_stats(replace(cfg, seq_len=tokens), name=name)


def _from_config(spec: ModelSpec) -> RunnableModel:
    """A transformers ``config.json``'s model, as ``workloads.gpt.GPT`` builds its shape."""
    assert spec.model_config is not None
    cfg = replace(read_model_config(spec.model_config), **spec.shape)
    path = Path(spec.model_config)
    name = path.parent.name if path.name == "config.json" else path.name
    example = replace(
        InputSpec.parse(spec.input_spec or f"long:{cfg.seq_len}"), high=None if spec.input_spec else cfg.vocab
    )
    return RunnableModel(
        name=name,
        factory=lambda: GPT(cfg),
        call=TrainingCall.parse(example, spec.targets),
        stats=transformer_stats(cfg, name=name),
    )


def model_input(
    model: str, *, shape: dict[str, int | bool] | None = None, input_spec: str | None = None
) -> tuple[Callable[[], nn.Module], InputSpec]:
    """The factory of a model the CLI names and one sample's input (``--input``, or the built-in's own)."""
    shape, high = shape or {}, None
    if shape and model not in GPT_CONFIGS:
        raise ConfigError(
            f"--layers/--hidden/--heads/--kv-heads/--ffn-hidden/--seq-len/--vocab/--tied shape "
            f"transformers; {model!r} is not one: drop them or plan a built-in GPT"
        )
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
