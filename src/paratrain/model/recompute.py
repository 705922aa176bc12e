"""Activation checkpointing of the repeated blocks: keep each checkpointed block's input, recompute its inside in
backward. Activation memory falls from every block's intermediates to the blocks' inputs plus one block's
intermediates, for one more forward pass of compute.

It is applied after tensor parallelism splits a block and before compiling and sharding
(:func:`paratrain.distributed.parallelize.parallelize`), by giving each chosen block an instance-level ``forward``
that runs the class's forward under ``torch.utils.checkpoint`` (non-reentrant). Unlike a wrapper module, that keeps
the module tree — and so every parameter name, optimizer mapping, state dict and checkpoint — exactly the user's;
FSDP's hooks stay outside the checkpointed function, so a sharded block's parameters are gathered again before its
recompute, as they are with torch's own ``checkpoint_wrapper``.
"""
from __future__ import annotations

import functools

from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from .structure import find_blocks


def apply_checkpointing(model: nn.Module, every: int = 1) -> list[str]:
    """Checkpoint every ``every``-th repeated block of ``model`` (the first, then each ``every``); returns their
    names. Raises when the model has no repeated blocks to checkpoint."""
    blocks = find_blocks(model)
    if blocks is None:
        raise ConfigError(f"activation checkpointing works per repeated block, and {type(model).__name__} has none "
                          "(no ModuleList/Sequential of one block class); turn it off for this model")
    chosen = [name for i, name in enumerate(blocks.names) if i % every == 0]
    for name in chosen:
        checkpoint_block(model.get_submodule(name))
    return chosen


def checkpoint_block(block: nn.Module) -> None:
    """Recompute ``block`` in backward: its forward runs under ``torch.utils.checkpoint`` from now on."""
    if "forward" not in vars(block):  # applied once, even when prepare sees the model twice
        block.forward = functools.partial(_checkpointed, type(block).forward.__get__(block))


def _checkpointed(forward, *args, **kwargs):
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)
