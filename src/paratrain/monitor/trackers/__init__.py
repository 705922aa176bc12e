"""Experiment trackers: ``Parallel(log_with=...)`` and ``par.log(metrics, step=)`` to TensorBoard, Weights & Biases
and MLflow, written by rank 0 alone, with the run's configuration once and the monitor's figures (step time, data
wait, samples and tokens per second, memory, MFU) beside the script's own on one step axis. See docs/trackers.md.

Each tracker's client is an optional extra, imported only when rank 0 opens its run.
"""

from __future__ import annotations

from typing import Any

import torch

from ...strategies.base import Strategy
from ...version import __version__
from .base import RunInfo, Tracker, TrackerSpec
from .config import TRACKERS, LogWith, TrackerConfig, tracker_config
from .fanout import Trackers
from .mlflow import MLflowConfig
from .tensorboard import TensorBoardConfig, TensorBoardTracker
from .wandb import WandbConfig

__all__ = [
    "LogWith",
    "MLflowConfig",
    "RunInfo",
    "TRACKERS",
    "TensorBoardConfig",
    "TensorBoardTracker",
    "Tracker",
    "TrackerConfig",
    "TrackerSpec",
    "Trackers",
    "WandbConfig",
    "run_description",
    "tracker_config",
]


def run_description(
    strategy: Strategy,
    *,
    world_size: int,
    data_parallel_size: int,
    precision: str,
    accumulate: int,
    device: torch.device,
) -> dict[str, Any]:
    """paratrain's part of a run's configuration: how it was laid out and with what."""
    return {
        "strategy": strategy.name,
        "layout": strategy.describe(),
        "world_size": world_size,
        "data_parallel_size": data_parallel_size,
        "precision": precision,
        "accumulate": accumulate,
        "device": device.type,
        "version": __version__,
        "torch": torch.__version__,
    }
