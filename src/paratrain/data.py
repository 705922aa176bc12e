"""Per-rank data: re-build the user's DataLoader around a distributed sampler.

Everything the user set on the loader is kept (shuffle, per-rank batch size, drop_last, workers, collate,
pinning); only the sampler changes, so each rank reads a disjoint shard and the order changes every epoch.

The tail, when the dataset size N does not divide by the world size W:

* ``even=True`` (training, the default): every rank gets ceil(N/W) samples, the shard is padded with the
  first samples of the epoch's order, so up to W-1 samples are seen twice per epoch. Ranks then run the same
  number of steps, which collective training needs. With the loader's ``drop_last=True`` the tail of up to
  W-1 samples is dropped instead, and nothing is seen twice.
* ``even=False`` (evaluation): every sample is seen exactly once; ranks differ by at most one sample.
  Use it for metrics, where a rank with one batch fewer does no harm, unless each forward needs every rank
  (zero3, tp, pipelines): :func:`map_evenly` then repeats a batch on the ranks with fewer and drops its result.

A prepared loader also knows where its current pass stands (:class:`ShardedLoader`), so a checkpoint taken in
the middle of an epoch resumes with exactly the batches that were not trained yet.
"""

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .errors import CheckpointError, ConfigError
from .seeding import rank_seed

T, R = TypeVar("T"), TypeVar("R")


class ShardSampler(DistributedSampler):
    """``DistributedSampler`` that can also shard without padding (``even=False``)."""

    def __init__(
        self,
        dataset,
        *,
        num_replicas: int,
        rank: int,
        shuffle: bool,
        seed: int = 0,
        drop_last: bool = False,
        even: bool = True,
    ) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.even = even
        self.skip = 0
        """Samples of this rank's shard that the next pass leaves out (they were trained before a checkpoint)."""
        if not even:
            n = len(dataset)  # type: ignore[arg-type]
            self.num_samples = len(range(rank, n, num_replicas))
            self.total_size = n

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        if self.even:
            return itertools.islice(super().__iter__(), skip, None)
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        return iter(order[self.rank : n : self.num_replicas][skip:])


class ShardedLoader(DataLoader):
    """A ``DataLoader`` over a :class:`ShardSampler` that remembers where its current pass stands.

    ``state_dict()`` says which epoch the latest pass belongs to, how many batches it yielded and the loader
    generator's state when the pass began; ``load_state_dict()`` makes the next pass of that epoch yield only the
    batches after those, drawing the same worker seeds. ``before_fetch`` (set by ``Parallel``) runs before each
    batch is fetched: the one moment between two steps at which a checkpoint sees everything the previous step
    did and nothing of the next.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.before_fetch: Callable[[], None] | None = None
        self._pass: dict[str, Any] = {"epoch": None, "batches": 0, "finished": False, "generator": None}
        self._resume: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        sampler = self.sampler
        assert isinstance(sampler, ShardSampler)
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] != sampler.epoch:
            resume = None  # the user moved on to another epoch: that one starts from its beginning
        if resume is not None and resume["generator"] is not None and self.generator is not None:
            self.generator.set_state(resume["generator"])
        generator = self.generator.get_state() if self.generator is not None else None
        batches = 0
        if resume is not None:
            sampler.skip = resume["skip"]
            batches = resume["batches"]
        self._pass = {"epoch": sampler.epoch, "batches": batches, "finished": False, "generator": generator}
        return self._track(super().__iter__())

    def _track(self, inner: Iterator[Any]) -> Iterator[Any]:
        while True:
            if self.before_fetch is not None:
                self.before_fetch()
            try:
                batch = next(inner)
            except StopIteration:
                self._pass["finished"] = True
                return
            self._pass["batches"] += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Where the latest pass stands (plain values and a tensor: checkpoint-safe)."""
        sampler = self.sampler
        assert isinstance(sampler, ShardSampler)
        return {**self._pass, "batch_size": self.batch_size, "replicas": sampler.num_replicas}

    def load_state_dict(self, state: dict[str, Any], epoch: int | None) -> None:
        """Make the next pass continue the one ``state`` describes, if that pass belongs to ``epoch``.

        ``epoch`` is the epoch the job resumes in (None: the job does not count epochs, so only an unfinished
        pass is continued). The position carries over to another world size or per-rank batch size when the
        samples already trained fill whole new global batches.
        """
        if state["epoch"] is None or (epoch is not None and state["epoch"] != epoch):
            return
        if epoch is None and state["finished"]:
            return
        sampler = self.sampler
        assert isinstance(sampler, ShardSampler) and self.batch_size is not None
        batches, size, replicas = state["batches"], state["batch_size"], state["replicas"]
        if (size, replicas) == (self.batch_size, sampler.num_replicas):
            skip = batches * size
        else:
            trained = batches * size * replicas  # a prefix of the epoch's global order (see ShardSampler)
            step = self.batch_size * sampler.num_replicas
            if state["finished"]:
                skip = sampler.num_samples
            elif trained % step:
                raise CheckpointError(
                    f"cannot continue the interrupted epoch with {sampler.num_replicas} replica(s) x batch "
                    f"{self.batch_size}: {trained} of its samples were trained, not a whole number of global "
                    f"batches of {step}; resume with a global batch dividing {trained}, or from a checkpoint "
                    "taken at the end of an epoch"
                )
            else:
                skip, batches = trained // sampler.num_replicas, trained // step
        self._resume = {
            "epoch": state["epoch"],
            "skip": min(skip, sampler.num_samples),
            "batches": batches,
            "generator": state["generator"] if replicas == sampler.num_replicas else None,
        }


