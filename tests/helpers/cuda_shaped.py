"""This CPU-only torch made to look like an N-GPU machine to paratrain, in the test's own process.

``cuda_shaped(monkeypatch, gpus=8)`` makes ``torch.cuda`` report ``gpus`` devices and track the current one (0 until
``set_device``, as CUDA does), and turns every ``init_process_group`` into PyTorch's fake process group at the
launcher's rank and world (every collective returns at once): what the code asked for (backend, ``device_id``) is
recorded (and reported as the group's configuration), and so is the current device at each object collective, which on
CUDA is where torch puts the pickled object. Nothing runs on the fake devices: a CPU-only torch aborts on autograd over
fake CUDA tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist

from paratrain.env import ClusterEnv

OBJECT_COLLECTIVES = ("all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list")
"""Collectives that move a pickled object through a tensor on the current device (``torch.device("cuda")``)."""


@dataclass
class CudaShaped:
    """What the code under test did on the fake machine."""

    gpus: int
    current: int = 0
    """The current CUDA device."""
    set_devices: list[int] = field(default_factory=list)
    """Every ``torch.cuda.set_device``, in order."""
    groups: list[dict[str, Any]] = field(default_factory=list)
    """Every ``init_process_group``: its ``backend``, ``device_id`` and the current device when it was called."""
    object_calls: list[tuple[str, int]] = field(default_factory=list)
    """Every object collective: its name and the current device when it was called."""

    def set_device(self, device: torch.device | int | str) -> None:
        index = device if isinstance(device, int) else torch.device(device).index
        if index is None or not 0 <= index < self.gpus:
            raise RuntimeError(f"CUDA error: invalid device ordinal {device!r}")
        self.current = index
        self.set_devices.append(index)


def cuda_shaped(monkeypatch: pytest.MonkeyPatch, gpus: int = 8) -> CudaShaped:
    """Patch torch for the rest of the test (see the module's docstring); returns the record."""
    machine = CudaShaped(gpus)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "set_device", machine.set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: machine.current)
    monkeypatch.setattr(dist, "init_process_group", _fake_init(machine))
    monkeypatch.setattr(dist, "rendezvous", _fake_rendezvous)
    monkeypatch.setattr(dist, "get_backend_config", lambda group=None: _config(machine.groups[-1]["backend"]))
    for name in OBJECT_COLLECTIVES:
        monkeypatch.setattr(dist, name, _watched(machine, name, getattr(dist, name)))
    return machine


def launched_as(rank: int, local_rank: int, world_size: int, local_world_size: int) -> ClusterEnv:
    """The ranks torchrun gives this process, in the environment (the tests' autouse fixture restores it) and as the
    ``env`` to pass ``Parallel``. No master address: that would start the call watch's TCP store client."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(local_world_size)
    )
    return ClusterEnv(
        rank=rank, local_rank=local_rank, world_size=world_size, local_world_size=local_world_size, launched=True
    )


def _fake_init(machine: CudaShaped) -> Callable[..., None]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    real = dist.init_process_group

    def init(
        backend: str | None = None,
        init_method: str | None = None,
        *,
        rank: int = -1,
        world_size: int = -1,
        device_id: torch.device | None = None,
        **_: Any,
    ) -> None:
        machine.groups.append({"backend": backend, "device_id": device_id, "current": machine.current})
        rank = rank if rank >= 0 else int(os.environ.get("RANK", "0"))
        world_size = world_size if world_size > 0 else int(os.environ.get("WORLD_SIZE", "1"))
        real("fake", store=FakeStore(), rank=rank, world_size=world_size)

    return init


def _config(backend: str) -> str:
    """The backend configuration torch reports for a group started with ``backend`` (``nccl`` serves CUDA alone)."""
    return backend if ":" in backend else {"nccl": "cuda:nccl"}.get(backend, f"cpu:{backend},cuda:{backend}")


def _fake_rendezvous(url: str, rank: int = -1, world_size: int = -1, **_: Any) -> Iterator[tuple[Any, int, int]]:
    """``env://`` without a TCP store: a launched rank other than 0 would wait for rank 0's."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    yield FakeStore(), int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def _watched(machine: CudaShaped, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        machine.object_calls.append((name, machine.current))
        return real(*args, **kwargs)

    return call
