"""What the training monitor measures, how often it compares ranks, and when it warns."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    """Options of ``Parallel(monitor=MonitorConfig(...))``; the defaults cost well under 1% of a step."""

    every: int = 50
    """Optimizer steps per window: each rank summarises a window by medians, then one small all-gather."""
    persist: int = 3
    """Consecutive windows a condition must hold before it is reported (one slow window is noise)."""
    straggler_threshold: float = 0.2
    """A rank is a straggler when it reaches the sync point this fraction later than its peers' median …"""
    straggler_min_cost: float = 0.05
    """… and the others wait for it at least this fraction of the step (so sub-millisecond jitter is ignored)."""
    data_threshold: float = 0.2
    """Warn when a rank waits for its next batch this fraction of the step or more."""
    memory_threshold: float = 0.2
    """Warn when the least-used GPU uses this fraction less memory than the most-used one (CUDA only)."""
    memory_min_gib: float = 0.5
    """… and the gap is at least this many GiB."""
    experts: bool = True
    """Count the tokens each expert of a mixture-of-experts layer is routed (hooks on its ``experts`` modules; a
    dense model gets none), report them per window and warn when routing collapses."""
    expert_imbalance: float = 2.0
    """Routing has collapsed when a layer's busiest expert gets this many times the mean of its experts' tokens (or
    some experts get none)."""
    summary: bool = True
    """Print the per-rank summary table on rank 0 at ``Parallel.close()``."""
    csv: str | Path | None = None
    """Append one row per rank and window to this CSV file (rank 0 writes it)."""
    per_rank: bool = False
    """Also give the trackers (``log_with``) each rank's figures, ``monitor/<figure>/rank<r>``, beside the job's."""
    tensorboard_dir: str | Path | None = None
    """Deprecated: ``log_with=TensorBoardConfig(dir=...)`` and ``per_rank=True`` (the one TensorBoard path)."""
    flops_per_sample: float | None = None
    """Forward + backward FLOPs of one training sample (a transformer's ``6·N·T + 12·L·h·T²`` for T tokens), so
    the trackers get the FLOP/s achieved and, where the device's peak is known, MFU."""
    peak_tflops: float | None = None
    """One device's peak TFLOP/s for MFU (None: the planner's figure for a known GPU at the job's precision; CPUs
    have none)."""

    def __post_init__(self) -> None:
        if not isinstance(self.every, int) or self.every < 1:
            raise ConfigError(f"MonitorConfig.every must be an integer >= 1, got {self.every!r}")
        if not isinstance(self.persist, int) or self.persist < 1:
            raise ConfigError(f"MonitorConfig.persist must be an integer >= 1, got {self.persist!r}")
        for name in ("straggler_threshold", "straggler_min_cost", "data_threshold", "memory_threshold"):
            value = getattr(self, name)
            if not 0 < value < 10:
                raise ConfigError(f"MonitorConfig.{name} is a fraction (0.2 = 20%), got {value!r}")
        if (
            isinstance(self.expert_imbalance, bool)
            or not isinstance(self.expert_imbalance, (int, float))
            or self.expert_imbalance <= 1
        ):
            raise ConfigError(
                f"MonitorConfig.expert_imbalance is the busiest expert's tokens over the mean (> 1, e.g. "
                f"2.0), got {self.expert_imbalance!r}"
            )
        if self.memory_min_gib < 0:
            raise ConfigError(f"MonitorConfig.memory_min_gib must be >= 0, got {self.memory_min_gib}")
        for name in ("flops_per_sample", "peak_tflops"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ConfigError(f"MonitorConfig.{name} must be a number > 0 (or None), got {value!r}")
        if self.tensorboard_dir is not None:
            warnings.warn(
                f"MonitorConfig(tensorboard_dir=) is deprecated; write log_with=paratrain.TensorBoardConfig("
                f"dir={str(self.tensorboard_dir)!r}) and MonitorConfig(per_rank=True)",
                FutureWarning,
                stacklevel=3,
            )


def tensorboard_moved(config: MonitorConfig | None) -> tuple[MonitorConfig | None, Path | None]:
    """A config that used the former ``tensorboard_dir`` as the one path spells it: per-rank figures on, and the
    folder, for a TensorBoard tracker beside ``log_with``'s."""
    if config is None or config.tensorboard_dir is None:
        return config, None
    return replace(config, per_rank=True, tensorboard_dir=None), Path(config.tensorboard_dir)


def monitor_config(monitor: bool | MonitorConfig | None) -> MonitorConfig | None:
    """``Parallel``'s ``monitor`` argument as a config, or None when monitoring is off."""
    if monitor is True:
        return MonitorConfig()
    if monitor is False or monitor is None:
        return None
    if isinstance(monitor, MonitorConfig):
        return monitor
    raise ConfigError(f"monitor must be True, False or a MonitorConfig, got {type(monitor).__name__}")