def describe_sampler(loader: DataLoader) -> tuple[bool, int, bool]:
    """(shuffle, per-rank batch size, drop_last) as the user configured ``loader``."""
    if loader.batch_size is not None:
        sampler, batch_size, drop_last = loader.sampler, loader.batch_size, loader.drop_last
    elif isinstance(loader.batch_sampler, BatchSampler):
        bs = loader.batch_sampler
        sampler, batch_size, drop_last = bs.sampler, bs.batch_size, bs.drop_last
    else:
        raise ConfigError(
            f"cannot shard a DataLoader with a custom batch_sampler ({type(loader.batch_sampler).__name__}); "
            "make it rank-aware yourself and pass shard=False to prepare_loader"
        )
    if isinstance(sampler, RandomSampler):
        shuffle = True
    elif isinstance(sampler, (SequentialSampler, DistributedSampler)):
        shuffle = getattr(sampler, "shuffle", False)
    else:
        raise ConfigError(
            f"cannot shard a DataLoader with a custom sampler ({type(sampler).__name__}); "
            "make it rank-aware yourself and pass shard=False to prepare_loader"
        )
    return shuffle, batch_size, drop_last


def _refuse_empty(samples: int, per_rank: int, batch_size: int, drop_last: bool, world_size: int) -> None:
    """A training loader that gives every rank zero batches trains nothing, silently: refuse it."""
    batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    if batches == 0:
        raise ConfigError(
            f"this loader gives each of the {world_size} data-parallel ranks 0 batches ({samples} "
            f"samples, {per_rank} per rank, batch size {batch_size}, drop_last={drop_last}): an epoch "
            "would take no optimizer step; use drop_last=False, a smaller batch or fewer ranks"
        )


def prepare_loader(loader: DataLoader, *, rank: int, size: int, seed: int, even: bool, required: bool) -> DataLoader:
    """``loader``'s shard ``rank`` of ``size``, shuffled by ``seed`` and drawing worker seeds from a per-rank
    generator. With ``required`` False (one process) a loader that cannot be rebuilt is kept as it is; sharded into
    one, the others are tracked all the same, so a checkpoint knows their position."""
    if not required and not shardable(loader):
        return loader
    generator = torch.Generator()
    generator.manual_seed(rank_seed(seed, rank))
    return shard_loader(loader, rank=rank, world_size=size, seed=seed, even=even, generator=generator)


def shardable(loader: DataLoader) -> bool:
    """True when ``shard_loader`` can rebuild ``loader``: a map-style dataset and a built-in sampler."""
    if isinstance(loader.dataset, IterableDataset):
        return False
    try:
        describe_sampler(loader)
    except ConfigError:
        return False
    return True


def shard_loader(
    loader: DataLoader,
    *,
    rank: int,
    world_size: int,
    seed: int,
    even: bool = True,
    generator: torch.Generator | None = None,
) -> DataLoader:
    """A copy of ``loader`` whose sampler gives this rank its shard; all other settings are kept."""
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            "IterableDataset is not sharded by paratrain: every rank must read its own part of the stream",
            stacklevel=3,
        )
        return loader
    shuffle, batch_size, drop_last = describe_sampler(loader)
    sampler = ShardSampler(
        loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last, even=even
    )
    if even:
        _refuse_empty(len(loader.dataset), len(sampler), batch_size, drop_last, world_size)
    extra = {}
    if loader.num_workers > 0:
        extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers}
    return ShardedLoader(
        loader.dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        drop_last=drop_last,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=generator if generator is not None else loader.generator,
        pin_memory_device=loader.pin_memory_device,
        **extra,
    )


def map_evenly(
    fn: Callable[[T], R], items: Iterable[T], *, group: dist.ProcessGroup | None, device: torch.device
) -> list[R]:
    """``[fn(item) for item in items]``, with ``fn`` called on every rank of ``group`` as often as on the rank with
    the most items: a rank with fewer calls it again on its last item and drops the result, so a model whose every
    forward needs every rank evaluates items split unevenly over the ranks (collective: one all-reduce of the
    counts over ``group``; with no process group, a plain map)."""
    try:
        count = len(items)  # type: ignore[arg-type]
    except TypeError:
        items = list(items)
        count = len(items)
    most = fewest = count
    if dist.is_initialized():
        counts = torch.tensor([count, -count], device=device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX, group=group)
        most, minus_fewest = counts.tolist()
        fewest = -minus_fewest
    if fewest == 0 < most:
        raise ConfigError(
            f"par.map_evenly: a rank has no item where another has {most}, and needs one to repeat: give every rank "
            "at least one (more items or fewer ranks)"
        )
    results, last = [], None
    for last in items:
        results.append(fn(last))
    for _ in range(most - len(results)):
        fn(last)  # type: ignore[arg-type]
    return results
