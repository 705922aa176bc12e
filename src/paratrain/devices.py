"""Device and backend choice, made in one place for every strategy: ``cuda:LOCAL_RANK`` with NCCL when CUDA
is available, otherwise the CPU with gloo."""
from __future__ import annotations

import torch

from .errors import ConfigError

ACCELERATORS = ("auto", "cpu", "cuda")


def select_device(local_rank: int, accelerator: str = "auto") -> torch.device:
    """The device this process trains on."""
    if accelerator not in ACCELERATORS:
        raise ConfigError(f"unknown accelerator {accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
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


def backend_for(device: torch.device) -> str:
    """The collective backend that serves tensors on ``device``."""
    return "nccl" if device.type == "cuda" else "gloo"
