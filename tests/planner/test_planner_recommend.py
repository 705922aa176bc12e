"""Planner recommendations: ddp when it fits, sharding when it does not, pipelines across slow links, honest CPU."""

import math

import pytest

from paratrain.errors import ConfigError
from paratrain.lr import scale_lr
from paratrain.planner import (
    TRANSFORMERS,
    ModelSpec,
    PlanConfig,
    Training,
    bubble_fraction,
    format_plan,
    make_cluster,
    make_plan,
    recommend,
    transformer_stats,
)
from paratrain.planner.memory import zero1_busiest
from paratrain.workloads.model_names import resolve_model


def _stats(name):
    return transformer_stats(TRANSFORMERS[name], name=name)


def test_ddp_when_it_fits_since_sharding_costs_time():
    plan = recommend(_stats("gpt2"), make_cluster("h100", gpus=8), Training(micro_batch=4, optimizer="sgd"))
    assert plan.choice.name == "ddp" and plan.choice.fits
    assert "shards nothing" in plan.reason
    by_name = {e.name: e for e in plan.estimates}
    assert by_name["zero1"].samples_per_s < by_name["ddp"].samples_per_s  # the extra parameter all-gather
    assert by_name["single"].speedup == 1.0 and by_name["single"].batch.micro_batches == 8  # the same global batch
    assert 0.9 < by_name["ddp"].efficiency < 1  # every rank steps its optimizer as often as one GPU does


def test_every_row_trains_the_global_batch_so_no_efficiency_exceeds_one_from_accumulating():
    """nanoGPT's run: 480 samples a step in micro-batches of 12 on 8 GPUs. One GPU accumulates 40 micro-batches
    and steps once, as each ddp rank does after its 5: before, one GPU stepped after every micro-batch and ddp
    read 104%. (In fp32 nothing else differs: under bf16-mixed FSDP's 16-bit activations stream less.)"""
    plan = recommend(
        _stats("gpt2"), make_cluster("a100-80gb", gpus=8), Training(precision="fp32", micro_batch=12, global_batch=480)
    )
    single = plan.estimates[0]
    assert (single.name, single.batch.micro_batch, single.batch.micro_batches) == ("single", 12, 40)
    assert all(e.efficiency <= 1 for e in plan.estimates[1:]), [(e.name, e.efficiency) for e in plan.estimates]
    assert {e.name: e.efficiency for e in plan.estimates}["zero1"] > 0.95


def test_a_zero_stage_when_the_replicated_adam_step_costs_more_than_sharding():
    plan = recommend(_stats("gpt2"), make_cluster("h100", gpus=8), Training(micro_batch=4, optimizer="adamw"))
    by_name = {e.name: e for e in plan.estimates}
    assert by_name["ddp"].time.optimizer_s == pytest.approx(8 * by_name["zero2"].time.optimizer_s)
    stats = _stats("gpt2")  # zero1: the busiest rank's whole tensors (the embedding), more than an eighth
    busiest = zero1_busiest(stats.tensors, 8) / stats.params
    assert by_name["zero1"].time.optimizer_s == pytest.approx(busiest * by_name["ddp"].time.optimizer_s)
    assert 1 / 8 < busiest < 1 / 2
    assert plan.choice.name in ("zero1", "zero2") and by_name["ddp"].fits
    assert "every ddp rank repeats the whole optimizer step" in plan.reason


def test_a_sharded_strategy_when_ddp_does_not_fit():
    plan = recommend(_stats("gpt2-xl"), make_cluster("l4", gpus=8), Training(micro_batch=1))
    by_name = {e.name: e for e in plan.estimates}
    assert not by_name["ddp"].fits
    assert plan.choice.name in ("zero1", "zero2", "zero3") and plan.choice.fits
    assert plan.reason.startswith("ddp needs") and "GiB per GPU" in plan.reason


