"""Finding a model's attention by what it is, and making each one see whole sequences (:mod:`.ulysses`, or
:mod:`.allgather` where the heads do not divide: ``cp_method``).

Two kinds are known by what they are, each wrapped per module (the process's other models are untouched):

* transformers' attention modules (Llama, Qwen2, GPT-2, … in transformers 5) call the function
  ``ALL_ATTENTION_FUNCTIONS`` names in ``config._attn_implementation`` with q, k, v ``[b, h, s, d]`` and a mask.
  The model's config is pointed at one registered name whose function hands the call to the :class:`HFUlysses`
  its module carries, which exchanges q, k, v, calls the module's original kernel (SDPA, eager, …) with the whole
  sequence's mask, and exchanges the output back (:class:`HFAllGather`: gathers k, v and calls the kernel with its
  rows' mask).
* an attention kernel module (``is_attention_kernel = True``, as paratrain's GPT has): its forward maps q, k, v
  ``[b, h, s, d]`` to ``[b, h, s, d]`` on whole sequences, causal by itself; hooks exchange around it.

Under Ulysses heads and key/value heads must divide by the ranks that split them (tp x cp). A model with neither
kind has its attention found by what it does, the module around a ``scaled_dot_product_attention`` call
(:mod:`.kernels`); so does an attention kernel module under the all-gather (its kernel is causal by itself on whole
sequences, and the all-gather hands the kernel its rows' mask).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...composition import cp_method
from ...errors import ConfigError
from .allgather import attend_rows, gather_sequence
from .kernels import find_by_calls
from .masks import attend, attend_documents
from .sequence import SequenceSplit
from .ulysses import heads_to_sequence, sequence_to_heads

DISPATCH_NAME = "paratrain_ulysses"
"""The attention implementation name a context-parallel transformers model's config carries."""
_MASK_FORMS = {"sdpa": "bool", "eager": "additive"}


class HFUlysses:
    """One transformers attention module's kernel, run on whole sequences for this rank's heads (a packed row: once
    per document, :func:`~.masks.attend_documents`)."""

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
        causal, form = bool(getattr(module, "is_causal", True)), _MASK_FORMS.get(self.implementation, "bool")
        if self.split.documents is not None:
            out, weights = attend_documents(
                self.kernel(module), module, q, k, v, self.split.documents, causal, form, kwargs
            )
        else:
            out, weights = attend(self.kernel(module), module, q, k, v, padding, causal, form, kwargs)
        # out: [b, s, h/C, d]
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


