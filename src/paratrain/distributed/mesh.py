"""The parallel degrees of a job (:class:`~paratrain.dims.ParallelDims`) as a named ``DeviceMesh``, validated once."""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..dims import ParallelDims


def build_mesh(device: torch.device, dims: ParallelDims, world_size: int) -> DeviceMesh:
    """A ``DeviceMesh`` over the default process group with one named dimension per degree of ``dims``."""
    dims.validate(world_size)
    shape = dims.mesh_shape()
    return init_device_mesh(device.type, tuple(shape.values()), mesh_dim_names=tuple(shape))
