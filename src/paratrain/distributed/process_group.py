"""Who starts and who ends the default process group, and how it ends without aborting a peer.

``Parallel`` starts the group unless the script already did (then the script owns it), and only the owner
destroys it. Ending it takes care on gloo: see :func:`finish_group`.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ..devices import backend_for, claim_device, job_backend
from ..env import ClusterEnv
from ..errors import ConfigError

_GLOO_DRAIN_S = 0.1
"""Seconds ``finish_group`` releases the GIL after its barrier."""


def group_started() -> bool:
    """Whether a process group exists before ``Parallel`` makes one: Ray Train starts it before the user's script,
    with only the rank variables set (``ClusterEnv.from_environ(joined=True)``)."""
    return dist.is_available() and dist.is_initialized()


def start_process_group(
    env: ClusterEnv,
    device: torch.device,
    timeout_s: float,
    needs_group: bool,
    backend: str | None = None,
    alone: bool = False,
) -> bool:
    """Start the default group for this job when it needs one; True when this call started it (and so owns it).

    ``python train.py`` with a distributed strategy gets a private one-rank group, so the same code path runs (DDP
    and FSDP at world 1) instead of failing for want of a launcher. A group the script (or Ray Train) started is used
    and left to whoever started it. ``backend``: the job's (default: the device's); the device is bound to the group
    (NCCL's eager start) only on a pure NCCL group, where every rank has a GPU. ``alone``: a launched rank that cannot
    join the job's group (an asynchronous parameter-server worker back after its process died) gets a private one
    too, and meets its peers in a group of the strategy's making.
    """
    backend = backend or backend_for(device)
    timeout = timedelta(seconds=timeout_s)
    if not env.launched or alone:
        if not needs_group:
            return False
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return True
    if dist.is_initialized():  # the script's own, or Ray Train's
        if (dist.get_world_size(), dist.get_rank()) != (env.world_size, env.rank):
            raise ConfigError(
                f"the existing process group puts this process at rank {dist.get_rank()} of {dist.get_world_size()} "
                f"but RANK={env.rank}, WORLD_SIZE={env.world_size}; start the group with the launcher's ranks"
            )
        _check_serves_host(backend)
        return False
    dist.init_process_group(
        backend=backend,
        store=attempt_store(timeout),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if backend == "nccl" else None,
    )
    return True


def _check_serves_host(backend: str) -> None:
    """Refuse a group the script started that cannot carry the host tensors the job's ``backend`` is chosen for."""
    if "cpu:" in backend and "cpu:" not in dist.get_backend_config():
        raise ConfigError(
            f"the process group the script started ({dist.get_backend_config()}) serves no host "
            f"tensors, which this strategy sends (cpu_offload, parameter servers); start it with "
            f"init_process_group({backend!r})"
        )


def start_tool_group(accelerator: str, host_tensors: bool, timeout_s: float) -> torch.device:
    """Claim this launched rank's device, then start the job's group on it with the job's backend: the job body of
    a tool that launches its own processes (``bench``, ``verify``, ``doctor``'s bandwidth sweep). Returns the
    device."""
    device = claim_device(int(os.environ.get("LOCAL_RANK", "0")), accelerator)
    backend = job_backend(accelerator, host_tensors)
    dist.init_process_group(
        backend, timeout=timedelta(seconds=timeout_s), device_id=device if backend == "nccl" else None
    )
    return device


def attempt_store(timeout: timedelta) -> dist.Store:
    """The store ``env://`` gives this process, its keys under a prefix of the launcher's restart attempt.

    torch 2.11 hands the workers of every attempt the launcher's own store with no such prefix ("a new TCPStore for
    every retry", which the static rendezvous does not make): restarted gloo ranks then read the dead attempt's
    addresses and fail in ``connectFullMesh`` (``Connection refused``: 5 of 5 torchrun restarts failed so); 2.13
    prefixes them itself (and the second prefix costs nothing).
    """
    store, _, _ = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return dist.PrefixStore(f"paratrain/attempt_{attempt}", store) if attempt is not None else store


def finish_group(meet: bool = True) -> None:
    """Wait for every rank, let gloo's worker finish with the GIL released, then destroy the default group. For
    ``Parallel.close`` and for code that started the group itself. ``meet=False``: some ranks may have left (an
    asynchronous parameter server's workers): end without waiting for them.

    The barrier matters: a rank that tears its group down while a peer still finishes its last collective can
    abort the peer at exit (gloo's worker threads die with "terminate called without an active exception").

    The pause after it matters too: gloo's worker thread frees the barrier's work object (and the last gradient
    all-reduce it holds) after the barrier returns, and that needs the GIL. If this thread then frees the DDP model
    (the last owner of the process group) while holding the GIL, the group's destructor waits for the worker
    forever. Sleeping releases the GIL so the worker finishes first.
    """
    if meet:
        dist.barrier()
    time.sleep(_GLOO_DRAIN_S)
    dist.destroy_process_group()
