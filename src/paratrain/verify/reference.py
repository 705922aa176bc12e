"""The single-process half of verify: the same setup, trained on the global batch, in this process.

It runs the user's own loop (``VerifySpec.train``, else :func:`~paratrain.verify.spec.paratrain_loop`) with
``Parallel("single")`` and the spec's own ``Parallel`` keywords (its clipping, seed, precision; strategy options
mean nothing in one process), from rank 0's initial weights, so whatever the loop does besides the step (a scheduler,
clipping, its epochs) happens in both runs.

When the parallel run read its data through the spec's loader, the reference's loader yields, at every optimizer
step, exactly the samples that all data-parallel ranks together should read for that step (a distributed sampler's
split of each epoch's order, every pass of the loader the next epoch), as one batch: the math the parallel run must
equal, whatever the loop does with the loader. When accumulation windows hold whole micro-batches and stay inside an
epoch, the reference does not accumulate (one batch per optimizer step), so a loop that forgets to divide the loss
shows; otherwise it accumulates the ranks' micro-batches the way the parallel run does.

When the loop reads from anything else (a loader class of its own, index draws into a tensor), the reference
replays what the parallel run fed: at every training call of the prepared model, and every call of the spec's
loss, the tensors the loop passes are replaced by that micro-step's recorded ones, the data-parallel replicas'
joined along dim 0, so the reference computes on the global batch whatever fed the loop. When every step fed
``accumulate`` micro-batches, it first takes each window as one batch (``par.accumulate`` 1 in the reference, so a
loop that forgets to divide, or divides twice, shows); a loop that then still calls the model more than once a
step (its micro-steps counted by a number of its own) is replayed micro-step by micro-step instead.

The same run a second time, its batches in another order (and, under a 16-bit compute dtype, each forward on the
parallel run's micro-batches), measures the noise floor (:mod:`.floor`).
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.data import DataLoader

from ..batch import find_loss
from ..data import ShardSampler
from ..env import ClusterEnv
from ..parallel import Parallel
from ..settings import JobConfig
from .distributed import DataSetup
from .floor import split_like_ranks
from .record import Feed, Record, RecordHooks, feed_digest, run_loop, training_call
from .spec import Loss, VerifySpec, build_spec

ORDERS = ("global", "shards")
"""``global``: each batch in the epoch's order, sample by sample across the replicas; ``shards``: the replicas'
shards one after the other, the last replica first and each one reversed (every sum then adds in another order)."""


NOTHING_FED = (
    "the parallel run's loop fed the prepared model nothing verify could record (a pipeline takes its batches in "
    "par.forward_backward's schedule): to check a pipeline, have the loop read through VerifySpec.loader"
)


class ReplayMismatch(Exception):
    """The reference's loop fed the model or the loss other than the parallel run's recording allows."""


@dataclass(frozen=True, kw_only=True)
class Feeds:
    """What the parallel run fed its model (``inputs``) and the spec's loss (``targets``): per data-parallel
    replica (in replica order; the ranks of one tp/cp group or pipeline read the same batch), per optimizer step,
    per call, the call's tensors."""

    inputs: list[list[list[Feed]]]
    targets: list[list[list[Feed]]]
    first_call: tuple[tuple, dict] | None = None
    """The first training call as the loop made it (and ``first_targets``, its loss's targets): the structure the
    first step's global batch is handed in outside the loop (:func:`global_first`)."""
    first_targets: Any = None

    def every_step_calls(self, n: int) -> bool:
        """Every replica called the model ``n`` times in every step (and the loss, when called, as often)."""
        return all(len(calls) == n for replica in self.inputs for calls in replica) and all(
            len(calls) in (0, n) for replica in self.targets for calls in replica
        )

    def micro_batch(self) -> int:
        """The samples of one replica's first call (the parallel run's micro-batch)."""
        first = self.inputs[0][0][0] if self.inputs[0] and self.inputs[0][0] else []
        return next((t.shape[0] for t in first if t.dim()), 0)

    def digest(self) -> str:
        h = hashlib.sha256()
        for kind in (self.inputs, self.targets):
            for replica in kind:
                for step in replica:
                    h.update(f"step {len(step)}|".encode())
                    for call in step:
                        h.update(feed_digest(call).encode())
        return h.hexdigest()

    def joined(self, kind: str, group: int, order: str) -> list[list[Feed]]:
        """Per step, per reference call: ``group`` consecutive calls of every replica joined along dim 0 (replica
        by replica; ``shards`` order: the last first, each reversed, so every sum adds in another order)."""
        replicas = getattr(self, kind)
        out = []
        for s in range(min(len(r) for r in replicas)):
            calls = min(len(r[s]) for r in replicas)
            step = []
            for k in range(0, calls, group):
                pieces = [r[s][m] for r in replicas for m in range(k, min(k + group, calls))]
                if order == "shards":
                    pieces = [[t.flip(0) if t.dim() else t for t in piece] for piece in reversed(pieces)]
                step.append([_join([piece[i] for piece in pieces]) for i in range(min(len(p) for p in pieces))])
            out.append(step)
        return out


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    """The replicas' tensors of one argument as one batch (a 0-d tensor is the same on every replica)."""
    return torch.cat(parts) if parts[0].dim() else parts[0]


