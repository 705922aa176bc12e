"""Planner tensor parallelism: what a rank holds and sends, hand-computed on a tiny transformer, and when the
recommender picks it."""

from dataclasses import replace

import pytest

from paratrain.errors import ConfigError
from paratrain.planner import (
    TRANSFORMERS,
    GPTConfig,
    Layout,
    Link,
    Measured,
    ModelSpec,
    PlanConfig,
    Training,
    batching,
    format_plan,
    make_cluster,
    make_plan,
    memory_per_rank,
    plan_to_json,
    recommend,
    step_time,
    transformer_stats,
)
from paratrain.planner.layout import layouts
from paratrain.planner.memory import activation_figures, model_states
from paratrain.planner.tensor_parallel import (
    collectives_per_micro_batch,
    rank_params,
    tp_comm_s,
    tp_degrees,
)
from paratrain.workloads.model_names import resolve_model

# h=8, f=32, V=16, s=4, 2 layers, biases, learned positions, tied head: 1,920 parameters. A block holds 872: its
# split layers 824 (QKV 3·64+24, projection 64, MLP 8·32+32 and 32·8), its norms 32 and row-parallel biases 16.
# The embedding's 128-weight token table is split, its 32 positions are not; the head is the final norm (16).
TINY = transformer_stats(GPTConfig(layers=2, hidden=8, heads=2, seq_len=4, vocab=16), name="tiny")
FP32 = Training(precision="fp32", optimizer="adamw", micro_batch=1)
FREE = Link(name="test", bandwidth_gbs=1, latency_us=0)


def test_a_tensor_parallel_rank_holds_its_share_of_the_split_layers_and_all_the_rest():
    assert TINY.params == 1920
    assert rank_params(TINY, 2) == 1920 - (128 + 2 * 824) // 2 == 1032
    assert rank_params(TINY, 4) == 1920 - 3 * (128 + 2 * 824) // 4 == 588
    states = model_states(TINY, Layout.of(name="tp", tp=2), FP32)
    assert (states.parameters, states.gradients, states.optimizer_states) == (4 * 1032, 4 * 1032, 8 * 1032)
    zero3 = model_states(TINY, Layout.of(name="zero3", dp=2, zero=3, shard=2, tp=2), FP32)
    assert zero3.total == 16 * 1032 / 2


def test_activations_are_split_except_the_gathered_linear_inputs_and_token_ids():
    # fp32: a block saves 2,144 bytes a sample, of which the QKV and MLP inputs (4·s·h = 128 each) stay whole;
    # outside the blocks 608, of which the head's input (128) and the ids and targets (64) stay whole.
    whole = activation_figures(TINY, FP32, Layout.of(name="single"))
    assert whole == (2 * 2144 + 608, 2 * 4 * 32 + 2144 + 608, 4 * 32)
    split = activation_figures(TINY, FP32, Layout.of(name="tp", tp=2))
    assert split[0] == 2 * (256 + (2144 - 256) / 2) + 192 + (608 - 192) / 2 == 2800
    assert split[1] == 2 * 128 / 2 + 256 + (2144 - 256) / 2 + 192 + (608 - 192) / 2
    assert split[2] == 4 * 32 / 2  # a block's output is sequence-sharded


def test_memory_divides_logits_and_weight_copies_by_tp():
    training = Training(precision="bf16-mixed", optimizer="adamw", micro_batch=2)
    cluster = make_cluster("h100", gpus=2)

    def memory(layout):
        return memory_per_rank(TINY, layout, batching(training, dp=layout.dp, pp=1, world_size=2), training, cluster)

    one, tp = memory(Layout.of(name="single")), memory(Layout.of(name="tp", tp=2))
    assert tp.transient == one.transient / 2  # vocab-sharded logits' gradients
    acts = activation_figures(TINY, training, Layout.of(name="tp", tp=2))[0] * 2
    assert tp.activations == pytest.approx(acts + 2 * TINY.matmul_params / 2)  # autocast's 16-bit weight copies


