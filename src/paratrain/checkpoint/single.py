"""A folder of torch.distributed.checkpoint written and read by one process alone, inside a job's checkpoint: how a
parameter server stores its shard while the workers save theirs (it answers them from its serving loop, so it
cannot join their collective). Read with the same allow-listed reader as every checkpoint."""
from __future__ import annotations

from pathlib import Path

import torch

from .io import quiet_single_process
from .safety import SafePlanner, SafeReader


def write_alone(state: dict[str, torch.Tensor], folder: str) -> None:
    """Write ``state`` into ``folder`` (made here) without any other rank."""
    import torch.distributed.checkpoint as dcp

    Path(folder).mkdir(parents=True, exist_ok=True)
    with quiet_single_process():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)


def read_alone(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor in ``folder`` (written by ``write_alone``), read without any other rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(folder)
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in reader.read_metadata().state_dict_metadata.items()
             if isinstance(item, TensorStorageMetadata)}
    with quiet_single_process():
        dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=True)
    return state
