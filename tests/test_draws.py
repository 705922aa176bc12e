"""The first-batch comparison of :mod:`paratrain.draws` on given digests (no process): the ranks of one replica must
read one batch, two replicas must not."""

from __future__ import annotations

from paratrain.draws import _disagreement, shared_by


def test_the_ranks_of_one_replica_reading_apart_are_named_with_the_seed_to_use():
    line = _disagreement([(7, 4, 0), (8, 4, 0), (9, 4, 1), (9, 4, 1)], "a tp group", "the first step", True)
    assert line is not None and line.startswith("ranks 0 and 1 of a tp group got different inputs at the first step")
    assert "seed per data-parallel replica (par.data_parallel_rank), not par.rank" in line


def test_one_batch_per_replica_and_ranks_given_none_are_silent():
    assert _disagreement([(7, 4, 0), (7, 4, 0), (9, 4, 1), (-1, 0, 1)], "a pp group", "the first step", True) is None


def test_two_replicas_reading_one_batch_are_still_named():
    alike = [(7, 4, 0), (7, 4, 0), (7, 4, 1), (7, 4, 1)]
    line = _disagreement(alike, "a tp group", "the first step", True)
    assert line is not None and line.startswith("data-parallel replicas 0 and 1 fed the model identical first batches")
    assert _disagreement(alike, "a tp group", "their first forward outside par.step", False) is None  # generation


def test_the_group_is_named_by_the_mesh_dimensions_a_replica_spans():
    assert shared_by(("dp", "tp"), (2, 2)) == "a tp group"
    assert shared_by(("dp", "pp", "tp"), (1, 2, 2)) == "a pp x tp group"
    assert shared_by(("dp",), (4,)) == "one replica"
