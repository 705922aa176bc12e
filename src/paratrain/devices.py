"""Device and backend choice, made in one place for every strategy: ``cuda:LOCAL_RANK`` with NCCL when CUDA
is available, otherwise the CPU with gloo; a job whose strategy sends host tensors through its group (parameter
servers' messages, CPU-offloaded shards) gets gloo beside NCCL."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .errors import ConfigError

ACCELERATORS = ("auto", "cpu", "cuda")


def uses_cuda(accelerator: str) -> bool:
    """Whether ``accelerator`` puts the job's compute on CUDA on this machine."""
    if accelerator not in ACCELERATORS:
        raise ConfigError(f"unknown accelerator {accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
    return accelerator == "cuda" or (accelerator == "auto" and torch.cuda.is_available())


def select_device(local_rank: int, accelerator: str = "auto") -> torch.device:
    """The device this process trains on."""
    if not uses_cuda(accelerator):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("accelerator='cuda' but this torch build sees no CUDA device; use accelerator='cpu'")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ConfigError(
            f"LOCAL_RANK {local_rank} has no GPU: only {count} visible; launch at most {count} processes per node "
            "or check CUDA_VISIBLE_DEVICES"
        )
    return torch.device("cuda", local_rank)


def claim_device(
    local_rank: int, accelerator: str = "auto", device_of: Callable[[torch.device], torch.device] | None = None
) -> torch.device:
    """:func:`select_device` (or what ``device_of`` makes of it: a ``model_parallel`` process binds its first
    stage's GPU), made this process's current CUDA device: call it before the first collective.

    ``init_process_group(device_id=...)`` binds NCCL's communicator but leaves the current device at 0, and torch
    code that takes "the current device" (object collectives, FSDP2's ``fully_shard``/``replicate``, the
    DataLoader's pin-memory thread, ``distribute_tensor`` of a host tensor, DCP's planning) would then work on GPU 0
    on every rank of a node.
    """
    device = select_device(local_rank, accelerator)
    device = device if device_of is None else device_of(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def backend_for(device: torch.device) -> str:
    """The collective backend that serves tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"


def job_backend(accelerator: str, host_tensors: bool) -> str:
    """The backend every rank of a job starts its group with. ``host_tensors``: the strategy also sends host tensors
    through the group (:attr:`~paratrain.strategies.base.Strategy.host_tensors`: a parameter server's messages,
    CPU-offloaded gradients' norm and full state dicts): on CUDA that is gloo for host tensors beside NCCL for CUDA
    ones, one group serving both, since an NCCL-only group refuses a host tensor ("No backend type associated with
    device type cpu")."""
    if not uses_cuda(accelerator):
        return "gloo"
    return "cpu:gloo,cuda:nccl" if host_tensors else "nccl"
