"""Who am I: rank, local rank, world size and the master address, read from the environment.

torchrun (and ``paratrain run``, ``paratrain.launch``) export ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``. Ray Train sets the same ranks but starts the process
group itself (with ``init_method="tcp"`` it sets no master address at all): a process that joins a group it did not
start needs only the ranks. A script started with plain ``python`` has none of them and runs as a single process.
Reading is a pure function of a mapping, so tests pass a dict.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class ClusterEnv:
    """Where this process sits in the job."""

    rank: int = 0
    """Global rank, 0 … world_size-1."""
    local_rank: int = 0
    """Rank among the processes of this node; picks the GPU."""
    world_size: int = 1
    """Number of processes in the job."""
    local_world_size: int = 1
    """Number of processes on this node."""
    master_addr: str = "127.0.0.1"
    """Host of rank 0's store."""
    master_port: int | None = None
    """Port of rank 0's store (None when single-process)."""
    launched: bool = False
    """True when a launcher (torchrun, paratrain) started this process, even at world size 1."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK {self.rank} is outside 0..{self.world_size - 1} (WORLD_SIZE={self.world_size})")
        if not 0 <= self.local_rank < max(self.local_world_size, 1):
            raise ConfigError(f"LOCAL_RANK {self.local_rank} is outside 0..{self.local_world_size - 1}")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None, *, joined: bool = False) -> ClusterEnv:
        """Read torchrun-style variables; none present means a single local process. ``joined``: the process group
        exists already (Ray Train made it), so no master address is needed to start one."""
        env = os.environ if environ is None else environ
        if "RANK" not in env and "WORLD_SIZE" not in env:
            return cls()
        needed = ("RANK", "WORLD_SIZE") if joined else ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        missing = [k for k in needed if k not in env]
        if missing:
            raise ConfigError(
                f"incomplete launcher environment: {', '.join(missing)} not set; start the script with "
                "`paratrain run` or torchrun, or unset RANK/WORLD_SIZE to run as one process"
            )
        world = _int(env, "WORLD_SIZE")
        return cls(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=world,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", world),
            master_addr=env.get("MASTER_ADDR", cls.master_addr),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else None,
            launched=True,
        )


def _int(env: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = env.get(key)
    if raw is None:
        if default is None:
            raise ConfigError(f"{key} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{key}={raw!r} is not an integer") from None


def cpu_count() -> int:
    """Cores this process may run on (respects taskset/cgroup affinity)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
