"""Registered strategies. Importing this package registers every built-in one: the presets of data and tensor
parallelism (:mod:`.presets`, run by :class:`~.composed.Composed`) and the engines of their own (pipelines, model
parallelism, ``nn.DataParallel``). The ``…Strategy`` names are the presets' documented constructors."""

from ..options import DDPConfig, FSDPConfig, ModelParallelConfig, PipelineConfig
from .base import Runtime, Strategy
from .composed import Composed, preset
from .dp import DataParallelStrategy
from .model_parallel import ModelParallelStrategy
from .param_server import ParameterServer
from .pipeline import HybridPipeline, PipelinedModel, PurePipeline
from .presets import PRESETS, Preset
from .registry import (
    available,
    check_every_rank_trains,
    check_name,
    check_world,
    create,
    register,
    sends_host_tensors,
    serves,
    strategy_for,
)

SingleDevice = preset("single")
DDPStrategy = preset("ddp")
Zero1Strategy = preset("zero1")
Zero2Strategy = preset("zero2")
Zero3Strategy = preset("zero3")
HSDPStrategy = preset("hsdp")
TPStrategy = preset("tp")

__all__ = [
    "Runtime",
    "Strategy",
    "Composed",
    "Preset",
    "PRESETS",
    "preset",
    "available",
    "check_name",
    "check_world",
    "check_every_rank_trains",
    "create",
    "register",
    "strategy_for",
    "serves",
    "sends_host_tensors",
    "SingleDevice",
    "DataParallelStrategy",
    "DDPConfig",
    "DDPStrategy",
    "Zero1Strategy",
    "FSDPConfig",
    "Zero2Strategy",
    "Zero3Strategy",
    "HSDPStrategy",
    "PipelineConfig",
    "PipelinedModel",
    "PurePipeline",
    "HybridPipeline",
    "ModelParallelConfig",
    "ModelParallelStrategy",
    "TPStrategy",
    "ParameterServer",
]
