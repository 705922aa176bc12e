"""The zero-bubble pipeline schedules without a process: each rank's stages placed where torch's schedules expect
them (a V for ``zbv`` and ``dualpipev``, a loop for the interleaved ones), torch's class built over them on a fake
process group, the forward-only run of a V, and what the composition table refuses beside them."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paratrain
from paratrain.composition import ZERO_BUBBLE, refusal, schedule_refusal
from paratrain.distributed.pipeline import _make_schedule
from paratrain.errors import ConfigError
from paratrain.options import PipelineConfig, check_microbatches, rank_of_stage, stages_of


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
def test_each_rank_holds_the_stages_torchs_schedules_place_on_it(pp):
    from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

    for schedule, style, per_rank in [("zbv", "v", 2), ("dualpipev", "v", 2), ("interleaved-zb", "loop", 3)]:
        torch_places = generate_rank_to_stage_mapping(pp, pp * per_rank, style=style)
        for rank in range(pp):
            mine = stages_of(schedule, rank, pp, per_rank)
            assert sorted(mine) == sorted(torch_places[rank]), (schedule, rank)
            assert all(rank_of_stage(schedule, s, pp) == rank for s in mine)
    assert stages_of("zbv", 0, 4, 2) == [0, 7]  # the first and the last stage on rank 0


@pytest.fixture
def fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield dist.group.WORLD
    dist.destroy_process_group()


@pytest.mark.parametrize("schedule", ["zbv", "dualpipev", "interleaved-zb"])
def test_torchs_schedule_runs_the_stages_where_the_cutter_put_them(fake_group, schedule):
    """Torch's class is built over rank 0's stages (its check of the whole pipeline's actions passes) and sends each
    stage's activations to the rank the cutter put the next stage on; the forward-only run of the same stages runs
    no backward (two adjacent stages of a V on one rank hand gradients between them in a backward)."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import _ComputationType

    pp, per_rank = 2, 2
    stages = [
        PipelineStage(nn.Linear(2, 2), s, pp * per_rank, torch.device("cpu"), group=fake_group)
        for s in stages_of(schedule, 0, pp, per_rank)
    ]

    def placement(rank: int) -> list[int]:
        return stages_of(schedule, rank, pp, per_rank)

    trained = _make_schedule(schedule, stages, 4, lambda out, y: out.sum(), placement)
    assert (
        type(trained).__name__
        == {
            "zbv": "ScheduleZBVZeroBubble",
            "dualpipev": "ScheduleDualPipeV",
            "interleaved-zb": "ScheduleInterleavedZeroBubble",
        }[schedule]
    )
    assert trained.stage_index_to_group_rank == {s: rank_of_stage(schedule, s, pp) for s in range(pp * per_rank)}
    evaluated = _make_schedule("gpipe", stages, 1, None, placement)
    assert evaluated.stage_index_to_group_rank == trained.stage_index_to_group_rank
    kinds = {a.computation_type for ops in evaluated.pipeline_order_with_comms.values() for a in ops}
    assert _ComputationType.FORWARD in kinds
    assert not kinds & {_ComputationType.FULL_BACKWARD, _ComputationType.SEND_B, _ComputationType.RECV_B}


def test_a_v_runs_exactly_two_stages_per_rank():
    assert PipelineConfig(schedule="zbv").stages_per_rank == 2
    assert PipelineConfig(schedule="interleaved-zb", stages_per_rank=3).stages_per_rank == 3
    with pytest.raises(ConfigError, match="exactly 2 stages per rank"):
        PipelineConfig(schedule="dualpipev", stages_per_rank=3)
    with pytest.raises(ConfigError, match="needs stages_per_rank >= 2"):
        PipelineConfig(schedule="interleaved-zb", stages_per_rank=1)


def test_what_a_split_backward_cannot_run_is_refused_in_one_line():
    """Compiled blocks (a compiled backward runs once) and experts split over replicas (their token exchange) are
    refused under every zero-bubble schedule, by the composition table; the others run them."""
    for schedule in ZERO_BUBBLE:
        assert "drop compile" in schedule_refusal(schedule, compiled=True)
        assert schedule_refusal(schedule, compiled=False) is None
        assert "cannot run the experts' token exchange" in refusal("hybrid", ep=2, schedule=schedule)
    assert schedule_refusal("interleaved-1f1b", compiled=True) is None
    assert refusal("hybrid", ep=2, schedule="1f1b") is None
    with pytest.raises(ConfigError, match="under the zbv schedule is not supported") as err:
        paratrain.Parallel("hybrid", dp=2, ep=2, schedule="zbv")
    assert "\n" not in str(err.value)


def test_micro_batches_torchs_schedules_cannot_run_are_one_line():
    """DualPipeV needs a micro-batch per stage; the interleaved schedules run m // p equal rounds."""
    with pytest.raises(ConfigError, match=r"at least as many micro-batches as stages \(8\)"):
        check_microbatches("dualpipev", 4, 4, 8)
    with pytest.raises(ConfigError, match="in 2 equal rounds over 2 ranks"):
        check_microbatches("interleaved-zb", 5, 2, 4)
    for ok in [("dualpipev", 8, 4, 8), ("interleaved-zb", 12, 4, 8), ("interleaved-zb", 3, 2, 4), ("zbv", 3, 2, 4)]:
        check_microbatches(*ok)
