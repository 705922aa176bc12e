"""Cluster-scale options of the planner against their sources: the interleaved 1F1B schedule's bubble and memory
(Narayanan et al. 2021), activations without sequence parallelism (Korthikanti et al. 2022), causal attention and
selective recomputation in the step time; pipelines planned only as the runtime cuts the model."""

import pytest
import torch
from helpers.nanogpt_shaped import tiny
from torch import nn

from paratrain.dims import ParallelDims
from paratrain.errors import ConfigError
from paratrain.planner import (
    TRANSFORMERS,
    InputSpec,
    Layout,
    Training,
    batching,
    make_cluster,
    memory_per_rank,
    recommend,
    step_time,
    trace_module,
    transformer_stats,
)
from paratrain.planner.auto import parameter_stats
from paratrain.planner.estimates import candidate_layouts
from paratrain.planner.memory import activation_figures
from paratrain.planner.timing import bubble_fraction, executed_flops_per_sample

STATS = transformer_stats(TRANSFORMERS["gpt2-medium"], name="gpt2-medium")


def test_the_planner_holds_the_same_in_flight_micro_batches_for_interleaved_1f1b():
    p, m, v = 4, 16, 2
    layout = Layout.of(name="pipeline", pp=p)
    per_micro = STATS.activation_bytes_per_sample / p
    training = Training(micro_batch=1, global_batch=m, schedule="interleaved-1f1b", virtual_stages=v, precision="fp32")
    batch = batching(training, dp=1, pp=p, world_size=p)
    mem = memory_per_rank(STATS, layout, batch, training, make_cluster("h100", gpus=p))
    assert mem.activations == pytest.approx((p + (p - 1) / v) * per_micro)


def test_interleaving_divides_the_bubble_by_v_and_multiplies_the_sends():
    assert bubble_fraction(8, 64) == pytest.approx(7 / 71)
    assert bubble_fraction(8, 64, 4) == pytest.approx((7 / 4) / (64 + 7 / 4))  # Narayanan et al. 2021, 2.2.2
    p, m = 4, 16
    cluster = make_cluster("h100", gpus=p, mfu=0.4)
    layout = Layout.of(name="pipeline", pp=p)
    plain = Training(micro_batch=1, global_batch=m)
    looped = Training(micro_batch=1, global_batch=m, schedule="interleaved-1f1b", virtual_stages=2)
    a, b = (step_time(STATS, layout, batching(t, dp=1, pp=p, world_size=p), t, cluster) for t in (plain, looped))
    assert b.bubble_s == pytest.approx(a.bubble_s / 2) and b.compute_s == pytest.approx(a.compute_s)
    assert b.comm_s > a.comm_s


def test_bad_schedule_options_are_one_line():
    with pytest.raises(ConfigError, match="needs --schedule interleaved-1f1b"):
        Training(virtual_stages=2)
    with pytest.raises(ConfigError, match="must be >= 2"):
        Training(schedule="interleaved-1f1b", virtual_stages=1)
    with pytest.raises(ConfigError, match="unknown recompute"):
        Training(recompute="half")
    assert Training(recompute="full").checkpointing and Training(checkpointing=True).recompute_mode == "full"
    assert Training(schedule="interleaved-1f1b").stages_per_rank == 2  # the runtime's default stages_per_rank


def test_causal_attention_runs_half_its_matrices_and_selective_recompute_repeats_their_forward():
    attn = STATS.attention_flops_per_sample
    cfg = TRANSFORMERS["gpt2-medium"]
    assert attn == 12 * cfg.layers * cfg.hidden * cfg.seq_len**2  # PaLM's count, forward and backward
    plain = executed_flops_per_sample(STATS, Training())
    assert plain == STATS.flops_per_sample - attn / 2
    assert executed_flops_per_sample(STATS, Training(recompute="selective")) == pytest.approx(plain + attn / 6)
    assert executed_flops_per_sample(STATS, Training(recompute="full")) == pytest.approx(plain * 4 / 3)


def test_without_sequence_parallelism_every_tp_rank_keeps_the_residuals_whole():
    cfg = TRANSFORMERS["gpt2-medium"]
    sh = cfg.seq_len * cfg.hidden
    tp = Layout.of(name="tp", tp=4)
    on, off = (activation_figures(STATS, Training(sequence_parallel=sp), tp) for sp in (True, False))
    r, c = 4, 2  # autocast: fp32 residual stream, 16-bit matrix products
    whole = 2 * (r + c) * sh - 2 * c * sh  # each block's input and post-attention residual, besides what SP keeps
    assert off[0] - on[0] == pytest.approx(cfg.layers * whole * (1 - 1 / 4))
    assert off[2] == pytest.approx(4 * on[2])  # the stage boundary is whole, not sequence-sharded


