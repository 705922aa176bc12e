"""Built-in workloads: small real or synthetic training jobs used by the demo, benchmarks and tests."""

from .registry import get_workload, workload_names
from .workload import Workload

__all__ = ["Workload", "get_workload", "workload_names"]
