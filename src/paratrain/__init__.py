"""paratrain: run single-device PyTorch training across processes, GPUs and nodes.

Public names are imported lazily so that ``paratrain run`` starts as fast as ``torchrun``.
"""
from __future__ import annotations

from .version import __version__  # noqa: F401  (re-exported)

_EXPORTS = {
    "Parallel": ".parallel",
    "StepInfo": ".parallel",
    "ClusterEnv": ".env",
    "ParatrainError": ".errors",
    "ConfigError": ".errors",
    "UnknownStrategyError": ".errors",
    "LaunchError": ".errors",
    "RankFailedError": ".errors",
    "JobTimeoutError": ".errors",
    "JobInterrupted": ".errors",
    "CollectiveError": ".errors",
    "DDPConfig": ".options",
    "FSDPConfig": ".options",
    "PipelineConfig": ".options",
    "ModelParallelConfig": ".options",
    "scale_lr": ".lr",
    "linear_warmup": ".lr",
    "MonitorConfig": ".monitor",
    "DDPStrategy": ".strategies",
    "SingleDevice": ".strategies",
    "Strategy": ".strategies",
}

from .lazy import lazy_getattr  # noqa: E402

# Bound eagerly: the subpackage `paratrain.launch` would otherwise shadow the function once imported.
from .launch.spawn import launch  # noqa: E402  (imports nothing heavy)

__all__ = sorted([*_EXPORTS, "launch"])
__getattr__ = lazy_getattr(__name__, _EXPORTS, globals())
