"""``Parallel(log_with=...)``: which trackers a job logs to, the run they share, and the configuration logged once."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ...errors import ConfigError
from .base import RunInfo, TrackerSpec
from .mlflow import MLflowConfig
from .tensorboard import TensorBoardConfig
from .wandb import WandbConfig

TRACKERS: Mapping[str, Callable[[], TrackerSpec]] = MappingProxyType(
    {"tensorboard": TensorBoardConfig, "wandb": WandbConfig, "mlflow": MLflowConfig}
)
"""Trackers by name; a name stands for its configuration's defaults."""
SPECS = (TensorBoardConfig, WandbConfig, MLflowConfig)

LogWith = str | TrackerSpec | Sequence[str | TrackerSpec]
"""What ``log_with`` takes besides a ``TrackerConfig``: a tracker's name or configuration, or several."""


def tracker_spec(item: object) -> TrackerSpec:
    """A tracker's configuration from its name or itself; an unknown name is refused with the valid ones."""
    if isinstance(item, SPECS):
        return item
    if isinstance(item, str):
        if item.lower() not in TRACKERS:
            raise ConfigError(f"unknown tracker {item!r}; choose from: {', '.join(TRACKERS)}")
        return TRACKERS[item.lower()]()
    raise ConfigError(
        f"a tracker is a name ({', '.join(TRACKERS)}) or paratrain.TensorBoardConfig, WandbConfig or "
        f"MLflowConfig, got {type(item).__name__}"
    )


@dataclass(frozen=True, kw_only=True)
class TrackerConfig:
    """``Parallel(log_with=TrackerConfig(...))``; ``log_with="wandb"`` is ``TrackerConfig(trackers="wandb")``."""

    trackers: Sequence[str | TrackerSpec]
    """Names (``"tensorboard"``, ``"wandb"``, ``"mlflow"``) or configurations; each tracker at most once."""
    project: str = "paratrain"
    """W&B's project, MLflow's experiment, TensorBoard's folder under ``dir``."""
    run_name: str | None = None
    """The run's name in every tracker (None: W&B's and MLflow's own, TensorBoard's the start time)."""
    dir: str | Path = "runs"
    """Local files: TensorBoard's event files, W&B's run folders, MLflow's database unless it is given elsewhere."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """The run's hyperparameters, logged once beside paratrain's own (``paratrain.strategy``, ``…world_size`` …)."""

    def __post_init__(self) -> None:
        items = list(self.trackers) if isinstance(self.trackers, (list, tuple)) else [self.trackers]
        if not items:
            raise ConfigError(f"TrackerConfig.trackers names at least one tracker ({', '.join(TRACKERS)})")
        specs = tuple(tracker_spec(item) for item in items)
        names = [spec.name for spec in specs]
        if len(set(names)) < len(names):
            raise ConfigError(f"each tracker at most once, got {', '.join(names)}")
        if not isinstance(self.project, str) or not self.project:
            raise ConfigError(f"TrackerConfig.project must be a non-empty string, got {self.project!r}")
        if not isinstance(self.config, Mapping):
            raise ConfigError(f"TrackerConfig.config is a dict of hyperparameters, got {type(self.config).__name__}")
        object.__setattr__(self, "trackers", specs)
        object.__setattr__(self, "dir", Path(self.dir))

    @property
    def run(self) -> RunInfo:
        return RunInfo(self.project, self.run_name, Path(self.dir))


def tracker_config(log_with: TrackerConfig | LogWith | None) -> TrackerConfig | None:
    """``Parallel``'s ``log_with`` as a config, or None when nothing is tracked."""
    if log_with is None or isinstance(log_with, TrackerConfig):
        return log_with
    return TrackerConfig(trackers=log_with)  # type: ignore[arg-type]