def test_plan_takes_the_schedule_recompute_and_sequence_parallel_flags(capsys):
    from paratrain.cli.main import main

    argv = [
        "plan",
        "--model",
        "gpt3-175b",
        "--gpu",
        "a100",
        "--gpus",
        "8",
        "--nodes",
        "8",
        "--inter-node",
        "ib-hdr-x8",
        "--layout",
        "pp=8,tp=8",
        "--batch",
        "1",
        "--global-batch",
        "64",
        "--recompute",
        "selective",
        "--schedule",
        "interleaved-1f1b",
        "--virtual-stages",
        "4",
        "--no-sequence-parallel",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "selective recomputation" in out and "interleaved-1f1b (4 stages per rank)" in out
    assert "without sequence parallelism" in out and "bubble 3%" in out  # 7/4 over 64 + 7/4
    assert main([*argv[:-5], "--virtual-stages", "2"]) == 2
    assert "needs --schedule interleaved-1f1b" in capsys.readouterr().err
    assert main([*argv, "--checkpointing"]) == 2
    assert "give one of --checkpointing or --recompute selective" in capsys.readouterr().err


def test_per_op_selective_ac_keeps_half_the_matmul_outputs_and_recomputes_half_their_forward():
    """torchtitan's "op" policy: each block's input, every other matrix product's output and the attention kernel's
    output and log-sum-exp are kept (16-bit under FSDP's param_dtype); outside the blocks nothing changes."""
    from paratrain.planner.transformer import transformer_activations

    cfg = TRANSFORMERS["llama3-8b"]
    stats = transformer_stats(cfg, name="llama3-8b")
    s, h, f = cfg.seq_len, cfg.hidden, cfg.ffn_width
    per_block, outside = transformer_activations(cfg, residual=2, act=2)
    kept = 2 * s * h + 2 * s * (cfg.qkv_width + h + 2 * f + h) / 2 + 2 * s * h + 4 * cfg.heads * s
    layout = Layout.of(name="zero3", dp=8, zero=3, shard=8)
    assert activation_figures(stats, Training(recompute="op"), layout)[0] == pytest.approx(cfg.layers * kept + outside)
    assert kept < per_block / 2
    executed = executed_flops_per_sample(stats, Training(recompute="op"))
    plain = executed_flops_per_sample(stats, Training())
    assert executed - plain == pytest.approx((stats.flops_per_sample - stats.attention_flops_per_sample) / 6)


def test_interleaving_needs_p_times_v_blocks_to_cut():
    from paratrain.planner import recommend
    from paratrain.planner.layout import exact_layout

    cluster = make_cluster("h100", gpus=8)
    deep = Training(micro_batch=1, global_batch=64, schedule="interleaved-1f1b", virtual_stages=4)
    with pytest.raises(ConfigError, match="cuts the model into 32 stages but paratrain's pipelines cut it into 24"):
        recommend(STATS, cluster, deep, exact=exact_layout(pp=8))  # gpt2-medium: 24 blocks
    plan = recommend(STATS, cluster, deep)
    assert all(e.layout.pp * 4 <= 24 for e in plan.estimates)


def test_fsdp_under_a_pipeline_keeps_its_stage_gathered_and_syncs_once():
    """torch's PipelineStage defers FSDP's reshard and gradient sync to the last micro-batch: the stage's bf16
    parameters stay gathered, its gradients accumulate unsharded in fp32, and more micro-batches add only sends."""
    from paratrain.planner.collectives import p2p_s
    from paratrain.planner.layout import block_stage_params

    p = 4
    layout = Layout.of(name="hybrid", dp=2, zero=3, shard=2, pp=p)
    cluster = make_cluster("h100", gpus=8)
    boundary = STATS.mixed["param_dtype"][2]  # one sample's block output, 16-bit
    times = []
    for m in (8, 16):
        training = Training(micro_batch=1, global_batch=2 * m)
        batch = batching(training, dp=2, pp=p, world_size=8)
        mem = memory_per_rank(STATS, layout, batch, training, cluster)
        # the stage the runtime cuts, its ends' layers
        fullest = block_stage_params(STATS.units, p, STATS.pipeline_copy)
        assert mem.buffers == pytest.approx(fullest * (2 + 4) + 2 * boundary)
        times.append(step_time(STATS, layout, batch, training, cluster).comm_s)
    assert times[1] - times[0] == pytest.approx(8 * 2 * p2p_s(boundary, cluster.intra))


def test_a_step_time_calibration_reproduces_itself_for_a_causal_transformer():
    """The calibration inverts what the time model prices (the executed FLOPs: half the attention matrices), so a
    single-GPU plan calibrated from a step predicts that step."""
    from paratrain.planner import PlanConfig, make_plan

    plan = make_plan(STATS, PlanConfig(gpu="h100", step_time=0.25, training=Training(micro_batch=4)))
    single = next(e for e in plan.estimates if e.name == "single")
    assert single.time.step_s == pytest.approx(0.25)
    assert plan.cluster.device.activation_passes == 0  # the measured step holds the elementwise work


class _RootScale(nn.Module):
    """nanoGPT's tiny GPT with a parameter of its own on the root, which every pipeline stage would run through."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = tiny()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        logits, loss = self.gpt(idx, targets)
        return logits * self.scale, loss


def test_pipelines_are_planned_as_the_runtime_cuts_the_model():
    """The planner offers a pipeline only where ``prepare`` cuts the model (``model.stages.most_stages``): nanoGPT's
    two-block GPT (whose forward reads its input's shape) into two stages, not four, though it has seven units; a
    model the cutter refuses into none, with the runtime's line as the note and as ``--pp``'s error."""
    cluster = make_cluster("h100", gpus=4)
    two = trace_module(tiny, InputSpec.parse("long:64"), name="tiny")
    assert (two.pipeline_stages, len(two.units)) == (2, 7)
    assert {lay.pp for lay in candidate_layouts(two, cluster)} == {1, 2}
    with pytest.raises(ConfigError, match="paratrain's pipelines cut it into 2 at most; use --pp 2 or fewer"):
        candidate_layouts(two, cluster, exact=ParallelDims(pp=4))
    refused = trace_module(_RootScale, InputSpec.parse("long:64"), name="scaled")
    assert refused.pipeline_stages == 0 and "the parameter scale sits on a module" in refused.pipeline_refusal
    assert {lay.pp for lay in candidate_layouts(refused, cluster)} == {1}
    with pytest.raises(ConfigError, match="^pipeline cannot split _RootScale: the parameter scale"):
        candidate_layouts(refused, cluster, exact=ParallelDims(dp_replicate=2, pp=2))
    plan = recommend(refused, cluster, Training(micro_batch=1, global_batch=4))
    assert f"no pipeline or hybrid rows: {refused.pipeline_refusal}" in plan.notes
    assert (parameter_stats(_RootScale()).pipeline_stages, parameter_stats(tiny()).pipeline_stages) == (0, 2)


def test_the_zero_bubble_schedules_fill_their_bubble_with_weight_gradients():
    """A forward, an input gradient and a weight gradient costing alike (Qi et al. 2023): ZB-H1 looped idles a third
    of interleaved 1F1B's fill, ZB-V none, DualPipeV a third of 1F1B's (DeepSeek-AI 2024, table 2); each holds its
    twin's micro-batches in flight (DualPipeV half a stage's more), and plans a step that much shorter."""
    p, m = 4, 16
    assert bubble_fraction(p, m, 2, "interleaved-zb") == pytest.approx((3 / 2 / 3) / (m + 3 / 2 / 3))
    assert bubble_fraction(p, m, 2, "zbv") == 0.0
    assert bubble_fraction(p, m, 2, "dualpipev") == pytest.approx(1 / (m + 1))  # (p - 1) / 3 = 1
    cluster = make_cluster("h100", gpus=p, mfu=0.4)
    layout = Layout.of(name="pipeline", pp=p)
    per_micro = STATS.activation_bytes_per_sample / p
    times, held = {}, {}
    for schedule in ("1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"):
        t = Training(micro_batch=1, global_batch=m, schedule=schedule, precision="fp32")
        assert t.stages_per_rank == (1 if schedule == "1f1b" else 2)
        batch = batching(t, dp=1, pp=p, world_size=p)
        times[schedule] = step_time(STATS, layout, batch, t, cluster)
        held[schedule] = memory_per_rank(STATS, layout, batch, t, cluster).activations / per_micro
    assert times["interleaved-zb"].bubble_s == pytest.approx(times["interleaved-1f1b"].bubble_s / 3)
    assert times["dualpipev"].bubble_s == pytest.approx(times["1f1b"].bubble_s / 3)
    assert times["zbv"].bubble_s == 0.0
    looped = p + (p - 1) / 2
    assert held == pytest.approx(
        {"1f1b": p, "interleaved-1f1b": looped, "interleaved-zb": looped, "zbv": p, "dualpipev": p + 0.5}
    )
    with pytest.raises(ConfigError, match="runs exactly 2 stages per rank"):
        Training(schedule="zbv", virtual_stages=4)


def test_no_layout_is_planned_that_a_zero_bubble_schedule_refuses():
    """The runtime refuses ep beside a zero-bubble schedule (the composition table): the planner offers no such
    hybrid layout under it, and the same layouts otherwise."""
    from paratrain.planner import GPTConfig
    from paratrain.planner.moe import MoE

    moe = GPTConfig(layers=8, hidden=256, heads=4, seq_len=64, vocab=1000, moe=MoE(experts=4, top_k=2, ffn=512))
    stats, cluster = transformer_stats(moe, name="moe"), make_cluster("h100", gpus=8)
    looped = candidate_layouts(stats, cluster, virtual_stages=2)
    zero_bubble = candidate_layouts(stats, cluster, virtual_stages=2, schedule="zbv")
    dropped = [lay for lay in looped if lay not in zero_bubble]
    assert dropped and all(lay.name == "hybrid" and lay.ep > 1 for lay in dropped)
    assert [lay for lay in looped if lay not in dropped] == zero_bubble