def test_collective_volume_per_block_and_micro_batch():
    # micro-batch 3: an all-gather or reduce-scatter carries 3·4·8 elements; over 2 ranks a ring moves half
    fp32_bytes, half_bytes = 3 * 4 * 8 * 4, 3 * 4 * 8 * 2
    per_block_fp32 = 8 * fp32_bytes / 2
    ends = 4 * fp32_bytes / 2  # embedding reduce-scatter and head all-gather, forward and backward
    loss = 3 * 2 * (1 / 2) * 3 * 4 * 4  # three all-reduces of one fp32 per token
    assert tp_comm_s(TINY, "fp32", 3, 2, FREE, False) == pytest.approx((2 * per_block_fp32 + ends + loss) / 1e9)
    # autocast: the norms' outputs (all-gathered) stay fp32, the row-parallel outputs (reduce-scattered) are 16-bit
    per_block_mixed = (4 * fp32_bytes + 4 * half_bytes) / 2
    assert tp_comm_s(TINY, "autocast", 3, 2, FREE, False) == pytest.approx((2 * per_block_mixed + ends + loss) / 1e9)
    recompute = (2 * fp32_bytes + 2 * half_bytes) / 2  # checkpointing repeats each block's forward
    assert tp_comm_s(TINY, "autocast", 3, 2, FREE, True) == pytest.approx(
        (2 * (per_block_mixed + recompute) + ends + loss) / 1e9
    )
    assert collectives_per_micro_batch(TINY, False) == 2 * 8 + 4 + 3
    assert tp_comm_s(TINY, "fp32", 3, 1, FREE, False) == 0.0


def test_step_time_splits_compute_and_waits_for_every_collective():
    stats = transformer_stats(TRANSFORMERS["llama-7b"], name="llama-7b")
    training = Training(micro_batch=4, global_batch=8)
    cluster = make_cluster("h100", gpus=8)

    def time(layout):
        return step_time(stats, layout, batching(training, dp=layout.dp, pp=layout.pp, world_size=8), training, cluster)

    ddp, tp = time(Layout.of(name="ddp", dp=2, tp=4)), time(Layout.of(name="ddp", dp=2))
    assert ddp.tp_comm_s > 0 and tp.tp_comm_s == 0
    assert ddp.exposed_comm_s >= ddp.tp_comm_s  # never hidden
    expected = tp_comm_s(stats, "autocast", 4, 4, cluster.intra, False)
    assert ddp.tp_comm_s == pytest.approx(expected)  # one micro-batch per replica


def test_tp_across_nodes_uses_the_slower_link_and_is_flagged():
    stats = transformer_stats(TRANSFORMERS["llama-7b"], name="llama-7b")
    plan = make_plan(stats, PlanConfig(gpus=8, nodes=2, tp=16, training=Training(micro_batch=2)))
    assert [e.layout.tp for e in plan.estimates if e.layout.tp > 1] == [16]
    wide = next(e for e in plan.estimates if e.layout.tp == 16)
    assert wide.batch.micro_batches == 16  # one replica: the global batch of 2 x 16 in micro-batches of 2
    assert wide.time.tp_comm_s == pytest.approx(16 * tp_comm_s(stats, "autocast", 2, 16, plan.cluster.inter, False))
    note = next(n for n in plan.notes if "spans nodes" in n)
    assert note.startswith("tp=16 spans nodes") and "ib-ndr" in note and "keep tp <= 8" in note


