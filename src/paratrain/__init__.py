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
    "JobPreempted": ".errors",
    "CollectiveError": ".errors",
    "Preempted": ".preemption",
    "DDPConfig": ".options",
    "FSDPConfig": ".options",
    "PipelineConfig": ".options",
    "ModelParallelConfig": ".options",
    "TPConfig": ".options",
    "PSConfig": ".distributed.param_server.config",
    "CheckpointConfig": ".checkpoint.config",
    "ModelConfig": ".settings",
    "JobConfig": ".settings",
    "GuardConfig": ".guard",
    "GlobalBatch": ".loop",
    "MonitorConfig": ".monitor",
    "TrackerConfig": ".monitor.trackers",
    "TensorBoardConfig": ".monitor.trackers",
    "WandbConfig": ".monitor.trackers",
    "MLflowConfig": ".monitor.trackers",
    "scale_lr": ".lr",
    "linear_warmup": ".lr",
    "chunked_cross_entropy": ".loss",
    "Strategy": ".strategies",
    "ray_train_loop": ".launcher.ray_train",
}
"""What a script uses: ``Parallel``, every configuration it may construct (a strategy's as ``config=``), the errors,
the LR helpers, the chunked cross-entropy, ``launch`` and the ``Strategy`` base class (strategies are chosen by
name); and what a Ray Train driver hands its trainer (``ray_train_loop``)."""
_DEPRECATED = {
    "DDPStrategy": (
        ".strategies",
        "choose the strategy by name: Parallel('ddp', config=paratrain.DDPConfig(...)) (or "
        "paratrain.strategies.DDPStrategy)",
    ),
    "SingleDevice": (
        ".strategies",
        "choose the strategy by name: Parallel('single') (or paratrain.strategies.SingleDevice)",
    ),
}

from os import environ as _environ  # noqa: E402

from . import script_verify as _script_verify  # noqa: E402
from .launcher.spawn import launch as launch  # noqa: E402  (imports nothing heavy)
from .lazy import lazy_getattr  # noqa: E402

__all__ = sorted([*_EXPORTS, "launch"])
__getattr__ = lazy_getattr(__name__, _EXPORTS, globals(), _DEPRECATED)


def _verify_takes_over(*call: object) -> None:
    """A rank of a script ``paratrain verify`` launched: verify builds each ``Parallel`` (imported at the first)."""
    from .verify.script import take_over_launched

    take_over_launched(*call)


if _environ.get(_script_verify.VAR):
    _script_verify.hold(_verify_takes_over)
