"""DDP gradient-communication hooks by name: ``fp16``, ``bf16`` (compressed all-reduce) and ``powersgd``.

They are PyTorch's own hooks, except bf16 on gloo: PyTorch's ``bf16_compress_hook`` refuses any backend but
NCCL, although gloo sums bf16 fine, so on gloo the same cast-all-reduce-cast runs through ``dist.all_reduce``.
"""

# No `from __future__ import annotations` here: DDP checks a hook's annotations as real objects.
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


def register_comm_hook(ddp: "nn.parallel.DistributedDataParallel", config: object) -> None:
    """Register the hook ``config.comm_hook`` names on ``ddp``."""
    group = ddp.process_group
    name = config.comm_hook  # type: ignore[attr-defined]
    if name == "fp16":
        ddp.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif name == "bf16":
        hook = default_hooks.bf16_compress_hook if group.name() == "nccl" else _bf16_allreduce_hook
        ddp.register_comm_hook(group, hook)
    elif name == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=config.powersgd_rank,  # type: ignore[attr-defined]
            start_powerSGD_iter=max(2, config.powersgd_start_iter),  # type: ignore[attr-defined]
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def single_bucket_mb(model: nn.Module) -> float:
    """A bucket size that holds every gradient of ``model`` in one bucket."""
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return nbytes / 2**20 + 1.0


def _bf16_allreduce_hook(group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket in bf16 (half the bytes on the wire), then write it back in its own dtype."""
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(group.size())
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(f: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(f.value()[0])
        return buffer

    return fut.then(decompress)
