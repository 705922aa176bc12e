"""What each client script reports, so the test compares numbers and pids instead of log text.

The clients are written as their own authors would write them; these three calls are the only lines they share.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.distributed as dist


def record_pid(out_dir: str) -> None:
    """Each rank's pid, so the test can check afterwards that no worker outlived its launcher."""
    Path(out_dir, f"rank{os.environ['RANK']}.pid").write_text(f"{os.getpid()}\n")


def finished(out_dir: str) -> None:
    """The script's last line on this rank: what happens after it (interpreter exit) is the launcher's business."""
    Path(out_dir, f"rank{os.environ['RANK']}.done").write_text(f"{os.getpid()}\n")


def report(out_dir: str, loss: float, local_loss: float, model: torch.nn.Module) -> None:
    """Rank 0 writes the client's final loss, each rank's own last loss, the world size, a checksum of the weights
    and how far the ranks' checksums differ. Equal weights with different local losses mean the ranks trained
    together on different shards: a rank that trains alone (Accelerate on a CPU-only machine without
    ``cpu=True``) sees all the data, so its local loss equals its partner's, or its weights differ."""
    mine = torch.tensor(
        [sum(p.detach().double().sum().item() for p in model.parameters()), float(local_loss)], dtype=torch.float64
    )
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    if dist.get_rank() == 0:
        sums, local = [t[0].item() for t in every], [t[1].item() for t in every]
        result = {
            "loss": float(loss),
            "params": sums[0],
            "world": len(sums),
            "spread": max(sums) - min(sums),
            "rank_losses": local,
        }
        Path(out_dir, "result.json").write_text(json.dumps(result))
