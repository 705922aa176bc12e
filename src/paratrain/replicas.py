"""What ``prepare`` makes of the job's ranks as replicas of one model: they start from rank 0's initial weights
(:mod:`paratrain.distributed.initial_state`), each data-parallel replica then draws from a random stream of its own
and the first batches they feed the model are compared (:mod:`paratrain.draws`), and work one rank does alone
where the strategy needs every rank meets the others first (:mod:`paratrain.rank_alone`).

``Parallel`` owns one; kept apart so the façade holds none of these rules.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .distributed.initial_state import start_alike
from .draws import ONE_REPLICA, FirstBatch, agreed_seed, replica_stream, shared_by
from .rank_alone import guard_model, guard_optimizer
from .seeding import rank_seed, seed_all
from .session import Session
from .strategies.base import Runtime, Strategy
from .strategies.chosen import ChosenStrategy


class Replicas:
    """The rules above for one ``Parallel``, whose ``chosen`` strategy and ``runtime`` give the replicas that read
    different data and the mesh, once the layout is known."""

    def __init__(
        self, session: Session, world_size: int, chosen: ChosenStrategy, runtime: Callable[[], Runtime]
    ) -> None:
        self.session, self.chosen, self.runtime = session, chosen, runtime
        self.joined = session.distributed and not session.alone and world_size > 1
        """This rank shares a process group with others (not one process, nor a rank that came back alone)."""
        self._first, self._outside = FirstBatch(), FirstBatch()
        self._base: int | None = None

    def start(
        self, model: nn.Module, materializer: object | None, seed: int | None, say: Callable[[str], None]
    ) -> None:
        """Before ``model`` is wrapped (collective): rank 0's initial state on every rank, and rank 0's seed for the
        replicas' streams."""
        if self.joined:
            start_alike(model, materializer, self.session.device, say)
            self._base = agreed_seed(seed, self.session.device)

    def watch(self, wrapped: nn.Module, strategy: Strategy) -> None:
        """Once ``wrapped`` is prepared: its forwards and state outside any paratrain call meet the other ranks where
        ``strategy`` needs them; its first batch inside ``par.step`` is compared across the job, and there its first
        forward outside any call (generation, evaluation) across each replica's ranks, once they have met."""
        wrapped.register_forward_pre_hook(  # runs after the meeting registered next, before cp cuts the input
            lambda _, args, kwargs: self._forward(args, kwargs), prepend=True, with_kwargs=True
        )
        guard_model(wrapped, strategy, self.session.calls)
        if strategy.server.serves:  # parameter servers: workers may train apart (asynchronously), nothing to compare
            self._first.done = True
        if strategy.server.serves or strategy.every_rank_reason() is None or not self.session.calls.enabled:
            self._outside.done = True  # no meeting brings every rank to a forward outside par.step

    def _forward(self, args: tuple, kwargs: dict[str, Any]) -> None:
        batch = args[0] if args else next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)
        if self.session.calls.within("par.step"):
            self.first_batch(batch)
        elif self.joined:
            self._compare(self._outside, batch, "their first forward outside par.step", across=False)

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, strategy: Strategy) -> torch.optim.Optimizer:
        guard_optimizer(optimizer, strategy, self.session.calls)
        return optimizer

    def streams(self, seed: int | None, replica: int, rank: int) -> None:
        """Model init is done: each replica (a tp group, a pipeline's stages: ``replica``) to a stream of its own."""
        if self._base is not None:
            replica_stream(self._base, replica)
        elif seed is not None:
            seed_all(rank_seed(seed, rank))

    def first_batch(self, batch: Any) -> None:
        """Warn once when two replicas feed the model the same first batch, or the ranks of one replica different
        ones (from ``forward_backward``, or a forward inside ``par.step``)."""
        if self.joined:
            self._compare(self._first, batch, "the first step", across=True)

    def _compare(self, first: FirstBatch, batch: Any, when: str, across: bool) -> None:
        if first.done:
            return
        mesh, replica = self.chosen.mesh, self.chosen.data_parallel(self.runtime())[0]
        names, sizes = (mesh.mesh_dim_names or (), tuple(mesh.shape)) if mesh is not None else ((), ())
        group = shared_by(names, sizes)
        if across or group != ONE_REPLICA:  # alike on every rank: all of them gather, or none
            first.check(batch, replica, group, self.session.device, when=when, across=across)
