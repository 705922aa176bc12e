"""DDP on real gloo processes: parallel equals serial, data coverage, seeding, metrics."""
import pytest
import torch
from helpers.dist_workers import (
    epoch_indices,
    existing_group_is_reused,
    reductions,
    seeding_probe,
    train_params,
    unused_parameter_error,
)

from paratrain.testing import max_abs_diff, spawn

pytestmark = pytest.mark.launched  # every test here starts processes

STEPS, BATCH = 20, 8


def _serial(accumulate: int, world: int) -> dict:
    # one process, batch = world x per-rank batch: the same global batches as the parallel run
    return train_params("single", accumulate, STEPS, BATCH * world, 1)


@pytest.mark.parametrize("world, accumulate, options", [
    (2, 1, {}),
    (2, 4, {}),
    (2, 2, {"static_graph": True, "gradient_as_bucket_view": True}),
    (4, 1, {"bucket_cap_mb": 0.001}),
])
def test_ddp_equals_single_process_on_the_same_global_batch(world, accumulate, options):
    ranks = spawn(train_params, world, ("ddp", accumulate, STEPS, BATCH, world, options))
    serial = _serial(accumulate, world)
    for params in ranks:
        assert max_abs_diff(params, serial) <= 1e-5
    assert max_abs_diff(ranks[0], ranks[-1]) == 0.0  # replicas are bitwise identical
    assert max_abs_diff(serial, train_params("single", 1, 1, 1, 1)) > 1e-2  # training moved the weights


def test_prepared_loaders_cover_the_data_once_per_epoch_and_reshuffle():
    n = 64
    ranks = spawn(epoch_indices, 2, (n, 3, 5, True))
    for epoch in range(3):
        union = sorted(ranks[0][epoch] + ranks[1][epoch])
        assert union == list(range(n))
    assert ranks[0][0] != ranks[0][1] != ranks[0][2]


def test_uneven_evaluation_loader_sees_each_sample_once():
    ranks = spawn(epoch_indices, 2, (13, 1, 4, False))
    assert sorted(ranks[0][0] + ranks[1][0]) == list(range(13))


def test_seed_everything_same_init_distinct_data_streams():
    a, b = spawn(seeding_probe, 2, (123,))
    assert torch.equal(a["init"], b["init"])
    assert not torch.equal(a["after"], b["after"])
    assert a["worker"] != b["worker"]
    again = spawn(seeding_probe, 2, (123,))
    assert torch.equal(again[0]["after"], a["after"]) and again[1]["worker"] == b["worker"]


def test_metric_reductions_across_ranks():
    for mean, total, vec, isum, count, imean in spawn(reductions, 2):
        assert mean == 0.5 and total == 3.0 and vec == [0.5, 1.0] and isum == 3
        assert f"{count}/512" == "59/512" and isinstance(imean, float) and imean == 0.5  # a count stays an int


def test_a_group_started_by_the_script_is_used_and_left_alone():
    for owns, still in spawn(existing_group_is_reused, 2):
        assert not owns and still


def test_unused_parameters_are_named_with_the_fix():
    for message in spawn(unused_parameter_error, 2):
        assert "spare.weight, spare.bias" in message and "find_unused_parameters=True" in message
        assert "\n" not in message
