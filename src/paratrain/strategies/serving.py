"""The part of a strategy where some ranks serve the others instead of training (parameter servers), and its
absence.

Every strategy holds one (``Strategy.server``) and its callers use its hooks unconditionally: :class:`NoServer`,
every rank training, gives the answers of such a job at each; the parameter server's
(:class:`~paratrain.strategies.param_server.ServerRole`) splits the job into servers and workers. So the
strategy base carries only what every strategy needs, and no caller asks which strategy it holds.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from ..env import ClusterEnv


class NoServer:
    """No rank serves: every rank trains, joins the job's group on its device and checkpoints with the others
    (stateless, so one serves every strategy)."""

    serves = False
    """Some ranks serve the others instead of training: they take no step of their own."""

    def on_host(self, env: ClusterEnv) -> bool:
        """Whether this rank of ``env`` runs on the host whatever the accelerator (a server's shards and optimizer
        live in host memory, leaving the GPUs to the workers)."""
        return False

    def joins_alone(self, env: ClusterEnv) -> bool:
        """Whether this rank starts a private group instead of joining the job's: a rank that comes back after its
        process died (an asynchronous worker) cannot join a group whose members are fixed."""
        return False

    def training_group(self, env: ClusterEnv) -> dist.ProcessGroup | None:
        """The ranks that train, whose monitors compare notes and whose ``par.barrier`` waits for each other (None:
        every rank)."""
        return None

    def steps_taken(self) -> int:
        """Optimizer steps this rank's place in the job took before this process started, where it did not resume
        from a checkpoint (an asynchronous worker that came back); 0 for every other rank."""
        return 0

    def clips_in_step(self, optimizer: torch.optim.Optimizer, max_norm: float) -> bool:
        """Where only the optimizer step sees the gradient to clip (the mean of every worker's, on the servers),
        hand it ``max_norm`` and return True: the loop then does not clip, and takes the norm from
        ``stepped_grad_norm`` after the step. False here: the loop clips before the step."""
        return False

    def stepped_grad_norm(self, optimizer: torch.optim.Optimizer) -> float | None:
        """The gradient norm before the clipping of the last step, where ``clips_in_step`` is True."""
        return None

    def traffic_seconds(self) -> float | None:
        """Seconds this rank has spent in messages of the servers' protocol so far, timed where they are sent and
        awaited (a worker's pulls and pushes); None where nothing is timed."""
        return None

    def checkpoint_group(self) -> dist.ProcessGroup | None:
        """The ranks that take part in ``save``/``load``'s collectives (None: every rank)."""
        return None

    def save_shards(self, folder: Path, rank: int, background: bool = False) -> None:
        """Write what the ranks outside ``checkpoint_group`` hold into ``folder`` (a checkpoint being written, before
        it is published); ``background``: stage it and return, ``shards_written`` waits for the write. Nothing here."""

    def shards_written(self, folder: Path, rank: int) -> None:
        """Return once what ``save_shards(background=True)`` started is written into ``folder``; raise a one-line
        ``CheckpointError`` if it failed. Nothing to wait for here."""

    def check_shards(self, folder: Path) -> None:
        """Raise a one-line ``CheckpointError`` (on every rank alike, before anything loads) when ``folder`` lacks
        what ``load_shards`` needs."""

    def load_shards(self, folder: Path, rank: int) -> None:
        """Restore what ``save_shards`` wrote into ``folder``; nothing to restore here."""

    def close(self) -> bool:
        """The job's training is over on this rank (``Parallel.close``); returns whether every rank meets at the end
        (False: some may have left, so the group ends without waiting for them). Every rank meets here."""
        return True
