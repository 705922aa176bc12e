"""Registered strategies. Importing this package registers every built-in one."""
from ..options import DDPConfig, FSDPConfig, ModelParallelConfig, PipelineConfig
from .base import Runtime, Strategy
from .ddp import DDPStrategy, apply_ddp
from .dp import DataParallelStrategy
from .fsdp import HSDPStrategy, Zero2Strategy, Zero3Strategy, apply_fsdp
from .model_parallel import ModelParallelStrategy, apply_model_parallel
from .pipeline import HybridPipeline, PipelinedModel, PurePipeline
from .registry import available, check_name, check_world, create, register, resolve
from .single import SingleDevice
from .tensor_parallel import TPStrategy
from .zero import Zero1Strategy

__all__ = [
    "Runtime", "Strategy", "available", "check_name", "check_world", "create", "register", "resolve",
    "SingleDevice", "DataParallelStrategy", "DDPConfig", "DDPStrategy", "apply_ddp", "Zero1Strategy",
    "FSDPConfig", "Zero2Strategy", "Zero3Strategy", "HSDPStrategy", "apply_fsdp",
    "PipelineConfig", "PipelinedModel", "PurePipeline", "HybridPipeline",
    "ModelParallelConfig", "ModelParallelStrategy", "apply_model_parallel", "TPStrategy",
]
