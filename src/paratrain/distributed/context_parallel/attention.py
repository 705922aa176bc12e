"""Finding a model's attention by what it is, and making each one see whole sequences (:mod:`.ulysses`).

Two kinds are known by what they are, each wrapped per module (the process's other models are untouched):

* transformers' attention modules (Llama, Qwen2, GPT-2, … in transformers 5) call the function
  ``ALL_ATTENTION_FUNCTIONS`` names in ``config._attn_implementation`` with q, k, v ``[b, h, s, d]`` and a mask.
  The model's config is pointed at one registered name whose function hands the call to the :class:`HFUlysses`
  its module carries, which exchanges q, k, v, calls the module's original kernel (SDPA, eager, …) with the whole
  sequence's mask, and exchanges the output back.
* an attention kernel module (``is_attention_kernel = True``, as paratrain's GPT has): its forward maps q, k, v
  ``[b, h, s, d]`` to ``[b, h, s, d]`` on whole sequences, causal by itself; hooks exchange around it.

Heads and key/value heads must divide by the ranks that split them (tp x cp). A model with neither kind has its
attention found by what it does, the module around a ``scaled_dot_product_attention`` call (:mod:`.kernels`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError
from .kernels import find_by_calls
from .masks import attend
from .sequence import SequenceSplit
from .ulysses import heads_to_sequence, sequence_to_heads

DISPATCH_NAME = "paratrain_ulysses"
"""The attention implementation name a context-parallel transformers model's config carries."""
_MASK_FORMS = {"sdpa": "bool", "eager": "additive"}


class HFUlysses:
    """One transformers attention module's kernel, run on whole sequences for this rank's heads."""

    def __init__(self, implementation: str, split: SequenceSplit) -> None:
        self.implementation, self.split = implementation, split

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        group = self.split.group
        q, k, v = (sequence_to_heads(t, group) for t in (query, key, value))
        padding = self.split.padding
        if padding is not None and self.implementation not in _MASK_FORMS:
            raise ConfigError(
                f"cp masks padding for sdpa and eager attention, not {self.implementation!r}; load "
                "the model with attn_implementation='sdpa' or drop the padding (attention_mask of ones)"
            )
        out, weights = attend(
            self.kernel(module),
            module,
            q,
            k,
            v,
            padding,
            bool(getattr(module, "is_causal", True)),
            _MASK_FORMS.get(self.implementation, "bool"),
            kwargs,
        )  # out: [b, s, h/C, d]
        return heads_to_sequence(out.transpose(1, 2), group).transpose(1, 2).contiguous(), weights

    def kernel(self, module: nn.Module) -> Callable[..., Any]:
        """The attention function the module would call without context parallelism."""
        if self.implementation == "eager":
            found = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
            if found is None:
                raise ConfigError(
                    f"cp found no eager_attention_forward beside {type(module).__name__}; load the "
                    "model with attn_implementation='sdpa'"
                )
            return found
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS[self.implementation]


def _dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The registered attention function: the :class:`HFUlysses` of ``module``."""
    ulysses = getattr(module, "paratrain_ulysses", None)
    if ulysses is None:
        raise ConfigError(
            f"{type(module).__name__} asks for attention {DISPATCH_NAME!r} but was not prepared with "
            "cp; prepare the model with Parallel(..., cp=N), or set another attn_implementation"
        )
    return ulysses(module, *args, **kwargs)


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(DISPATCH_NAME, _dispatch)


def _is_hf_attention(module: nn.Module) -> bool:
    config = getattr(module, "config", None)
    return (
        type(module).__name__.endswith("Attention")
        and hasattr(module, "is_causal")
        and isinstance(getattr(config, "_attn_implementation", None), str)
    )


def wrap_attention(model: nn.Module, split: SequenceSplit, heads_split: int) -> int:
    """Make every attention of ``model`` see whole sequences over ``split``'s group; returns how many were found
    (0: none of the two kinds, attention is found by its kernel calls on the first call, :mod:`.kernels`).
    ``heads_split``: the ranks that split the heads (tp x cp)."""
    found = 0
    for name, module in model.named_modules():
        if getattr(module, "is_attention_kernel", False):
            module.register_forward_pre_hook(lambda m, args: tuple(sequence_to_heads(t, split.group) for t in args))
            module.register_forward_hook(lambda m, args, out: heads_to_sequence(out, split.group))
            found += 1
        elif _is_hf_attention(module):
            _check_heads(module.config, heads_split, name)
            implementation = module.config._attn_implementation
            if implementation == DISPATCH_NAME:
                raise ConfigError(f"{name} was already prepared with cp; prepare a model once")
            if getattr(module, "reorder_and_upcast_attn", False):
                raise ConfigError(
                    f"{name}: GPT-2's reorder_and_upcast_attn bypasses the attention function cp "
                    "wraps; set it False in the config"
                )
            module.paratrain_ulysses = HFUlysses(implementation, split)
            found += 1
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "paratrain_ulysses")}.values():
        _register()
        config._attn_implementation = DISPATCH_NAME
    if not found:
        find_by_calls(model, split)
    return found


def _check_heads(config: Any, ranks: int, name: str) -> None:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    for what, count in (("attention heads", heads), ("key/value heads", kv_heads)):
        if isinstance(count, int) and count % ranks:
            raise ConfigError(
                f"{name}: {count} {what} do not divide over the {ranks} ranks that split them "
                f"(tp x cp); choose cp (and tp) whose product divides {count}"
            )
