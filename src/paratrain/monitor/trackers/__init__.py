"""Experiment trackers: ``Parallel(log_with=...)`` and ``par.log(metrics, step=)`` to TensorBoard, Weights & Biases
and MLflow, written by rank 0 alone, with the run's configuration once and the monitor's figures (step time, data
wait, samples and tokens per second, memory, MFU) beside the script's own on one step axis. See docs/trackers.md.

Each tracker's client is an optional extra, imported only when rank 0 opens its run.
"""
from __future__ import annotations

from typing import Any

import torch

from ...version import __version__
from .base import RunInfo, Tracker, TrackerSpec
from .config import TRACKERS, LogWith, TrackerConfig, tracker_config
from .fanout import Trackers
from .mlflow import MLflowConfig
from .tensorboard import TensorBoardConfig, TensorBoardTracker
from .wandb import WandbConfig

__all__ = ["LogWith", "MLflowConfig", "RunInfo", "TRACKERS", "TensorBoardConfig", "TensorBoardTracker", "Tracker",
           "TrackerConfig", "TrackerSpec", "Trackers", "WandbConfig", "run_description", "tracker_config",
           "trackers_for"]


def trackers_for(config: TrackerConfig | None, par: Any) -> Trackers:
    """The trackers a ``Parallel`` object owns: open on its global rank 0, closed (but checking) elsewhere."""
    return Trackers(config, active=par.is_main, describe=lambda: run_description(par))


def run_description(par: Any) -> dict[str, Any]:
    """paratrain's part of a run's configuration: how it was laid out and with what."""
    return {"strategy": par.strategy.name, "layout": par.strategy.describe(), "world_size": par.world_size,
            "data_parallel_size": par.data_parallel_size, "precision": par.precision.name,
            "accumulate": par.accumulate, "device": par.device.type, "version": __version__,
            "torch": torch.__version__}