def test_pipeline_or_hybrid_across_a_slow_inter_node_link():
    training = Training(micro_batch=8, global_batch=512, optimizer="sgd")
    fast = recommend(_stats("gpt2-large"), make_cluster("h100", gpus=8, nodes=4, inter_node="ib-ndr"), training)
    slow = recommend(_stats("gpt2-large"), make_cluster("h100", gpus=8, nodes=4, inter_node="eth-10g"), training)
    assert fast.choice.name == "ddp"
    assert slow.choice.name in ("hybrid", "pipeline", "hsdp")
    assert "faster than ddp" in slow.reason and "eth-10g" in slow.reason


def test_smaller_micro_batch_and_accumulation_when_memory_is_tight():
    plan = recommend(_stats("gpt2-medium"), make_cluster("l4", gpus=4), Training(micro_batch=32))
    assert plan.choice.fits and plan.choice.batch.micro_batch < 32
    assert plan.choice.batch.micro_batch * plan.choice.batch.micro_batches * 4 >= 128  # same global batch
    assert any("does not fit micro-batches of 32" in s for s in plan.suggestions)


def test_pipeline_suggests_more_micro_batches_when_the_bubble_is_large():
    plan = recommend(
        _stats("gpt2-xl"),
        make_cluster("h100", gpus=4, nodes=2, inter_node="eth-10g"),
        Training(micro_batch=8, global_batch=32),
    )
    p, m = plan.choice.layout.pp, plan.choice.batch.micro_batches
    assert plan.choice.name in ("hybrid", "pipeline") and p > 1  # gradients over 10 Gb/s ethernet are too slow
    assert bubble_fraction(p, m) > 0.2
    assert plan.suggestions[0].startswith(
        f"pipeline bubble {bubble_fraction(p, m):.0%} with {m} micro-batches: "
        f"--micro-batches {4 * p} brings it to {bubble_fraction(p, 4 * p):.0%}"
    )


def test_a_cpu_host_says_more_processes_are_slower_than_threads():
    plan = make_plan(
        resolve_model("mlp"), PlanConfig(gpu="cpu", gpus=2, training=Training(precision="auto", micro_batch=64))
    )
    assert plan.training.precision == "fp32"
    assert plan.choice.name == "single"
    ddp = next(e for e in plan.estimates if e.name == "ddp")
    assert ddp.speedup < 1
    assert any("slower than threads" in n for n in plan.notes)


def test_no_strategy_fits_names_the_need_and_what_to_try():
    with pytest.raises(ConfigError) as err:
        recommend(resolve_model(ModelSpec(params="70B")), make_cluster("rtx-4090", gpus=2), Training(micro_batch=1))
    message = str(err.value)
    assert message.startswith("no strategy fits: need ") and "GiB per GPU" in message and "have 24.0; try " in message
    assert "\n" not in message


def test_lr_scaling_rules():
    assert scale_lr(1e-3, 8) == pytest.approx(8e-3)
    assert scale_lr(1e-3, 8, rule="sqrt") == pytest.approx(1e-3 * math.sqrt(8))
    assert scale_lr(0.1, 1) == 0.1
    with pytest.raises(ConfigError, match="unknown LR scaling rule 'cubic'"):
        scale_lr(0.1, 4, rule="cubic")
    plan = recommend(_stats("gpt2"), make_cluster("h100", gpus=8), Training(micro_batch=4, global_batch=128))
    assert plan.lr_factor is None  # no advice without the batch the LR was tuned at
    plan = recommend(
        _stats("gpt2"),
        make_cluster("h100", gpus=8),
        Training(micro_batch=4, global_batch=128, base_batch=512, base_lr=6e-4),
    )
    assert plan.lr_factor == 0.25
    assert "is 0.25x the 512 the LR was tuned at: scale it 0.0006 → 0.00015 (linear rule" in format_plan(plan)


def test_says_so_when_every_multi_gpu_plan_is_slower_than_one_gpu():
    plan = recommend(_stats("gpt2"), make_cluster("h100", gpus=4, nodes=2, inter_node="eth-10g", mfu=0.4), Training())
    assert plan.choice.speedup < 1
    assert plan.notes and plan.notes[0].startswith(f"even {plan.choice.name} runs at") and "eth-10g" in plan.notes[0]
