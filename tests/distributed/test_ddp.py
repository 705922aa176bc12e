"""DDP on real gloo processes: parallel equals serial, data coverage, seeding, metrics.

The world-2 cases share one launch (``helpers.cases.each_call``, whose group stands for one a script started);
seeding's second run and a failing step each keep theirs.
"""

import pytest
import torch
from helpers.cases import each_call
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
EQUAL = [
    (2, 1, {}),
    (2, 4, {}),
    (2, 2, {"static_graph": True, "gradient_as_bucket_view": True}),
    (4, 1, {"bucket_cap_mb": 0.001}),
]
N = 64


def _calls(world: int) -> list[tuple]:
    calls = [(f"{w} {a} {o}", train_params, ("ddp", a, STEPS, BATCH, w, o), {}) for w, a, o in EQUAL if w == world]
    if world == 2:
        calls += [
            ("epochs", epoch_indices, (N, 3, 5, True), {}),
            ("uneven", epoch_indices, (13, 1, 4, False), {}),
            ("reductions", reductions, (), {}),
            ("seeding", seeding_probe, (123,), {}),
            ("script's group", existing_group_is_reused, (), {}),
        ]
    return calls


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return spawn(each_call, 2, (_calls(2),), timeout_s=180)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return spawn(each_call, 4, (_calls(4),), timeout_s=180)


def _serial(accumulate: int, world: int) -> dict:
    # one process, batch = world x per-rank batch: the same global batches as the parallel run
    return train_params("single", accumulate, STEPS, BATCH * world, 1)


@pytest.mark.parametrize("world, accumulate, options", EQUAL)
def test_ddp_equals_single_process_on_the_same_global_batch(request, world, accumulate, options):
    ranks = [results[f"{world} {accumulate} {options}"] for results in request.getfixturevalue(f"world{world}")]
    serial = _serial(accumulate, world)
    for params in ranks:
        assert max_abs_diff(params, serial) <= 1e-5
    assert max_abs_diff(ranks[0], ranks[-1]) == 0.0  # replicas are bitwise identical
    assert max_abs_diff(serial, train_params("single", 1, 1, 1, 1)) > 1e-2  # training moved the weights


def test_prepared_loaders_cover_the_data_once_per_epoch_and_reshuffle(world2):
    ranks = [results["epochs"] for results in world2]
    for epoch in range(3):
        union = sorted(ranks[0][epoch] + ranks[1][epoch])
        assert union == list(range(N))
    assert ranks[0][0] != ranks[0][1] != ranks[0][2]


def test_uneven_evaluation_loader_sees_each_sample_once(world2):
    ranks = [results["uneven"] for results in world2]
    assert sorted(ranks[0][0] + ranks[1][0]) == list(range(13))


def test_seed_everything_same_init_distinct_data_streams(world2):
    a, b = (results["seeding"] for results in world2)
    assert torch.equal(a["init"], b["init"])
    assert not torch.equal(a["after"], b["after"])
    assert a["worker"] != b["worker"]
    again = spawn(seeding_probe, 2, (123,))
    assert torch.equal(again[0]["after"], a["after"]) and again[1]["worker"] == b["worker"]


def test_metric_reductions_across_ranks(world2):
    for mean, total, vec, isum, count, imean in (results["reductions"] for results in world2):
        assert mean == 0.5 and total == 3.0 and vec == [0.5, 1.0] and isum == 3
        assert f"{count}/512" == "59/512" and isinstance(imean, float) and imean == 0.5  # a count stays an int


def test_a_group_started_by_the_script_is_used_and_left_alone(world2):
    for owns, still in (results["script's group"] for results in world2):
        assert not owns and still


def test_unused_parameters_are_named_with_the_fix():
    for message in spawn(unused_parameter_error, 2):
        assert "spare.weight, spare.bias" in message and "find_unused_parameters=True" in message
        assert "\n" not in message
