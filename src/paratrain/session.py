"""This process's seat in the job: its device, the process group it started or joined (and so whether it ends it),
the watch over its collective calls, and the check that every rank was configured alike.

``Parallel`` owns one. Kept apart so that the façade holds no process-group bookkeeping: who ends the group, and
how, is decided here once (see :mod:`paratrain.distributed.process_group`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from .call_watch import CallWatch
from .devices import claim_device, job_backend
from .distributed.process_group import finish_group, start_process_group
from .env import ClusterEnv
from .precision import Precision
from .rank_agreement import check_ranks_agree


class Session:
    """Start (or join) the job's process group on this process's device; ``close`` ends what it started.

    The device is claimed (made the current CUDA device, :func:`~paratrain.devices.claim_device`) before the group
    starts or is joined, so every collective after it, ours or torch's, runs on this rank's GPU.

    ``on_host``: this rank runs on the host whatever the accelerator (a parameter server); ``host_tensors``: the
    strategy sends host tensors through the group, so it serves them beside the accelerator's (see
    :func:`~paratrain.devices.job_backend`); ``alone``: this rank cannot join the job's group (see
    :func:`~paratrain.distributed.process_group.start_process_group`) and takes part in no agreement;
    ``device_of``: the strategy's device for this rank given the one its local rank selects (a ``model_parallel``
    process binds its first stage's GPU).
    """

    def __init__(
        self,
        env: ClusterEnv,
        accelerator: str,
        precision: Precision,
        *,
        timeout_s: float,
        wait_report_s: float | None,
        needs_group: bool,
        on_host: bool = False,
        host_tensors: bool = False,
        alone: bool = False,
        device_of: Callable[[torch.device], torch.device] | None = None,
    ) -> None:
        self.env = env  # timeout_s was checked where it was given: JobConfig
        backend = job_backend(accelerator, host_tensors)
        self.device = torch.device("cpu") if on_host else claim_device(env.local_rank, accelerator, device_of)
        if not on_host:
            precision.validate(self.device)
        self.owns_group = start_process_group(env, self.device, timeout_s, needs_group, backend, alone)
        """True when this session started the group (a group the script started is left to the script)."""
        self.alone = alone
        self.calls = CallWatch(
            env.rank,
            env.world_size,
            timeout_s=timeout_s,
            report_after_s=wait_report_s,
            enabled=self.distributed and env.launched and not alone,
        )

    @property
    def distributed(self) -> bool:
        """True while a process group is up (also the private one-rank group of an unlaunched script)."""
        return dist.is_available() and dist.is_initialized()

    def agree(self, values: dict[str, str]) -> None:
        """Fail on every rank, in one line, unless every rank has the same ``values`` (collective)."""
        if self.distributed and not self.alone:
            with self.calls.call("Parallel()"):
                check_ranks_agree(values, self.env.rank, dist.get_world_size())

    def close(self, meet: bool = True) -> None:
        """End the group if this session started it (safely on gloo; ``meet=False``: without waiting for ranks that
        may have left), and stop watching calls."""
        if self.owns_group and dist.is_initialized():
            finish_group(meet)  # a rank alone ends its private group: its barrier waits for no one
        self.owns_group = False
        self.calls.close()
