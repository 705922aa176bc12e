"""Weights & Biases: one W&B run per job, started on rank 0. ``mode="offline"`` (or ``WANDB_MODE=offline``) keeps it
on this machine, for ``wandb sync`` later."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import ConfigError
from .base import RunInfo, Scalar, require

MODES = ("online", "offline", "disabled")


@dataclass(frozen=True, kw_only=True)
class WandbConfig:
    """``log_with=WandbConfig(...)`` (or ``"wandb"``): needs ``pip install 'paratrain[wandb]'``."""

    name = "wandb"
    fix = "run 'wandb login', or log offline: WandbConfig(mode='offline') or WANDB_MODE=offline"
    mode: str | None = None
    """``"online"``, ``"offline"`` or ``"disabled"`` (None: W&B's own choice: ``WANDB_MODE``, else online)."""
    entity: str | None = None
    """The W&B team or user (None: the logged-in user's default)."""
    tags: tuple[str, ...] = ()
    dir: str | Path | None = None
    """Where W&B keeps its local files, in a ``wandb/`` folder (None: ``TrackerConfig.dir``)."""
    init: Mapping[str, Any] = field(default_factory=dict)
    """Further ``wandb.init`` arguments (``group``, ``notes``, ``resume``, …)."""

    def __post_init__(self) -> None:
        require("wandb", "wandb", "Weights & Biases")
        if self.mode is not None and self.mode not in MODES:
            raise ConfigError(f"WandbConfig.mode must be one of {', '.join(MODES)} (or None), got {self.mode!r}")
        object.__setattr__(self, "tags", tuple(self.tags))

    def open(self, run: RunInfo) -> WandbTracker:
        import wandb

        folder = Path(self.dir if self.dir is not None else run.dir)
        folder.mkdir(parents=True, exist_ok=True)
        kwargs: dict[str, Any] = {
            "project": run.project,
            "name": run.run_name,
            "dir": str(folder),
            "entity": self.entity,
            "tags": list(self.tags) or None,
            **self.init,
        }
        if self.mode is not None:
            kwargs["mode"] = self.mode
        return WandbTracker(wandb.init(**kwargs))


class WandbTracker:
    """An open W&B run. W&B keeps one row per step and drops points logged at a step lower than the last one."""

    def __init__(self, run: Any) -> None:
        self.run = run

    def log_config(self, config: dict[str, Scalar]) -> None:
        self.run.config.update(config, allow_val_change=True)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self, ok: bool) -> None:
        self.run.finish(exit_code=0 if ok else 1)