class Replay:
    """Feeds the reference's model and loss the parallel run's batches: at every training call of step s, the
    next of step s's joined batches replaces the tensors the loop passed (the rest of the call stays the loop's)."""

    def __init__(self, inputs: list[list[Feed]], targets: list[list[Feed]]) -> None:
        self.inputs, self.targets = inputs, targets
        self._record = Record()
        self._calls: Counter[tuple[str, int]] = Counter()
        self.replaying: Callable[[], bool] = lambda: True
        """Whether a training call now is one of a step's (a script's own evaluation forwards are not)."""

    def attach(self, model: nn.Module, record: Record) -> None:
        """Replay into the prepared ``model``'s training calls, reading the step from ``record``."""
        self._record = record
        model.register_forward_pre_hook(self._forward, prepend=True, with_kwargs=True)

    def _forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not training_call(module) or not self.replaying():
            return None
        return _substitute((args, kwargs), self._next("model", self.inputs))

    def wrap_loss(self, loss: Loss | None) -> Loss | None:
        if loss is None:
            return None

        def replayed(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled():
                targets = _substitute(targets, self._next("loss", self.targets))
            return loss(outputs, targets)

        return replayed

    def _next(self, what: str, batches: list[list[Feed]]) -> Feed:
        step = self._record.steps
        call = self._calls[what, step]
        self._calls[what, step] += 1
        if step >= len(batches) or call >= len(batches[step]):
            raise ReplayMismatch(
                f"the loop called the {what} {call + 1} times in step {step} in one process, the parallel run "
                f"{len(batches[step]) if step < len(batches) else 0} times (a replica's share joined per call)"
            )
        return batches[step][call]


def _substitute(tree: Any, feed: Feed) -> Any:
    """``tree`` with its tensors replaced by ``feed``'s, in order, each on the device of the one it replaces."""
    leaves, spec = tree_flatten(tree)
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    if len(slots) != len(feed):
        raise ReplayMismatch(f"the loop passed {len(slots)} tensors where the parallel run passed {len(feed)}")
    for i, tensor in zip(slots, feed):
        leaves[i] = tensor.to(leaves[i].device)
    return tree_unflatten(leaves, spec)


class GlobalBatches:
    """Batch sampler of the global batches: each pass over it is the next epoch, each batch what every replica
    reads for one optimizer step (``group`` micro-batches each), in the given order."""

    def __init__(self, data: DataSetup, group: int, order: str) -> None:
        self.data, self.group, self.order = data, group, order
        self.epoch = 0

    def _micro_batches(self, epoch: int) -> list[list[list[int]]]:
        """Per replica, its micro-batches of ``epoch``."""
        d = self.data
        out = []
        for replica in range(d.replicas):
            sampler = ShardSampler(
                range(d.size),
                num_replicas=d.replicas,
                rank=replica,
                shuffle=d.shuffle,
                seed=d.seed,
                drop_last=d.drop_last,
            )
            sampler.set_epoch(epoch)
            order = list(sampler)
            batches = [order[i : i + d.micro_batch] for i in range(0, len(order), d.micro_batch)]
            out.append([b for b in batches if len(b) == d.micro_batch or not d.drop_last])
        return out

    def __iter__(self) -> Iterator[list[int]]:
        epoch, self.epoch = self.epoch, self.epoch + 1
        shards = self._micro_batches(epoch)
        for i in range(0, len(shards[0]), self.group):
            parts = [sum(micro[i : i + self.group], []) for micro in shards]
            if self.order == "global":
                yield [index for column in zip(*parts) for index in column]
            else:
                yield [index for part in reversed(parts) for index in reversed(part)]

    def __len__(self) -> int:
        return -(-len(self._micro_batches(0)[0]) // self.group)


def whole_windows(data: DataSetup, accumulate: int) -> bool:
    """True when every accumulation window is whole micro-batches inside one epoch: then one batch of the window's
    samples is the same math, and the reference takes it without accumulating."""
    per_replica = data.per_replica
    full = data.drop_last or per_replica % data.micro_batch == 0
    return accumulate == 1 or (full and (per_replica // data.micro_batch) % accumulate == 0)


def reference_run(
    factory: str,
    init_state: dict[str, torch.Tensor],
    data: DataSetup | None,
    accumulate: int,
    steps: int,
    order: str = "global",
    feeds: Feeds | None = None,
) -> Record:
    """``steps`` optimizer steps of the factory's setup in one process on the global batches; ``accumulate``: the
    parallel run's micro-batches per step (from the spec's ``accumulate`` or global batch). Without ``feeds`` the
    global batches are the samples of the spec's loader that a distributed sampler gives the replicas (``data``);
    with them, the batches the parallel run fed its model and loss, replayed (see the module docstring)."""
    if feeds is not None:
        return _replay_run(factory, init_state, feeds, accumulate, steps, order)
    assert data is not None, "a run that read through the spec's loader has its split"
    spec = build_spec(factory)
    group = accumulate if whole_windows(data, accumulate) else 1
    batches = GlobalBatches(data, group, order)
    if len(batches) == 0:
        return Record(window=group)
    loader = DataLoader(spec.loader.dataset, batch_sampler=batches, collate_fn=spec.loader.collate_fn)
    split = data.micro_batch if order != ORDERS[0] else None
    record = _train(spec, init_state, loader, accumulate // group, steps, split=split)
    record.window = group
    return record


def _replay_run(
    factory: str, init_state: dict[str, torch.Tensor], feeds: Feeds, accumulate: int, steps: int, order: str
) -> Record:
    split = feeds.micro_batch() if order != ORDERS[0] else None

    def train(group: int, replay: Replay) -> Record:
        spec = build_spec(factory)
        return _train(spec, init_state, spec.loader, accumulate // group, steps, replay, split)

    return replay_run(train, feeds, accumulate, order, lambda: global_first(build_spec(factory), init_state, feeds))


def replay_run(
    train: Callable[[int, Replay], Record],
    feeds: Feeds,
    accumulate: int,
    order: str,
    first: Callable[[], tuple[float, float]],
) -> Record:
    """The reference on the replayed batches: ``train(group, replay)`` runs the user's loop with ``par.accumulate``
    ``accumulate // group``, fed by ``replay``. A whole window as one batch when every step of the parallel run fed
    ``accumulate`` micro-batches and the loop, given ``par.accumulate`` 1, calls the model once a step; else each
    micro-step's batch of every replica, accumulating as the parallel run did. ``first``: :func:`global_first`."""
    if not any(calls for replica in feeds.inputs for calls in replica):
        return Record(error=NOTHING_FED, replayed=True)
    windows = [accumulate] if accumulate > 1 and feeds.every_step_calls(accumulate) else []
    for group in [*windows, 1]:
        replay = Replay(feeds.joined("inputs", group, order), feeds.joined("targets", group, order))
        try:
            record = train(group, replay)
        except ReplayMismatch as err:
            if group == 1:
                return Record(error=str(err), replayed=True)
            continue
        record.window, record.replayed = group, True
        if record.error is None and feeds.first_call is not None:
            record.global_first = first()
        return record
    raise AssertionError("unreachable: the last try accumulates and returns")


def global_first(spec: VerifySpec, init_state: dict[str, torch.Tensor], feeds: Feeds) -> tuple[float, float]:
    """(loss, gradient norm) of one backward of the spec's loss (or the model's own) on the first step's global
    batch (every micro-step of every replica joined), at the initial weights, outside the user's loop."""
    model = spec.model.cpu()
    model.load_state_dict(init_state)
    model.train()
    whole = max(len(calls) for replica in feeds.inputs for calls in replica[:1])
    args, kwargs = _substitute(feeds.first_call, feeds.joined("inputs", whole, "global")[0][0])
    out = model(*args, **kwargs)
    if spec.loss is None:
        loss = find_loss(out)
    else:
        loss = spec.loss(out, _substitute(feeds.first_targets, feeds.joined("targets", whole, "global")[0][0]))
    loss.backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
    return float(loss.detach()), float(norm)


def _train(
    spec: VerifySpec,
    init_state: dict[str, torch.Tensor],
    loader: DataLoader | None,
    accumulate: int,
    steps: int,
    replay: Replay | None = None,
    split: int | None = None,
) -> Record:
    """The spec's loop in this process with ``Parallel("single")`` from ``init_state``; ``split``: the parallel
    run's micro-batch, each forward's size under a 16-bit compute dtype (the noise floor's twin, :mod:`.floor`)."""
    model = spec.model.cpu()
    model.load_state_dict(init_state)
    recorder = RecordHooks(model, own_loss=spec.loss is None)
    shared = dict(spec.run_options.shared)
    job = replace(shared.pop("job", None) or JobConfig(), env=ClusterEnv())  # one process, whatever the script's
    par = Parallel("single", accumulate=accumulate, accelerator="cpu", monitor=False, job=job, **shared)
    model, optimizer = par.prepare(model, spec.build_optimizer())
    split_like_ranks(model, split, par.precision)
    try:
        run_loop(spec, par, model, optimizer, loader, recorder, lambda: steps, keep_states=True, replay=replay)
    finally:
        par.close()
    return recorder.record
