"""A prepared model's full, consolidated state dict: plain parameter names, full tensors, whatever the
strategy (no ``module.`` prefix, no shards)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def full_state_dict(model: nn.Module, *, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Gather ``model``'s state on the CPU. Collective when distributed: call it on every rank.

    With ``rank0_only`` the other ranks get an empty dict (and no gathered copy in memory).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from .tensor_parallel.quiet import quiet_sequential_collectives

    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    with quiet_sequential_collectives():  # FSDP x TP parameters gather one mesh dimension after the other
        state = get_model_state_dict(model, options=options)
    return {k: v.detach().cpu() for k, v in state.items()}
