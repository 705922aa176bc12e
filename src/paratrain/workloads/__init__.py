"""Built-in workloads: small real or synthetic training jobs used by the demo, benchmarks and tests."""
from .workload import Workload, get_workload, workload_names

__all__ = ["Workload", "get_workload", "workload_names"]
