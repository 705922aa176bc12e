"""``paratrain bench`` end to end: options → configuration → measurement → table, JSON, CSV and plot."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from .config import BenchConfig
from .machine import Machine
from .output import require_matplotlib, write_csv, write_json, write_plot
from .report import format_report
from .runner import run_bench


def parse_worlds(text: str | None, machine: Machine) -> tuple[int, ...]:
    """``"1,2,4"`` → (1, 2, 4); None → 1 and 2 on a CPU, powers of two up to the GPU count on a GPU machine."""
    if text is None:
        top = machine.gpus if machine.gpus > 1 else 2
        return tuple(sorted({1, top, *(2**k for k in range(top.bit_length()) if 2**k <= top)}))
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ConfigError(f"--nproc takes comma-separated world sizes like 1,2,4, got {text!r}") from None


def run_bench_cli(
    *,
    nproc: str | None,
    strategies: str,
    json_path: Path | None,
    csv_path: Path | None,
    plot_path: Path | None,
    plot: bool,
    **options: object,
) -> int:
    """Run the benchmark the CLI describes, print the table, write the files asked for."""
    machine = Machine.here(str(options.get("accelerator", "auto")))
    config = BenchConfig(
        nprocs=parse_worlds(nproc, machine),
        strategies=tuple(s.strip() for s in strategies.split(",") if s.strip()),
        **options,
    )  # type: ignore[arg-type]
    if plot_path is None and json_path is not None and plot:
        plot_path = json_path.with_suffix(".png")
    if plot_path is not None and plot:
        require_matplotlib()  # before minutes of measuring, not after
    result = run_bench(config)
    print(format_report(result))
    written = []
    if json_path is not None:
        write_json(result, json_path)
        written.append(str(json_path))
    if csv_path is not None:
        write_csv(result, csv_path)
        written.append(str(csv_path))
    if plot_path is not None and plot:
        write_plot(result, plot_path)
        written.append(str(plot_path))
    if written:
        print(f"wrote {', '.join(written)}")
    return 0
