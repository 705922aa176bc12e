"""``paratrain demo``: the demo job (:mod:`.job`) on N processes through ``paratrain run``."""

from __future__ import annotations

from ..errors import ConfigError
from ..flags import to_argv
from .config import LAUNCH_FIELDS, DemoConfig


def run_demo(config: DemoConfig) -> int:
    """Check what needs the processes' count, then launch the job on them; the exit code."""
    from ..launcher.torchrun import default_nproc, run

    nproc = config.nproc or (1 if config.strategy == "dp" else default_nproc())  # DataParallel: one process
    check_launch(config, nproc)
    run(
        [
            "--nproc-per-node",
            str(nproc),
            "--max-restarts",
            str(config.max_restarts),
            "-m",
            "paratrain.demo",
            *to_argv(config, skip=LAUNCH_FIELDS),
        ]
    )
    return 0


def check_launch(config: DemoConfig, nproc: int) -> None:
    """Reject, before any process starts, a strategy the registry does not know or that cannot run on ``nproc``
    processes, and a --fail-rank outside them."""
    from ..strategies import check_name, check_world

    check_name(config.strategy)
    if config.strategy != "auto":
        check_world(config.strategy, nproc, **config.strategy_options())
    if config.fail_at_step is not None and not config.fail_rank < nproc:
        raise ConfigError(f"--fail-rank {config.fail_rank} is not a rank of a {nproc}-process job (0..{nproc - 1})")
