from collections import Counter

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    SequentialSampler,
    TensorDataset,
    WeightedRandomSampler,
)

from paratrain import ConfigError
from paratrain.data import ShardSampler, map_evenly, shard_loader


def _dataset(n):
    return TensorDataset(torch.arange(n))


def _epoch(n, world, epoch, **kw):
    shards = []
    for rank in range(world):
        s = ShardSampler(_dataset(n), num_replicas=world, rank=rank, shuffle=True, seed=7, **kw)
        s.set_epoch(epoch)
        shards.append(list(s))
    return shards


@pytest.mark.parametrize("n, world", [(100, 2), (100, 4), (12, 3)])
def test_every_sample_exactly_once_when_the_world_divides(n, world):
    shards = _epoch(n, world, 0)
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert len({len(s) for s in shards}) == 1


@pytest.mark.parametrize("n, world", [(101, 2), (10, 4), (7, 3)])
def test_uneven_mode_sees_every_sample_exactly_once(n, world):
    shards = _epoch(n, world, 3, even=False)
    assert sorted(i for s in shards for i in s) == list(range(n))
    assert max(map(len, shards)) - min(map(len, shards)) <= 1


def test_even_mode_pads_the_tail_with_at_most_world_minus_one_repeats():
    n, world = 10, 4
    shards = _epoch(n, world, 0)
    counts = Counter(i for s in shards for i in s)
    assert set(counts) == set(range(n))
    assert sum(c - 1 for c in counts.values()) == 2  # 12 slots for 10 samples
    assert len({len(s) for s in shards}) == 1


def test_even_mode_with_drop_last_drops_the_tail_and_repeats_nothing():
    shards = _epoch(10, 4, 0, drop_last=True)
    flat = [i for s in shards for i in s]
    assert len(flat) == len(set(flat)) == 8


def test_order_changes_every_epoch_and_is_reproducible():
    e0, e1, e0_again = _epoch(64, 2, 0), _epoch(64, 2, 1), _epoch(64, 2, 0)
    assert e0 != e1 and e0 == e0_again
    assert sorted(e0[0] + e0[1]) == sorted(e1[0] + e1[1])


def _times_ten(batch):
    return torch.stack([b[0] for b in batch]) * 10


@pytest.mark.launched
def test_shard_loader_keeps_the_users_settings():
    # a spawned worker: forking the test process, whose earlier tests left threads (inductor's, executors'), can
    # deadlock the child on a lock one of them held
    loader = DataLoader(
        _dataset(20),
        batch_size=3,
        shuffle=False,
        drop_last=True,
        collate_fn=_times_ten,
        num_workers=1,
        prefetch_factor=4,
        multiprocessing_context="spawn",
    )
    out = shard_loader(loader, rank=1, world_size=2, seed=0)
    assert (out.batch_size, out.drop_last, out.num_workers, out.prefetch_factor) == (3, True, 1, 4)
    assert out.multiprocessing_context is loader.multiprocessing_context
    assert isinstance(out.sampler, ShardSampler) and not out.sampler.shuffle
    batches = list(out)
    assert [b.tolist() for b in batches] == [[10, 30, 50], [70, 90, 110], [130, 150, 170]]


def test_shard_loader_reads_a_batch_sampler_and_keeps_shuffle():
    loader = DataLoader(_dataset(20), batch_sampler=BatchSampler(torch.utils.data.RandomSampler(range(20)), 4, False))
    out = shard_loader(loader, rank=0, world_size=2, seed=0)
    assert out.batch_size == 4 and out.sampler.shuffle


def test_custom_samplers_are_refused_with_a_fix():
    weighted = DataLoader(_dataset(4), sampler=WeightedRandomSampler([1.0] * 4, 4))
    with pytest.raises(ConfigError, match="shard=False"):
        shard_loader(weighted, rank=0, world_size=2, seed=0)
    custom = DataLoader(_dataset(4), batch_sampler=[[0, 1], [2, 3]])
    with pytest.raises(ConfigError, match="batch_sampler"):
        shard_loader(custom, rank=0, world_size=2, seed=0)


def test_sequential_sampler_is_not_shuffled():
    loader = DataLoader(_dataset(8), sampler=SequentialSampler(range(8)), batch_size=2)
    out = shard_loader(loader, rank=0, world_size=2, seed=0)
    assert [b[0].tolist() for b in out] == [[0, 2], [4, 6]]


def test_map_evenly_without_a_process_group_is_a_plain_map():
    assert map_evenly(lambda i: i * 10, [1, 2], group=None, device="cpu") == [10, 20]


def _peer_holds(monkeypatch, peer: int) -> None:
    """The all-reduce of ``map_evenly`` as on two ranks, the other holding ``peer`` items."""

    def all_reduce(counts, op, group):
        counts.copy_(torch.maximum(counts, torch.tensor([peer, -peer])))

    monkeypatch.setattr("paratrain.data.dist.is_initialized", lambda: True)
    monkeypatch.setattr("paratrain.data.dist.all_reduce", all_reduce)


def test_map_evenly_repeats_the_last_item_up_to_the_most_any_rank_holds_and_drops_the_repeats(monkeypatch):
    _peer_holds(monkeypatch, 3)
    calls = []
    results = map_evenly(lambda i: calls.append(i) or i * 10, iter([1, 2]), group=None, device="cpu")
    assert results == [10, 20] and calls == [1, 2, 2]


def test_map_evenly_refuses_a_rank_with_nothing_to_repeat(monkeypatch):
    _peer_holds(monkeypatch, 3)
    with pytest.raises(ConfigError, match="a rank has no item where another has 3"):
        map_evenly(lambda i: i, [], group=None, device="cpu")
