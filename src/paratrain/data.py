"""Per-rank data: re-build the user's DataLoader around a distributed sampler.

Everything the user set on the loader is kept (shuffle, per-rank batch size, drop_last, workers, collate,
pinning); only the sampler changes, so each rank reads a disjoint shard and the order changes every epoch.

The tail, when the dataset size N does not divide by the world size W:

* ``even=True`` (training, the default): every rank gets ceil(N/W) samples, the shard is padded with the
  first samples of the epoch's order, so up to W-1 samples are seen twice per epoch. Ranks then run the same
  number of steps, which collective training needs. With the loader's ``drop_last=True`` the tail of up to
  W-1 samples is dropped instead, and nothing is seen twice.
* ``even=False`` (evaluation): every sample is seen exactly once; ranks differ by at most one sample.
  Use it for metrics, where a rank with one batch fewer does no harm.
"""
from __future__ import annotations

import warnings
from collections.abc import Iterator

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, SequentialSampler
from torch.utils.data.distributed import DistributedSampler

from .errors import ConfigError


class ShardSampler(DistributedSampler):
    """``DistributedSampler`` that can also shard without padding (``even=False``)."""

    def __init__(self, dataset, *, num_replicas: int, rank: int, shuffle: bool, seed: int = 0,
                 drop_last: bool = False, even: bool = True) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed,
                         drop_last=drop_last)
        self.even = even
        if not even:
            n = len(dataset)  # type: ignore[arg-type]
            self.num_samples = len(range(rank, n, num_replicas))
            self.total_size = n

    def __iter__(self) -> Iterator[int]:
        if self.even:
            return super().__iter__()
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=g).tolist()
        else:
            order = list(range(n))
        return iter(order[self.rank : n : self.num_replicas])


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


def shard_loader(loader: DataLoader, *, rank: int, world_size: int, seed: int, even: bool = True,
                 generator: torch.Generator | None = None) -> DataLoader:
    """A copy of ``loader`` whose sampler gives this rank its shard; all other settings are kept."""
    if isinstance(loader.dataset, IterableDataset):
        warnings.warn(
            "IterableDataset is not sharded by paratrain: every rank must read its own part of the stream",
            stacklevel=3,
        )
        return loader
    shuffle, batch_size, drop_last = describe_sampler(loader)
    sampler = ShardSampler(loader.dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed,
                           drop_last=drop_last, even=even)
    extra = {}
    if loader.num_workers > 0:
        extra = {"prefetch_factor": loader.prefetch_factor, "persistent_workers": loader.persistent_workers}
    return DataLoader(
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
