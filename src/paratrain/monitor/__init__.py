"""The training monitor: per-rank step time, data wait, time to the sync point and memory, compared across
ranks every few steps; a mixture of experts' tokens per expert over the global batch (:mod:`.experts`); warnings for
stragglers, slow data loading, unbalanced GPU memory and routing collapse; a table at the end.

``Parallel`` owns one (``par.monitor``); ``Parallel(monitor=False)`` turns it off and
``Parallel(monitor=MonitorConfig(...))`` tunes it. See docs/monitor.md. Its figures, and the script's own metrics,
go to experiment trackers (:mod:`paratrain.monitor.trackers`, docs/trackers.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch.distributed as dist

from ..distributed.runtime import Runtime
from ..errors import ConfigError
from .config import MonitorConfig, monitor_config, tensorboard_moved
from .figures import catalogue_peak_flops
from .monitor import Monitor
from .report import RunSummary
from .rules import Finding, Persistence, RankStats, find_all, find_data_stalls, find_memory_imbalance, find_stragglers
from .trackers import LogWith, MLflowConfig, TensorBoardConfig, TrackerConfig, Trackers, WandbConfig, tracker_config

__all__ = [
    "Finding",
    "LogWith",
    "MLflowConfig",
    "Monitor",
    "MonitorConfig",
    "Persistence",
    "RankStats",
    "RunSummary",
    "TensorBoardConfig",
    "TrackerConfig",
    "Trackers",
    "WandbConfig",
    "find_all",
    "find_data_stalls",
    "find_memory_imbalance",
    "find_stragglers",
    "monitor_and_trackers",
    "monitor_config",
    "monitor_for",
    "tracker_config",
]


def monitor_and_trackers(
    monitor: bool | MonitorConfig | None, log_with: TrackerConfig | LogWith | None
) -> tuple[MonitorConfig | None, TrackerConfig | None]:
    """``Parallel``'s ``monitor`` and ``log_with`` as configs; a former ``MonitorConfig(tensorboard_dir=)`` becomes
    what the one TensorBoard path says: a TensorBoard tracker in ``log_with``, given each rank's figures."""
    watching, folder = tensorboard_moved(monitor_config(monitor))
    tracking = tracker_config(log_with)
    if folder is None:
        return watching, tracking
    if tracking is not None and any(spec.name == "tensorboard" for spec in tracking.trackers):
        raise ConfigError(
            "MonitorConfig.tensorboard_dir given beside log_with's TensorBoard tracker; drop "
            "tensorboard_dir and set MonitorConfig(per_rank=True)"
        )
    board = TensorBoardConfig(dir=folder)
    if tracking is None:
        return watching, TrackerConfig(trackers=[board])
    return watching, replace(tracking, trackers=[*tracking.trackers, board])


def monitor_for(
    config: MonitorConfig | None,
    layout: Callable[[], Runtime],
    *,
    trackers: Trackers,
    group: dist.ProcessGroup | None,
    accumulate: int,
    replicas: Callable[[], int],
    emit: Callable[[str], None],
) -> Monitor | None:
    """The monitor of a ``Parallel`` object (None when monitoring is off). ``layout``: where this rank sits, asked
    again at each window for the mesh (``auto`` builds it once ``prepare`` has seen the model)."""
    if config is None:
        return None
    now = layout()
    mesh = now.mesh
    peer = mesh.get_local_rank("pp") if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else 0
    peak = (
        config.peak_tflops * 1e12
        if config.peak_tflops is not None
        else catalogue_peak_flops(now.device, now.precision.name)
    )
    return Monitor(
        config,
        rank=now.env.rank,
        world_size=now.env.world_size,
        local_world_size=now.env.local_world_size,
        device=now.device,
        peer=peer,
        emit=emit,
        accumulate=accumulate,
        group=group,
        trackers=trackers,
        replicas=replicas,
        same_tokens=lambda: _tp_size(layout().mesh),
        peak_flops=peak,
    )


def _tp_size(mesh: object) -> int:
    """Ranks of one tensor-parallel group: they route the same tokens."""
    return mesh["tp"].size() if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else 1
