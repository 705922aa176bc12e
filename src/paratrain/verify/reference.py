"""The single-process half of verify: the same setup, trained on the global batch, in this process.

It runs the user's own loop (``VerifySpec.train``, else :func:`~paratrain.verify.spec.paratrain_loop`) with
``Parallel("single")`` and the spec's own ``Parallel`` keywords (its clipping, seed, precision; strategy options
mean nothing in one process), from rank 0's initial weights, so whatever the loop does besides the step (a scheduler,
clipping, its epochs) happens in both runs. Its loader yields, at every optimizer step, exactly the samples that
all data-parallel ranks together should read for that step (a distributed sampler's split of each epoch's order,
every pass of the loader the next epoch), as one batch: the math the parallel run must equal, whatever the loop
does with the loader. When accumulation windows hold whole micro-batches and stay inside an epoch, the reference
does not accumulate (one batch per optimizer step), so a loop that forgets to divide the loss shows; otherwise it
accumulates the ranks' micro-batches the way the parallel run does.

The same run a second time, its batches in another order, measures the noise floor (:mod:`.floor`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

import torch
from torch.utils.data import DataLoader

from ..data import ShardSampler
from ..env import ClusterEnv
from ..parallel import Parallel
from ..settings import JobConfig
from .distributed import DataSetup
from .record import Record, RecordHooks, run_loop
from .spec import build_spec

ORDERS = ("global", "shards")
"""``global``: each batch in the epoch's order, sample by sample across the replicas; ``shards``: the replicas'
shards one after the other, the last replica first and each one reversed (every sum then adds in another order)."""


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
    data: DataSetup,
    accumulate: int,
    steps: int,
    order: str = "global",
) -> Record:
    """``steps`` optimizer steps of the factory's setup in one process on the global batches of ``data``;
    ``accumulate``: the parallel run's micro-batches per step (from the spec's ``accumulate`` or global batch)."""
    spec = build_spec(factory)
    model = spec.model.cpu()
    model.load_state_dict(init_state)
    recorder = RecordHooks(model, own_loss=spec.loss is None)
    group = accumulate if whole_windows(data, accumulate) else 1
    batches = GlobalBatches(data, group, order)
    if len(batches) == 0:
        return recorder.record
    loader = DataLoader(spec.loader.dataset, batch_sampler=batches, collate_fn=spec.loader.collate_fn)
    shared = dict(spec.run_options.shared)
    job = replace(shared.pop("job", None) or JobConfig(), env=ClusterEnv())  # one process, whatever the script's
    par = Parallel("single", accumulate=accumulate // group, accelerator="cpu", monitor=False, job=job, **shared)
    model, optimizer = par.prepare(model, spec.build_optimizer())
    run_loop(spec, par, model, optimizer, loader, recorder, steps, keep_states=True)
    par.close()
    return recorder.record
