"""The planner against published large runs (benchmarks/RESULTS.md §19): predictions held where they were recorded,
and each run the plan models fully within 20% of its published step time (15% of its published memory)."""

import pytest

from paratrain.planner.published import RUNS, predict

RECORDED = {  # (step s, memory GiB) as benchmarks/RESULTS.md §19 shows them
    "megatron-22b full": (1.573, 52.38),
    "megatron-22b selective+sp": (1.094, 52.38),
    "megatron-175b full": (20.5, 57.81),
    "megatron-175b selective+sp": (14.53, 66.3),
    "megatron-530b full": (56.49, 52.84),
    "megatron-530b selective+sp": (41.1, 68.4),
    "megatron-1t full": (104.2, 63.73),
    "megatron-1t selective+sp": (76.52, 87.68),
    "torchtitan llama3.1-8b fsdp 8": (2.307, 69.7),
    "torchtitan llama3.1-8b fsdp 128": (2.279, 57.43),
    "torchtitan llama3.1-70b fsdp 32 x tp 8": (24.76, 60.13),
    "torchtitan llama3.1-405b fsdp 8 x tp 8 x pp 8, 1f1b": (37.2, 57.09),
    "torchtitan llama3.1-405b fsdp 8 x tp 8 x pp 8, interleaved": (33.92, 59.64),
    "torchtitan llama3-8b fsdp 64 a100": (2.701, 31.78),
    "torchtitan llama3-70b fsdp 64 a100": (25.04, 45.9),
    "torchtitan llama2-13b fsdp 64 a100": (3.622, 73.39),
    "torchtitan llama2-13b fsdp 64 a100, op AC": (4.244, 30.89),
    "torchtitan llama2-70b fsdp 64 a100, op AC": (10.91, 56.94),
    "torchtitan llama2-70b fsdp 64 a100, full AC": (23.96, 35.67),
    "llm-foundry mpt-7b fsdp 8": (1.008, 74.05),
    "llm-foundry mpt-13b fsdp 64": (0.6558, 35.7),
    "llm-foundry mpt-30b fsdp 32": (36.17, 60.71),
    "llm-foundry mpt-70b fsdp 64": (59, 54.83),
    "bloom-176b zero1 8 x pp 12 x tp 4": (95.66, 52.69),
}
PREDICTIONS = {run.name: predict(run) for run in RUNS}


def test_the_table_holds_six_sources_of_runs_with_their_configuration():
    assert set(RECORDED) == set(PREDICTIONS)
    assert len({run.model for run in RUNS}) >= 6 and len({run.source for run in RUNS}) >= 4
    for run in RUNS:
        assert run.layout.world_size == run.world_size and run.step_s > 0 and run.source


@pytest.mark.parametrize("name", list(RECORDED))
def test_a_prediction_stays_where_the_table_recorded_it(name):
    p = PREDICTIONS[name]
    assert (p.step_s, p.memory_gib) == pytest.approx(RECORDED[name], rel=0.01)


@pytest.mark.parametrize("name", [run.name for run in RUNS if not run.caveat])
def test_a_run_the_plan_models_fully_is_within_the_bounds(name):
    p = PREDICTIONS[name]
    assert abs(p.step_ratio - 1) <= 0.20
    assert p.memory_ratio is None or abs(p.memory_ratio - 1) <= 0.15


def test_selective_recompute_with_sequence_parallelism_is_predicted_faster_as_published():
    """Korthikanti et al. table 4: 1.29-1.32x faster than full recomputation; the plan 1.36-1.44x (it also counts
    the whole-sequence elementwise work plain tensor parallelism repeats on every rank)."""
    for size in ("22b", "175b", "530b", "1t"):
        full, present = (PREDICTIONS[f"megatron-{size} {how}"] for how in ("full", "selective+sp"))
        published = full.run.step_s / present.run.step_s
        assert full.step_s / present.step_s == pytest.approx(published, abs=0.15)


NOT_FITTING = {"megatron-1t selective+sp"}
"""Published layouts the plan says do not fit: the 1T model's first stage keeps every block's gathered column-parallel
inputs whole, as torch's tensor parallelism saves them (Megatron's re-gathers them in backward)."""


def test_the_recommendation_on_a_published_run_fits_and_is_as_fast_as_the_published_layout():
    """Within ``TIE``, where the plan prefers the simpler layout; faster where the published one does not fit."""
    from paratrain.planner import (
        format_plan,
        make_cluster,
        recommend,
        transformer_stats,
    )
    from paratrain.planner.recommend import TIE

    for run in RUNS:
        cluster = make_cluster(
            run.gpu,
            gpus=run.gpus_per_node,
            nodes=run.nodes,
            inter_node=run.inter_node,
            gpu_mem_gb=run.gpu_mem_gb,
            mem_bw_gbs=run.mem_bw_gbs,
        )
        plan = recommend(transformer_stats(run.model, name=run.name), cluster, run.training)
        published = PREDICTIONS[run.name].estimate
        assert plan.choice.fits and f"recommended: {plan.choice.name} (" in format_plan(plan), run.name
        assert plan.reason and ("fits" in plan.reason or "faster" in plan.reason), run.name
        assert published.fits == (run.name not in NOT_FITTING), run.name
        if published.fits:
            assert plan.choice.samples_per_s >= (1 - TIE) * published.samples_per_s, run.name


def test_bloom_fits_its_published_layout_with_zero1_across_its_replicas_and_not_without():
    """BLOOM-176B trained on 384 A100s as tp 4 x pp 12 x dp 8 with ZeRO-1 across dp (Megatron-DeepSpeed): asked for
    that layout, the plan compares DDP and ZeRO-1 across the replicas; only ZeRO-1 fits (Adam's states and the fp32
    master copy, 12 bytes a parameter, divided by 8), and the row that does not fit says by how much."""
    from paratrain.planner import (
        PlanConfig,
        Training,
        format_plan,
        make_plan,
        transformer_stats,
    )

    run = next(r for r in RUNS if r.name.startswith("bloom-176b"))
    assert round(transformer_stats(run.model, name="bloom").params / 1e9) == 176
    plan = make_plan(
        transformer_stats(run.model, name=run.name),
        PlanConfig(
            gpu="a100-80gb",
            gpus=8,
            nodes=48,
            inter_node="ib-ndr",
            layout="dp=8,pp=12,tp=4",
            training=Training(
                micro_batch=2,
                global_batch=2048,
                precision="bf16-mixed",
                optimizer="adam",
                recompute="full",
                sequence_parallel=False,
            ),
        ),
    )
    ddp, zero1 = plan.estimates[1:]
    assert (ddp.name, zero1.name, plan.choice.name) == ("hybrid+tp", "hybrid+zero1+tp", "hybrid+zero1+tp")
    assert not ddp.fits and zero1.fits and zero1.batch.micro_batch == 2 and zero1.batch.micro_batches == 128
    held = zero1.memory.parameters / 2  # the busiest stage's share of a tp group: bf16, 2 bytes a parameter
    assert ddp.memory.total - zero1.memory.total == pytest.approx(12 * held * 7 / 8)
    assert f"no +{ddp.over / 2**30:.1f}" in format_plan(plan)
    assert plan.reason.startswith("the layout asked for (dp=8 pp=12 tp=4) fits as hybrid+zero1+tp")