def test_candidate_degrees_divide_a_node_and_the_heads():
    six_heads = transformer_stats(GPTConfig(layers=2, hidden=48, heads=6, seq_len=8, vocab=64), name="six")
    assert tp_degrees(six_heads, make_cluster("h100", gpus=8)) == (2,)  # 6 heads: not 4 or 8
    assert tp_degrees(TINY, make_cluster("h100", gpus=8)) == (2,)
    gpt2 = transformer_stats(TRANSFORMERS["gpt2"], name="gpt2")  # 12 heads; vocab 50257 is split unevenly
    assert tp_degrees(gpt2, make_cluster("h100", gpus=8)) == (2, 4)
    assert rank_params(gpt2, 2) == gpt2.params - sum(gpt2.tp.split) + sum(-(-s // 2) for s in gpt2.tp.split)
    llama = transformer_stats(TRANSFORMERS["llama-7b"], name="llama-7b")
    assert tp_degrees(llama, make_cluster("h100", gpus=8)) == (2, 4, 8)
    assert tp_degrees(llama, make_cluster("h100", gpus=8), tp=1) == ()
    found = layouts(make_cluster("h100", gpus=4), len(llama.units), (2, 4))
    assert {(lay.label, lay.describe()) for lay in found if lay.tp > 1} == {
        ("ddp+tp", "dp=2 tp=2"),
        ("zero2+tp", "dp=2 shard=2 tp=2"),
        ("zero3+tp", "dp=2 shard=2 tp=2"),
        ("pipeline+tp", "pp=2 tp=2"),
        ("tp", "tp=4"),
    }


def test_a_model_whose_shape_does_not_divide_gets_no_tp_and_a_note():
    five_heads = GPTConfig(layers=2, hidden=320, heads=5, seq_len=64, vocab=50257)
    plan = recommend(transformer_stats(five_heads, name="five"), make_cluster("h100", gpus=8), Training(micro_batch=4))
    assert all(e.layout.tp == 1 for e in plan.estimates)
    assert "tensor parallelism not planned: heads 5 does not divide by tp=2" in plan.notes
    with pytest.raises(
        ConfigError,
        match=r"^--tp 4: heads 6 does not divide by tp=4; use a degree that "
        r"divides them: 1, 2$",
    ):
        make_plan(resolve_model(ModelSpec(model="gpt2", heads=6, hidden=768, vocab=50304)), PlanConfig(gpus=4, tp=4))
    with pytest.raises(ConfigError, match="--tp for 'mlp' is refused by the runtime: tp_plan='auto' found nothing"):
        make_plan(resolve_model("mlp"), PlanConfig(gpus=2, tp=2))


def test_tp_is_chosen_when_it_is_the_only_layout_that_fits():
    """Without context parallelism (cp=1), which splits these 4096-token activations too (test_planner_cp.py)."""
    cfg = GPTConfig(
        layers=2, hidden=1024, heads=16, seq_len=4096, vocab=32768, bias=False, learned_positions=False, tied=False
    )
    plan = recommend(
        transformer_stats(cfg, name="long"), make_cluster("h100", gpus=4, gpu_mem_gb=2.5), Training(micro_batch=1), cp=1
    )
    assert plan.choice.layout.tp > 1 and plan.choice.fits
    assert plan.reason.startswith("no layout without tensor parallelism fits; the least, ")
    assert f"tp={plan.choice.layout.tp} splits every block's weights and activations" in plan.reason
    assert "per-layer activation collectives per step over nvlink4" in plan.reason


def test_tp_within_nodes_and_pipelines_across_a_slow_link_is_fastest():
    plan = recommend(
        transformer_stats(TRANSFORMERS["llama-7b"], name="llama-7b"),
        make_cluster("h100", gpus=8, nodes=2, inter_node="eth-10g"),
        Training(micro_batch=4),
    )
    assert (plan.choice.name, plan.choice.layout.describe()) == ("pipeline+tp", "pp=2 tp=8")
    assert (
        plan.reason.startswith("pipeline+tp (pp=2 tp=8) is ")
        and "faster than pipeline, the fastest without" in plan.reason
    )
    table = format_plan(plan)
    assert "pipeline+tp        pp=2 tp=8" in table and "recommended: pipeline+tp (pp=2 tp=8" in table
    data = plan_to_json(plan)
    assert data["recommendation"]["layout"]["tp"] == 8 and data["recommendation"]["strategy"] == "pipeline"
    assert data["recommendation"]["time"]["tp_comm_s"] > 0


def test_dtensor_machinery_is_calibrated_per_collective_from_a_fake_group_step():
    config = PlanConfig(
        gpu="cpu", gpus=2, tp=2, training=Training(precision="fp32", optimizer="adam", micro_batch=4, global_batch=4)
    )
    before = {e.name: e for e in make_plan(TINY, config).estimates}
    compute = before["tp"].time.step_s - before["tp"].time.exposed_comm_s
    calls = collectives_per_micro_batch(TINY, False)
    # 2 ms of machinery per collective
    plan = make_plan(TINY, replace(config, measured=Measured(tp_step_time=compute + calls * 0.002)))
    assert plan.cluster.device.tp_call_s == pytest.approx(0.002)
    after = {e.name: e for e in plan.estimates}
    slowdown = plan.cluster.device.serial_slowdown(2)
    assert after["tp"].time.step_s - before["tp"].time.step_s == pytest.approx(calls * 0.002 * slowdown)
    assert after["ddp"].time.step_s == before["ddp"].time.step_s  # layouts without tp pay nothing
    faster = make_plan(TINY, replace(config, measured=Measured(tp_step_time=compute / 2)))
    assert faster.cluster.device.tp_call_s == 0.0  # never below 0
