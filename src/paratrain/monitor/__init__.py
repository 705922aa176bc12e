"""The training monitor: per-rank step time, data wait, time to the sync point and memory, compared across
ranks every few steps; a mixture of experts' tokens per expert over the global batch (:mod:`.experts`); warnings for
stragglers, slow data loading, unbalanced GPU memory and routing collapse; a table at the end.

``Parallel`` owns one (``par.monitor``); ``Parallel(monitor=False)`` turns it off and
``Parallel(monitor=MonitorConfig(...))`` tunes it. See docs/monitor.md. Its figures, and the script's own metrics,
go to experiment trackers (:mod:`paratrain.monitor.trackers`, docs/trackers.md).
"""
from __future__ import annotations

from typing import Any

from .config import MonitorConfig, monitor_config
from .figures import catalogue_peak_flops
from .monitor import Monitor
from .report import RunSummary
from .rules import Finding, Persistence, RankStats, find_all, find_data_stalls, find_memory_imbalance, find_stragglers
from .trackers import (LogWith, MLflowConfig, TensorBoardConfig, TrackerConfig, Trackers, WandbConfig, tracker_config,
                       trackers_for)

__all__ = ["Finding", "LogWith", "MLflowConfig", "Monitor", "MonitorConfig", "Persistence", "RankStats", "RunSummary",
           "TensorBoardConfig", "TrackerConfig", "Trackers", "WandbConfig", "find_all", "find_data_stalls",
           "find_memory_imbalance", "find_stragglers", "monitor_config", "monitor_for", "tracker_config",
           "trackers_for"]


def monitor_for(config: MonitorConfig | None, par: Any) -> Monitor | None:
    """The monitor a ``Parallel`` object owns (None when monitoring is off); its figures go to ``par.trackers``."""
    if config is None:
        return None
    mesh = par.mesh
    peer = mesh.get_local_rank("pp") if mesh is not None and "pp" in (mesh.mesh_dim_names or ()) else 0
    peak = (config.peak_tflops * 1e12 if config.peak_tflops is not None
            else catalogue_peak_flops(par.device, par.precision.name))
    return Monitor(config, rank=par.rank, world_size=par.world_size, local_world_size=par.env.local_world_size,
                   device=par.device, peer=peer, emit=par.logger.warning, accumulate=par.accumulate,
                   group=par.strategy.server.training_group(par.env), trackers=par.trackers,
                   replicas=lambda: par.data_parallel_size, same_tokens=lambda: _tp_size(par.mesh), peak_flops=peak)


def _tp_size(mesh: Any) -> int:
    """Ranks of one tensor-parallel group: they route the same tokens."""
    return mesh["tp"].size() if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else 1
