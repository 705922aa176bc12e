"""The parallel degrees of a job (dp, shard, pp, …) as a named ``DeviceMesh``, validated once."""
from __future__ import annotations

import math

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .errors import ConfigError


def validate_dims(dims: dict[str, int], world_size: int) -> None:
    """Each degree is >= 1 and their product is the world size."""
    for name, size in dims.items():
        if size < 1:
            raise ConfigError(f"mesh dimension {name}={size} must be >= 1")
    total = math.prod(dims.values())
    if total != world_size:
        shape = " x ".join(f"{k}={v}" for k, v in dims.items())
        raise ConfigError(
            f"mesh {shape} needs {total} processes but the world size is {world_size}; "
            "change the degrees or the number of processes"
        )


def build_mesh(device: torch.device, dims: dict[str, int], world_size: int) -> DeviceMesh:
    """A ``DeviceMesh`` over the default process group with one named dimension per degree."""
    validate_dims(dims, world_size)
    return init_device_mesh(device.type, tuple(dims.values()), mesh_dim_names=tuple(dims))
