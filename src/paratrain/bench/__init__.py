"""``paratrain bench``: a workload at several world sizes and strategies, with speedup, efficiency and why.

``run_bench(BenchConfig(...))`` launches the jobs and returns a ``BenchResult``; ``format_report``,
``write_json``, ``write_csv`` and ``write_plot`` present it. See docs/bench.md for what each column measures.
"""

from .command import run_bench_cli
from .config import BenchConfig
from .output import require_matplotlib, to_json, write_csv, write_json, write_plot
from .report import format_report
from .result import BenchResult, Comparison, Row
from .runner import run_bench

__all__ = [
    "BenchConfig",
    "BenchResult",
    "Comparison",
    "Row",
    "format_report",
    "require_matplotlib",
    "run_bench",
    "run_bench_cli",
    "to_json",
    "write_csv",
    "write_json",
    "write_plot",
]
