"""Pipeline and hybrid strategies on real gloo processes: equal to one process, memory of the schedules,
and clear errors.

One launched job per world size runs every case of the file (``helpers.cases.each_call``): a launch costs more than
training the small model.
"""

import pytest
import torch
from helpers.cases import each_call
from helpers.dist_workers import (
    peak_saved_activations,
    pipeline_bad_inputs,
    pipeline_traffic,
    train_params,
)

from paratrain.testing import max_abs_diff, spawn

STEPS, GLOBAL_BATCH = 20, 16
EQUAL = [
    ("pipeline", 2, 1, {"schedule": "gpipe"}),
    ("pipeline", 2, 2, {"schedule": "gpipe"}),
    ("pipeline", 2, 1, {"schedule": "1f1b"}),
    ("pipeline", 2, 2, {"schedule": "1f1b", "microbatches": 8}),
    ("pipeline", 4, 1, {"schedule": "1f1b", "split": [2, 4, 6]}),  # 4 stages of a 7-layer model
    ("pipeline", 2, 1, {"schedule": "interleaved-1f1b"}),
    ("pipeline", 2, 2, {"schedule": "interleaved-1f1b"}),
    ("hybrid", 4, 1, {}),  # 2 DDP replicas x 2 stages
    ("hybrid", 4, 2, {"schedule": "gpipe"}),  # DDP stages run every backward before a forward
    ("hybrid", 4, 2, {"data": "fsdp"}),  # 2 FSDP shards x 2 stages, accumulating
    ("pipeline", 2, 2, {"schedule": "zbv"}),  # 4 stages in a V: rank 0 holds the first and the last
]


def _calls(world: int) -> list[tuple]:
    """Every launched case of this file at ``world`` processes."""
    calls = [
        (f"{s} {w} {a} {o}", train_params, (s, a, STEPS, GLOBAL_BATCH // (1 if s == "pipeline" else 2), w, o), {})
        for s, w, a, o in EQUAL
        if w == world
    ]
    calls.append(("traffic", pipeline_traffic, ("pipeline" if world == 2 else "hybrid",), {}))
    if world == 2:
        calls += [(f"peak {schedule}", peak_saved_activations, (schedule, 8), {}) for schedule in ("gpipe", "1f1b")]
        calls.append(("misuse", pipeline_bad_inputs, (), {}))
    return calls


@pytest.fixture(scope="module")
def world2() -> list[dict]:
    return spawn(each_call, 2, (_calls(2),), timeout_s=240)


@pytest.fixture(scope="module")
def world4() -> list[dict]:
    return spawn(each_call, 4, (_calls(4),), timeout_s=240)


@pytest.mark.launched
@pytest.mark.parametrize("strategy, world, accumulate, options", EQUAL)
def test_pipeline_equals_serial(request, strategy, world, accumulate, options):
    ranks = request.getfixturevalue(f"world{world}")
    serial = train_params("single", accumulate, STEPS, GLOBAL_BATCH, 1)
    for results in ranks:  # every rank gathers the whole model: all stages, original parameter names
        params = results[f"{strategy} {world} {accumulate} {options}"]
        assert params.keys() == serial.keys()
        assert max_abs_diff(params, serial) <= 1e-5


@pytest.mark.launched
def test_1f1b_holds_fewer_live_activations_than_gpipe(world2):
    gpipe, one_f_one_b = (world2[0][f"peak {schedule}"] for schedule in ("gpipe", "1f1b"))
    # the first stage keeps all 8 micro-batches alive under GPipe, at most 2 (the stage count) under 1F1B
    assert one_f_one_b < 0.5 * gpipe, (one_f_one_b, gpipe)


@pytest.mark.launched
@pytest.mark.parametrize("world", [2, 4])
def test_a_pipeline_sends_each_rank_what_it_needs_only(request, world):
    """``full_state_dict`` reaches rank 0 alone: the others (and hybrid's other pipeline) receive nothing; every
    rank's copy brings each rank the other stages once; an evaluation sends the last stage's bf16 output as it is,
    half fp32's bytes, and every rank gets it back in fp32 alike; with ``eval_outputs="last"`` nothing is sent."""
    ranks = [results["traffic"] for results in request.getfixturevalue(f"world{world}")]
    out = next(got["out every"] for got in ranks if got["last"])
    for rank, got in enumerate(ranks):
        others, where = got["whole"] - got["own"], f"rank {rank}: {got}"
        assert 0 < others < got["whole"], where
        assert got["rank0_only"] == (0 if rank else got["rank0_only"]) and got["keys"] == (0 if rank else 6), where
        for received in [got["every"]] + ([got["rank0_only"]] if rank == 0 else []):
            assert others <= received <= 1.05 * others + 4096, where  # the other stages' bytes, pickled
        assert got["eval every"] <= (0 if got["last"] else out.numel() * 2 + 128), where  # bf16 values, a header
        assert got["out every"].dtype == torch.float32 and got["out every"].equal(out), where
        assert got["eval last"] == 0, where
        assert got["out last"].equal(out) if got["last"] else got["out last"] is None, where


@pytest.mark.launched
def test_pipeline_misuse_gives_one_line_errors(world2):
    errors = world2[0]["misuse"]
    assert len(errors) == 3, errors
    assert "does not fit" in errors[0]
    assert "nn.Sequential" in errors[1]
    assert "does not split into 3 equal micro-batches" in errors[2]
    assert all("\n" not in e for e in errors)


def test_a_stage_without_parameters_is_refused():
    from torch import nn

    from paratrain import ConfigError
    from paratrain.model.cuts import cut_points

    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))
    assert cut_points(model, 2, [2]) == [0, 2]
    with pytest.raises(ConfigError, match="stage 1 \\(layers 1..1\\) holds no trainable parameter"):
        cut_points(model, 3, [1, 2])
