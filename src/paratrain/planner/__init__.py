"""The planner: pure functions from model statistics x hardware x strategy to memory per rank, step time and
a recommended strategy. No process group, no weights allocated; a plan takes milliseconds.

See docs/planner-model.md for the formulas and their sources.
"""

from .collectives import all_gather_s, all_reduce_s, broadcast_s, measured_link, p2p_s, reduce_scatter_s
from .config import Measured, ModelSpec, PlanConfig
from .estimates import Estimate, estimate, estimate_all
from .hardware import DEVICES, LINKS, Cluster, Device, Link, calibrated, cpu_host, get_device, get_link, make_cluster
from .inputs import TrainingCall
from .layout import Layout, exact_layout, layouts
from .make import make_plan
from .memory import MemoryBreakdown, memory_per_rank
from .model_stats import InputSpec, ModelStats, RunnableModel, TableStats, TPShape, measure_module, trace_module
from .recommend import Plan, recommend
from .report import format_plan, plan_to_json
from .timing import StepTime, bubble_fraction, step_time
from .training import Batching, Training, batching
from .transformer import TRANSFORMERS, GPTConfig, transformer_shape, transformer_stats

__all__ = [
    "DEVICES",
    "LINKS",
    "Cluster",
    "Device",
    "Link",
    "calibrated",
    "cpu_host",
    "get_device",
    "get_link",
    "make_cluster",
    "Layout",
    "exact_layout",
    "layouts",
    "make_plan",
    "MemoryBreakdown",
    "memory_per_rank",
    "InputSpec",
    "ModelStats",
    "RunnableModel",
    "measure_module",
    "trace_module",
    "transformer_shape",
    "transformer_stats",
    "TRANSFORMERS",
    "GPTConfig",
    "Estimate",
    "Plan",
    "estimate",
    "estimate_all",
    "recommend",
    "format_plan",
    "plan_to_json",
    "TableStats",
    "StepTime",
    "all_gather_s",
    "all_reduce_s",
    "broadcast_s",
    "bubble_fraction",
    "measured_link",
    "p2p_s",
    "reduce_scatter_s",
    "step_time",
    "Batching",
    "Training",
    "batching",
    "TPShape",
    "TrainingCall",
    "PlanConfig",
    "ModelSpec",
    "Measured",
]
