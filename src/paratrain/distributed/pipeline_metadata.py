"""torch.distributed.pipelining learns a stage's shapes by running it once: the first time a schedule runs, each
stage's real forward (and the last stage's loss) is called on the first micro-batch, or, past the first stage, on
uninitialised tensors of the received shapes. That pass must leave no trace: its loss is not a training loss, and
its forward must not move a BatchNorm's running statistics (on torch 2.13 the uninitialised inputs made them
1e35 and inf). The pass is recognised by the pipelining functions on the call stack.
"""

from __future__ import annotations

import sys

from torch import nn

FORWARD_FRAMES = frozenset({"_forward_metadata_inference", "_shape_inference"})
"""Functions that run a stage's forward for its shapes (torch 2.13; earlier releases)."""
LOSS_FRAMES = frozenset({"_prepare_backward_infra", "_backward_metadata_inference"})
"""Functions that call the loss for backward's shapes."""


def inside(frames: frozenset[str], depth: int = 12) -> bool:
    """True when one of ``frames`` is among the ``depth`` callers of the caller."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name in frames:
            return True
        frame = frame.f_back
    return False


def keep_buffers_through_metadata_pass(module: nn.Module) -> None:
    """Restore ``module``'s buffers after a forward that the metadata inference runs."""
    saved: list = []

    def before(mod: nn.Module, _args: object) -> None:
        if inside(FORWARD_FRAMES, depth=16):
            saved.append([(b, b.detach().clone()) for b in mod.buffers()])

    def after(_mod: nn.Module, _args: object, _out: object) -> None:
        if saved:
            for buf, value in saved.pop():
                buf.data.copy_(value)

    module.register_forward_pre_hook(before)
    module.register_forward_hook(after)
