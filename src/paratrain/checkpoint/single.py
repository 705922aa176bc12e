"""A folder of torch.distributed.checkpoint written and read by one process alone, inside a job's checkpoint: how a
parameter server stores its shard while the workers save theirs (it answers them from its serving loop, so it
cannot join their collective). Read with the same allow-listed reader as every checkpoint.

A failure is a one-line ``CheckpointError``: DCP's own ``CheckpointException`` derives from ``BaseException``, so a
caller that serves on after a failed request (``except Exception``) would otherwise die of a damaged file."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import CheckpointError
from .io import DCP_ERRORS, first_failure, load_failure, quiet_background, quiet_single_process
from .safety import SafePlanner, SafeReader


def write_alone(state: dict[str, torch.Tensor], folder: str) -> None:
    """Write ``state`` into ``folder`` (made here) without any other rank."""
    import torch.distributed.checkpoint as dcp

    Path(folder).mkdir(parents=True, exist_ok=True)
    try:
        with quiet_single_process():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    except DCP_ERRORS as e:
        raise CheckpointError(f"could not write {folder}: {first_failure(e)}") from None


def start_write_alone(state: dict[str, torch.Tensor], folder: str) -> Callable[[], None]:
    """Stage ``state`` (DCP's ``async_save`` copies it) and write it into ``folder`` in a background thread, without
    any other rank; returns the wait for that write, which raises a one-line ``CheckpointError`` if it failed."""
    import torch.distributed.checkpoint as dcp

    Path(folder).mkdir(parents=True, exist_ok=True)
    quiet_background()
    try:
        future = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(folder), no_dist=True)
    except DCP_ERRORS as e:
        raise CheckpointError(f"could not write {folder}: {first_failure(e)}") from None

    def wait() -> None:
        try:
            future.result()
        except DCP_ERRORS as e:
            raise CheckpointError(f"could not write {folder}: {first_failure(e)}") from None

    return wait


def read_alone(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor in ``folder`` (written by ``write_alone``), read without any other rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = SafeReader(folder)
    state = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in reader.read_metadata().state_dict_metadata.items()
        if isinstance(item, TensorStorageMetadata)
    }
    try:
        with quiet_single_process():
            dcp.load(state, storage_reader=reader, planner=SafePlanner(), no_dist=True)
    except DCP_ERRORS as e:
        raise load_failure(Path(folder), e) from None
    return state
