"""What the demo runs: one validated, keyword-only configuration, the flags of ``paratrain demo``, of each of its
processes (``python -m paratrain.demo``) and of TensorFlow's demo job alike (:mod:`paratrain.flags`).

No torch here: TensorFlow's demo job reads this config in a process torch never enters. The strategy's name, and
whether it runs on the job's processes, are checked against the registry before the launch (``command.check_launch``)
and again by ``Parallel`` in each process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import ConfigError
from ..flags import at_least, flag, positive

LAUNCH_FIELDS = ("nproc", "max_restarts")
"""What the launcher reads; each process gets the other fields as flags."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """The digits CNN trained on N processes: the job, its checkpoints and the faults it plants."""

    nproc: int | None = field(default=None, metadata=flag("-n", "--nproc"))
    """Processes (default: the GPUs, or 2 on a CPU)."""
    strategy: str = "auto"
    """The parallel strategy."""
    tp: int | None = None
    """Tensor-parallel degree inside ddp/zero2/zero3 (the CNN's linear layers split over it)."""
    staleness: int | None = None
    """With --strategy ps: asynchronous updates at most this many versions old (a worker may then die, and come back
    with --max-restarts, while the others train on)."""
    epochs: int = 10
    """Passes over the training set."""
    batch_size: int = 64
    """Global batch per optimizer step, split over the replicas and accumulation steps."""
    accumulate: int = 1
    """Micro-batches per optimizer step."""
    lr: float = 2e-3
    """Learning rate (Adam, cosine schedule)."""
    seed: int = 0
    """Seeds the model, the data split and the shuffling."""
    checkpoint_dir: str | None = None
    """Save checkpoints here (and resume from them)."""
    checkpoint_every: int | None = None
    """Checkpoint every N optimizer steps."""
    checkpoint_async: bool = False
    """Write those checkpoints in the background while training goes on."""
    resume: bool = False
    """Start from the latest checkpoint in --checkpoint-dir."""
    max_restarts: int = 0
    """Restart the job this many times after a failure (it resumes from the latest checkpoint)."""
    fail_at_step: int | None = None
    """Fault injection: SIGKILL --fail-rank after this optimizer step (an epoch under --tf), on the first attempt."""
    fail_rank: int = 0
    """The rank --fail-at-step kills."""
    monitor_csv: str | None = field(default=None, metadata=flag("--monitor-csv", metavar="PATH"))
    """Log the training monitor's per-rank figures to this CSV."""

    def __post_init__(self) -> None:
        at_least(
            self,
            {
                "nproc": 1,
                "tp": 1,
                "staleness": 0,
                "epochs": 1,
                "batch_size": 1,
                "accumulate": 1,
                "checkpoint_every": 1,
                "max_restarts": 0,
                "fail_at_step": 1,
                "fail_rank": 0,
            },
        )
        positive(self, ("lr",))
        if (self.checkpoint_every is not None or self.checkpoint_async or self.resume) and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every, --checkpoint-async and --resume need --checkpoint-dir")
        if self.staleness is not None and self.strategy != "ps":
            raise ConfigError(f"--staleness is an option of --strategy ps, not of {self.strategy}")

    def strategy_options(self) -> dict[str, object]:
        """``--tp``'s options, with the CNN's own plan (it has no built-in one), and ``--staleness``."""
        from ..distributed.tensor_parallel.degrees import cli_options
        from ..workloads.digits import DIGITS_TP_PLAN

        options = cli_options(self.strategy, self.tp, DIGITS_TP_PLAN)
        return options if self.staleness is None else {**options, "staleness": self.staleness}
