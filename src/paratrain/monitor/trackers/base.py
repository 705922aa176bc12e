"""What every tracker is and what it receives: the run it belongs to, the metrics and step ``par.log`` checked, and
the run's configuration as flat key/value pairs (the one shape TensorBoard, W&B and MLflow all take)."""

from __future__ import annotations

import importlib.util
import numbers
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from ...errors import ConfigError

Scalar = str | int | float | bool
"""A configuration value as a tracker stores it."""


@dataclass(frozen=True)
class RunInfo:
    """The run every tracker of one ``Parallel`` writes: the same project, name and local folder."""

    project: str
    run_name: str | None
    dir: Path


class Tracker(Protocol):
    """One open run of one tracker (rank 0 holds them; the other ranks none)."""

    def log_config(self, config: dict[str, Scalar]) -> None:
        """Record the run's configuration (called once, before the first metrics)."""

    def log(self, metrics: dict[str, float], step: int) -> None:
        """Record ``metrics`` at optimizer step ``step``, on disk or sent, before returning."""

    def close(self, ok: bool) -> None:
        """End the run; ``ok`` False when the script is leaving on an error."""


class TrackerSpec(Protocol):
    """A tracker's configuration (``TensorBoardConfig``, ``WandbConfig``, ``MLflowConfig``): ``open`` starts its run."""

    name: str
    fix: str
    """What to check when its run cannot start."""

    def open(self, run: RunInfo) -> Tracker: ...


def require(module: str, extra: str, what: str) -> None:
    """Refuse, in one line naming the extra to install, a tracker whose client is not installed (checked without
    importing it: the clients take seconds to import, and only rank 0 ever does)."""
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"logging to {what} needs the {module} package: pip install 'paratrain[{extra}]'")


def checked_step(step: object) -> int:
    """``par.log``'s step: an optimizer step count."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
        raise ConfigError(
            f"par.log: step must be an integer >= 0 (an optimizer step, as par.optimizer_steps counts "
            f"them), got {step!r}"
        )
    return int(step)


def checked_metrics(metrics: object) -> Mapping[str, Any]:
    """``par.log``'s metrics, checked on every rank alike (a mistake shows on the first call wherever it runs) without
    reading tensors, which would wait for the GPU on ranks that log nothing."""
    if not isinstance(metrics, Mapping):
        raise ConfigError(f"par.log takes a dict of names to numbers, got {type(metrics).__name__}")
    for name, value in metrics.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"par.log: metric names are non-empty strings, got {name!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ConfigError(
                    f"par.log: {name!r} is a tensor of {value.numel()} elements; log one number "
                    "(loss.item(), or par.mean(loss) for the mean over replicas)"
                )
        elif not isinstance(value, numbers.Real):
            raise ConfigError(f"par.log: {name!r} is a {type(value).__name__}, not a number")
    return metrics


def as_floats(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Checked metrics as plain floats (a tensor is read here, on the rank that logs)."""
    return {name: float(value.item() if isinstance(value, torch.Tensor) else value) for name, value in metrics.items()}


def flat_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Scalar]:
    """Nested mappings as ``outer.inner`` keys; values other than numbers, strings and booleans as their ``str``."""
    flat: dict[str, Scalar] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flat_config(value, f"{name}."))
        elif isinstance(value, (str, int, float, bool)):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat
