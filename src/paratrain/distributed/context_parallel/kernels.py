"""Attention found by what it does: the modules of a model that call ``F.scaled_dot_product_attention``, whatever
wraps them (torchtitan's inner attention module on ``[b, s, h, d]``, an attention module calling SDPA inline).

A model with neither a transformers attention module nor an ``is_attention_kernel`` is found on its first call: the
whole forward runs under a :class:`~torch.overrides.TorchFunctionMode` that sees every SDPA call, exchanges around it
(:func:`ulysses_sdpa`, or :func:`~.allgather.allgather_sdpa` under the all-gather) and notes the innermost module of
the model whose method made it. From then on the mode is active only while those modules run (a pre-hook enters it,
a forward hook that runs even when the forward raises leaves it), so the rest of the forward pays nothing for it,
and activation checkpointing's recompute, which calls the modules again in backward, sees whole sequences as the
forward did (a block that calls SDPA in its own checkpointed forward is recomputed under the function modes its
forward ran under: :mod:`paratrain.model.transforms`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ...composition import cp_method
from ...errors import ConfigError
from ...model.attention import SDPACall
from .allgather import allgather_sdpa
from .sequence import SequenceSplit
from .ulysses import heads_to_sequence, sequence_to_heads

KERNELS = (F.scaled_dot_product_attention,)
"""The attention kernels whose calls mark a module as attention."""


def ulysses_sdpa(split: SequenceSplit, where: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """One SDPA call on q, k, v ``[b, h, s/C, d]`` (this rank's slice), run on whole sequences for ``1/C`` of the
    heads with the call's own causality, scale and grouping; ``where``: the calling module, for errors."""
    call = SDPACall(*args, **kwargs)
    q, k, v = call.query, call.key, call.value
    if call.attn_mask is not None:
        raise ConfigError(
            f"{where} calls scaled_dot_product_attention with an explicit attn_mask, which cp cannot rebuild for "
            "whole sequences (it was made for this rank's slice); use is_causal=True (padding: pass a 2-D "
            "attention_mask to a transformers model), or train without cp"
        )
    ranks = split.ranks
    if q.shape[1] % ranks or k.shape[1] % ranks:
        raise ConfigError(
            f"{where}: attention sees {q.shape[1]} query and {k.shape[1]} key/value heads on this rank, which "
            f"cp={ranks} cannot split into {ranks} groups; choose cp (x tp) dividing the model's heads and "
            "key/value heads, or cp_method='allgather'"
        )
    whole = (sequence_to_heads(t, split.group) for t in (q, k, v))
    return heads_to_sequence(F.scaled_dot_product_attention(*whole, **call.options()), split.group)


def auto_sdpa(split: SequenceSplit, where: str, *args: Any, **kwargs: Any) -> torch.Tensor:
    """One SDPA call by the method :func:`~paratrain.composition.cp_method` chooses for its heads on this rank (the
    model declared none before its first call; the sequence is cut contiguously, so an all-gather here is not
    head-tail balanced)."""
    call = SDPACall(*args, **kwargs)
    method = cp_method("auto", call.query.shape[1], call.key.shape[1], split.ranks)
    return EXCHANGES[method](split, where, *args, **kwargs)


EXCHANGES = {"ulysses": ulysses_sdpa, "allgather": allgather_sdpa, "auto": auto_sdpa}
"""What runs an SDPA call under each ``cp_method``."""


class KernelCalls(TorchFunctionMode):
    """Exchanges around every attention kernel call while active; while ``learning``, notes the modules of the model
    whose methods make them (``callers``)."""

    def __init__(self, model: nn.Module, split: SequenceSplit, method: str, kernels: list[nn.Module]) -> None:
        super().__init__()
        self.split = split
        self.exchange = EXCHANGES[method]
        self.kernels = kernels
        """Attention kernel modules whose SDPA calls must be found (the all-gather cannot run them whole)."""
        self.names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
        self.modules = {id(m): m for m in model.modules()}
        self.callers: dict[str, nn.Module] = {}
        self.learning = True
        self.depth = 0
        self.exchanging = False

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func not in KERNELS or self.exchanging:  # the kernel this mode calls, where it is entered twice
            return func(*args, **kwargs)
        self.exchanging = True
        try:
            return self._exchanged(args, kwargs)
        finally:
            self.exchanging = False

    def _exchanged(self, args: tuple, kwargs: dict) -> torch.Tensor:
        where = "attention"
        if self.learning:  # the first call: whose call is it (every later call comes from a module noted here)
            caller = self._caller()
            if caller is None:
                raise ConfigError(
                    "cp saw scaled_dot_product_attention called outside any method of the model's modules, and "
                    "cannot find that call again; call it from a module's forward, or train without cp"
                )
            where = self.names[id(caller)]
            self.callers[where] = caller
        return self.exchange(self.split, where, *args, **kwargs)

    def _caller(self) -> nn.Module | None:
        """The innermost module of the model on the call stack (a method of it is running)."""
        frame = sys._getframe(3)  # past this mode's own methods
        while frame is not None:
            found = self.modules.get(id(frame.f_locals.get("self")))
            if found is not None:
                return found
            frame = frame.f_back
        return None

    def enter(self, *_: Any) -> None:
        """A forward pre-hook: active from here (once, however deeply the hooked modules nest)."""
        if self.depth == 0:
            self.__enter__()
        self.depth += 1

    def leave(self, *_: Any) -> None:
        """A forward hook that always runs: inactive again when the outermost hooked call returns or raises."""
        if self.depth:
            self.depth -= 1
            if self.depth == 0:
                self.__exit__(None, None, None)

    def learn(self, model: nn.Module) -> None:
        """Active for ``model``'s calls until one returns; then only in the modules that called a kernel."""
        first = [
            model.register_forward_pre_hook(self.enter, prepend=True),
            model.register_forward_hook(lambda m, args, out: self._learned(m, out, first), always_call=True),
        ]

    def _learned(self, model: nn.Module, out: Any, first: list) -> None:
        self.leave()
        if out is None:  # the call raised (its own error stands); the next one learns
            return
        found = {id(m) for m in self.callers.values()}
        blind = [self.names[id(m)] for m in self.kernels if id(m) not in found]
        if blind:
            raise ConfigError(
                f"cp_method='allgather' hands attention this rank's rows of the mask, and {blind[0]} "
                "(is_attention_kernel) computes attention without a scaled_dot_product_attention call it could "
                "hand them to; call F.scaled_dot_product_attention there, or use cp_method='ulysses'"
            )
        if not self.callers:
            raise ConfigError(no_attention(model))
        self.learning, self.modules, self.names = False, {}, {}
        for handle in first:
            handle.remove()
        for module in self.callers.values():
            module.register_forward_pre_hook(self.enter)
            module.register_forward_hook(self.leave, always_call=True)


def no_attention(model: nn.Module) -> str:
    """Why cp refuses a model in which it finds no attention, and how to mark attention written by hand."""
    return (
        f"cp found no attention in {type(model).__name__} to split the sequence around (it finds a "
        "scaled_dot_product_attention call or a transformers attention module); call F.scaled_dot_product_attention, "
        "or move hand-written attention (q @ k.transpose(-2, -1), softmax, @ v) into a module of its own whose "
        "forward(q, k, v) maps [b, h, s, d] to [b, h, s, d] and set is_attention_kernel = True on it "
        "(docs/context-parallel.md#hand-written-attention); or train without cp"
    )


def find_by_calls(
    model: nn.Module, split: SequenceSplit, method: str = "ulysses", kernels: list[nn.Module] | None = None
) -> KernelCalls:
    """Hook ``model`` so that its first call finds the modules calling an attention kernel, and every call sees
    whole sequences there by ``method``; ``kernels``: attention kernel modules that must be among them."""
    mode = KernelCalls(model, split, method, kernels or [])
    mode.learn(model)
    return mode
