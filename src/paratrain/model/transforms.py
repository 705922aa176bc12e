"""Activation checkpointing and ``torch.compile`` of the repeated blocks a module holds, in place.

``parallelize`` (:mod:`paratrain.distributed.parallelize`) calls it after tensor parallelism and before data
parallelism, on the whole model or on one pipeline stage. A stage finds its blocks by identity (``ModelFacts``
was taken from the whole model), so "every k-th block" counts the model's blocks, not the stage's.

Compiling each block in place (``nn.Module.compile``), before sharding, is the order that works with every strategy:
FSDP's hooks stay outside the compiled code (compiling a sharded model graph-breaks on them; zero3 on a 124M GPT ran
140 ms per step compiled after sharding against 76 ms uncompiled), DDP sees the same modules (its graph splitting is
not needed), and tensor parallelism's DTensors are what the compiled blocks trace. A module without repeated blocks
is compiled whole. In place means the module tree — parameter names, state dicts, checkpoints — stays the user's
(``torch.compile(m)`` would add an ``_orig_mod.`` level). Checkpointing comes first, so the recompute is part of what
is compiled.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack
from torch.utils._device import DeviceContext
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from ..options import BlockTransforms
from .facts import ModelFacts


def transform_blocks(module: nn.Module, facts: ModelFacts, transforms: BlockTransforms) -> list[str]:
    """Checkpoint every k-th and compile each of the blocks ``module`` holds; returns the names (in ``module``) of
    what was compiled (``""``: ``module`` itself, for a model without blocks)."""
    if transforms.checkpoint_every and facts.blocks is None:
        raise ConfigError(
            f"activation checkpointing works per repeated block, and {type(module).__name__} has none "
            "(no two modules of one class with layers of their own, in one parent); turn it off for this model"
        )
    held = [(name, m) for name, m in module.named_modules() if id(m) in facts.block_index]
    if transforms.checkpoint_every:
        for _, block in held:
            if facts.block_index[id(block)] % transforms.checkpoint_every == 0:
                checkpoint_block(block)
    if transforms.compile is None:
        return []
    targets = held if facts.blocks is not None else [("", module)]
    for _, target in targets:
        target.compile(**transforms.compile)
    return [name for name, _ in targets]


def checkpoint_block(block: nn.Module) -> None:
    """Recompute ``block`` in backward: its forward runs under ``torch.utils.checkpoint`` (non-reentrant) from now on.

    An instance-level ``forward`` rather than a wrapper module keeps the module tree — every parameter name,
    optimizer mapping, state dict and checkpoint — exactly the user's; FSDP's hooks stay outside the checkpointed
    function, so a sharded block's parameters are gathered again before its recompute, as with torch's own
    ``checkpoint_wrapper``. Activation memory falls from every block's intermediates to the blocks' inputs plus one
    block's intermediates, for one more forward pass of compute."""
    if "forward" not in vars(block):  # applied once, even when prepare sees the model twice
        block.forward = functools.partial(_checkpointed, type(block).forward.__get__(block))


CACHES = ("past_key_values", "past_key_value", "layer_past")
"""The key/value cache a transformers block appends to in its forward, by the names blocks take it under."""


def _checkpointed(forward, *args, **kwargs):
    """``forward`` checkpointed; while training, without the key/value cache: the recompute would append the block's
    keys and values to it a second time (GPT-OSS's eager attention then fails on a mask half the keys' length; under
    causal SDPA the doubled keys happen to give the same result). transformers' own checkpointing drops it alike."""
    if torch.is_grad_enabled():
        kwargs = {k: None if k in CACHES else False if k == "use_cache" else v for k, v in kwargs.items()}
    modes = () if torch.compiler.is_compiling() else _function_modes()
    if modes:
        kwargs["context_fn"] = lambda: (contextlib.nullcontext(), _entered(modes))
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _function_modes() -> tuple[TorchFunctionMode, ...]:
    """The torch function modes active now, but the device context (the recompute restores that one itself)."""
    return tuple(m for m in _get_current_function_mode_stack() if not isinstance(m, DeviceContext))


@contextlib.contextmanager
def _entered(modes: tuple[TorchFunctionMode, ...]) -> Iterator[None]:
    """The recompute under the function modes its forward ran under: context parallelism's exchange around the
    attention kernels a block calls in its own forward (:mod:`paratrain.distributed.context_parallel.kernels`)."""
    with contextlib.ExitStack() as stack:
        for mode in modes:
            stack.enter_context(mode)
        yield