class HFAllGather(HFUlysses):
    """One transformers attention module's kernel on this rank's queries over the whole sequence's keys and values
    (any head count), with the mask of its rows (sdpa: bool, eager: additive; a packed row's: keys of each row's own
    document only)."""

    def __call__(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        form = _MASK_FORMS.get(self.implementation)
        if form is None:
            raise ConfigError(
                f"cp_method='allgather' hands the attention kernel its rows' mask, which sdpa and eager take, not "
                f"{self.implementation!r}; load the model with attn_implementation='sdpa', or use cp_method='ulysses'"
            )
        kernel, padding = self.kernel(module), self.split.padding
        k, v = (gather_sequence(t, self.split) for t in (key, value))

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> tuple:
            out, weights = kernel(module, q, k, v, mask, **{**kwargs, "is_causal": False})
            return out.transpose(1, 2), weights  # [b, rows, h, d] -> [b, h, rows, d]

        causal = bool(getattr(module, "is_causal", True))
        keys = None if padding is None else padding.keys
        documents = None if self.split.documents is None else self.split.documents.ids
        out, weights = attend_rows(run, query, k, v, self.split, keys, causal, form, documents)
        return out.transpose(1, 2).contiguous(), weights


def _whole_sequences(split: SequenceSplit, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An attention kernel module's pre-hook under Ulysses: q, k, v exchanged to whole sequences for this rank's
    heads; one that takes ``documents=`` (``packs_documents``) is handed the whole rows' documents of a packed call
    (the ones its model read from this rank's slice of the positions describe the slice)."""
    args = tuple(sequence_to_heads(t, split.group) for t in args)
    if split.documents is not None and getattr(module, "packs_documents", False):
        kwargs = {**kwargs, "documents": [list(row) for row in split.documents.lengths]}
    return args, kwargs


def _whole_rows(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """An attention kernel module's pre-hook under the all-gather: no ``documents=`` (those its model read from
    this rank's pieces of the positions); its one SDPA call is masked to each row's own document
    (:func:`~.allgather.allgather_sdpa`)."""
    return args, {**kwargs, "documents": None}


def _dispatch(module: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """The registered attention function: the exchange ``module`` carries (:class:`HFUlysses`, :class:`HFAllGather`)."""
    exchange = getattr(module, "paratrain_cp", None)
    if exchange is None:
        raise ConfigError(
            f"{type(module).__name__} asks for attention {DISPATCH_NAME!r} but was not prepared with "
            "cp; prepare the model with Parallel(..., cp=N), or set another attn_implementation"
        )
    _check_window(module, kwargs.get("sliding_window"), args[0].shape[-2] * exchange.split.ranks)
    return exchange(module, *args, **kwargs)


def _check_window(module: nn.Module, window: int | None, length: int) -> None:
    """A one-line error for a sliding window shorter than the whole sequence: cp calls the kernel with masks of
    its own, which are causal over the whole sequence; the window the model's mask carried would be lost."""
    if window is not None and window < length:
        raise ConfigError(
            f"{type(module).__name__} attends through a sliding window of {window} tokens, which cp does not "
            f"apply, over {length}-token sequences; run cp on sequences of at most {window} tokens, or train "
            "this model without cp"
        )


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


def wrap_attention(model: nn.Module, split: SequenceSplit, heads_split: int, method: str) -> int:
    """Make every attention of ``model`` see whole sequences over ``split``'s group by ``method`` (``ulysses``,
    ``allgather``, or ``auto`` where no transformers module declares the heads); returns how many were found (0: none
    of the two kinds, or kernel modules under the all-gather: attention is found by its kernel calls on the first
    call, :mod:`.kernels`). ``heads_split``: the ranks that split the heads (tp x cp)."""
    found, kernels, hooked = 0, [], 0
    wrapper = HFAllGather if method == "allgather" else HFUlysses
    for name, module in model.named_modules():
        if getattr(module, "is_attention_kernel", False) and method == "allgather":
            kernels.append(module)
            if getattr(module, "packs_documents", False):  # its SDPA call is masked per document instead
                module.register_forward_pre_hook(_whole_rows, with_kwargs=True)
            else:
                hooked += 1
        elif getattr(module, "is_attention_kernel", False):
            module.register_forward_pre_hook(functools.partial(_whole_sequences, split), with_kwargs=True)
            module.register_forward_hook(lambda m, args, out: heads_to_sequence(out, split.group))
            found, hooked = found + 1, hooked + (not getattr(module, "packs_documents", False))
        elif _is_hf_attention(module):
            if method == "ulysses":
                _check_heads(module.config, heads_split, name)
            implementation = module.config._attn_implementation
            if implementation == DISPATCH_NAME:
                raise ConfigError(f"{name} was already prepared with cp; prepare a model once")
            if getattr(module, "reorder_and_upcast_attn", False):
                raise ConfigError(
                    f"{name}: GPT-2's reorder_and_upcast_attn bypasses the attention function cp "
                    "wraps; set it False in the config"
                )
            module.paratrain_cp = wrapper(implementation, split)
            found += 1
    for config in {id(m.config): m.config for m in model.modules() if hasattr(m, "paratrain_cp")}.values():
        _register()
        config._attn_implementation = DISPATCH_NAME
    # transformers attention, kernel modules taking documents=
    split.keeps_documents = (found > 0 or bool(kernels)) and not hooked
    if found and kernels:
        raise ConfigError(
            f"cp_method='allgather' runs an attention kernel module through its SDPA call, which it cannot find beside "
            f"the transformers attention of {type(model).__name__}; use cp_method='ulysses'"
        )
    if not found:
        find_by_calls(model, split, method, kernels)
    return found


def choose_method(model: nn.Module, requested: str, heads_split: int) -> str:
    """The method ``cp`` runs ``model``'s attention with (:func:`~paratrain.composition.cp_method`): under ``auto``,
    the heads of its transformers attention modules decide; a model without any stays ``auto``, each SDPA call
    choosing by the heads it sees (an attention kernel module's: Ulysses, which says when they do not divide)."""
    config = next((m.config for m in model.modules() if _is_hf_attention(m)), None)
    if config is None and requested == "auto":
        return "auto"
    heads, kv_heads = _heads(config) if config is not None else (None, None)
    return cp_method(requested, heads, kv_heads, heads_split)


def _heads(config: Any) -> tuple[int | None, int | None]:
    heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", None)
    return heads, getattr(config, "num_key_value_heads", None) or heads


def _check_heads(config: Any, ranks: int, name: str) -> None:
    for what, count in zip(("attention heads", "key/value heads"), _heads(config), strict=True):
        if isinstance(count, int) and count % ranks:
            raise ConfigError(
                f"{name}: {count} {what} do not divide over the {ranks} ranks that split them "
                f"(tp x cp); choose cp (and tp) whose product divides {count}, or cp_method='allgather'"
            )
