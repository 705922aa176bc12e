"""Context parallelism in the planner (``planner.context_parallel``): what a cp rank holds, computes and sends, in
closed form; cp in the candidate layouts, ``--cp`` and ``--layout ...,cp=C``; ``auto`` weighing it.

The runtime's ``Parallel(strategy, cp=C)`` these figures are for (Ulysses): C ranks read the same samples and each
holds 1/C of every sequence; all-to-alls turn the queries, keys and values from a sequence split into a head split
before attention and the output back after it; gradients are reduced over dp x cp and ZeRO shards over dp x cp."""

from dataclasses import replace

import pytest
import torch
from helpers.activations import saved_bytes
from torch import nn

from paratrain.dims import ParallelDims
from paratrain.errors import ConfigError
from paratrain.planner import (
    TRANSFORMERS,
    Layout,
    PlanConfig,
    Training,
    make_cluster,
    make_plan,
    transformer_stats,
)
from paratrain.planner.auto import choose
from paratrain.planner.collectives import all_gather_s, all_to_all_s, reduce_scatter_s
from paratrain.planner.context_parallel import (
    IDS_BYTES_PER_TOKEN,
    all_gather_bytes,
    all_to_all_bytes,
    buffer_bytes,
    cp_comm_s,
    cp_pairs,
    method,
    rank_activations,
)
from paratrain.planner.estimates import estimate
from paratrain.planner.layout import exact_layout, layout_strategy
from paratrain.planner.memory import activation_figures, model_states
from paratrain.planner.timing import step_time
from paratrain.planner.training import batching
from paratrain.planner.transformer import GPTConfig
from paratrain.workloads.gpt import GPT

LLAMA_32K = transformer_stats(replace(TRANSFORMERS["llama3-8b"], seq_len=32768), name="llama3-8b")
MIXED = Training(precision="bf16-mixed", optimizer="adamw", micro_batch=1)
H100x8 = make_cluster("h100", gpus=8)


def _zero3(dp: int, cp: int = 1, tp: int = 1) -> Layout:
    return Layout.of(name="zero3", dp=dp, zero=3, shard=dp, cp=cp, tp=tp)


def test_activations_fall_as_one_over_cp_but_for_the_token_ids():
    ids = IDS_BYTES_PER_TOKEN * 32768
    for tp in (1, 2):
        one = activation_figures(LLAMA_32K, MIXED, _zero3(8 // tp, tp=tp))
        for cp in (2, 4):
            split = activation_figures(LLAMA_32K, MIXED, _zero3(8 // (tp * cp), cp, tp))
            assert split[0] == pytest.approx((one[0] - ids) / cp + ids)
            assert split[0] == pytest.approx(one[0] / cp, rel=1e-3)  # the ids are 0.5 MiB of 196 GiB
            assert split[2] == pytest.approx(one[2] / cp)  # a block's output: sequence-split


def test_a_32k_token_llama_8b_on_8_h100s_fits_with_cp_and_not_without():
    """By hand, bf16 under FSDP, AdamW, one sample of 32768 tokens a rank: zero3 over 8 keeps 16 bytes x 8.03B / 8 =
    15 GiB of model states (2 + 2 + 12 a parameter); the activations are 196.5 GiB a sample (32 blocks and the
    loss's fp32 log-probabilities, 4 x 128256 x 32768 = 15.7 GiB), and backward starts with two logits-sized fp32
    gradients (31.3 GiB): 245 GiB, 3x an H100's 79.6. With cp=8 a rank keeps 1/8 of both: 24.6 + 3.9 GiB, plus the
    states and one layer's all-to-all buffers: 47 GiB, which fits."""
    without, with_cp = estimate(LLAMA_32K, _zero3(8), MIXED, H100x8), estimate(LLAMA_32K, _zero3(1, 8), MIXED, H100x8)
    assert without.memory.total / 2**30 == pytest.approx(244.6, abs=0.5) and not without.fits
    assert with_cp.memory.total / 2**30 == pytest.approx(47.2, abs=0.5) and with_cp.fits
    assert with_cp.memory.activations == pytest.approx(without.memory.activations / 8, rel=1e-3)
    plan = make_plan(LLAMA_32K, PlanConfig(gpus=8, training=Training(micro_batch=1)))
    by_name = {e.name: e for e in plan.estimates}
    assert not any(by_name[n].fits for n in ("ddp", "zero1", "zero2", "zero3", "hybrid", "pipeline"))
    assert by_name["zero3+cp"].fits and plan.choice.layout.cp > 1
    assert "faster than zero3 with activation checkpointing" in plan.reason
    assert any(n.startswith("context parallelism: at 32768 tokens a sample, without it tp fits") for n in plan.notes)


def test_parameters_shard_over_dp_x_cp_and_gradients_reduce_over_it():
    assert model_states(LLAMA_32K, _zero3(2, 4), MIXED) == model_states(LLAMA_32K, _zero3(8), MIXED)
    ddp = Layout.of(name="ddp", dp=2, cp=4)
    assert (ddp.grad_ranks, ddp.shard_ranks, ddp.world_size) == (8, 1, 8)
    short = transformer_stats(TRANSFORMERS["llama3-8b"], name="llama3-8b")
    t = step_time(short, ddp, batching(MIXED, dp=2, pp=1, world_size=8), MIXED, H100x8)
    alone = step_time(short, Layout.of(name="ddp", dp=8), batching(MIXED, dp=8, pp=1, world_size=8), MIXED, H100x8)
    assert t.comm_s - t.cp_comm_s == pytest.approx(alone.comm_s)  # the same all-reduce over 8 ranks


def test_past_the_key_value_heads_the_all_gather_s_bytes_in_closed_form():
    """8 key/value heads at cp=16: the runtime's auto runs the all-gather; per layer the whole sequence's keys and
    values, b·s·8·128 bf16 elements each, gathered in forward and reduce-scattered in backward, C·kv/(a+kv) = 3.2
    times the bytes Ulysses' all-to-alls would send (at cp=4: 0.8 times); autograd saves each layer's whole keys and
    values."""
    link, s = H100x8.intra, 32768
    assert (method(LLAMA_32K, 1, 8), method(LLAMA_32K, 1, 16), method(LLAMA_32K, 4, 4)) == (
        "ulysses",
        "allgather",
        "allgather",
    )
    kv = s * 8 * 128 * 2
    assert all_gather_bytes(LLAMA_32K, "param_dtype", 1, 1) == kv
    assert cp_comm_s(LLAMA_32K, "param_dtype", 1, 1, 16, link, False) == pytest.approx(
        32 * 2 * (all_gather_s(kv, 16, link) + reduce_scatter_s(kv, 16, link))
    )
    assert buffer_bytes(LLAMA_32K, "param_dtype", 1, 1, 16) == 2 * kv
    figures, divisible = (1e12, 1e11, 1e9), replace(LLAMA_32K, cp=replace(LLAMA_32K.cp, kv_heads=32))
    saved = rank_activations(LLAMA_32K, figures, 16, "param_dtype")[0] - rank_activations(divisible, figures, 16)[0]
    assert saved == pytest.approx(32 * 2 * kv * 15 / 16)  # every layer's whole keys and values, not 1/16 of them
    for cp, ratio in ((16, 3.2), (4, 0.8)):
        q, ulysses_kv = all_to_all_bytes(LLAMA_32K, "param_dtype", 1, 1, cp)
        assert 2 * kv / (2 * q + 2 * ulysses_kv) == pytest.approx(ratio)


def test_all_to_all_time_and_compute_per_cp_rank_in_closed_form():
    """Per layer 4 all-to-alls forward and 4 backward: queries and output b·s/cp·32·128 bf16 elements, keys and
    values b·s/cp·8·128; a cp rank computes 1/cp of each micro-batch's FLOPs (at 32k tokens the weights it streams
    are a small part)."""
    link, s = H100x8.intra, 32768
    q, kv = s / 4 * 32 * 128 * 2, s / 4 * 8 * 128 * 2
    assert cp_comm_s(LLAMA_32K, "param_dtype", 1, 1, 4, link, False) == pytest.approx(
        2 * 32 * (2 * all_to_all_s(q, 4, link) + 2 * all_to_all_s(kv, 4, link))
    )
    assert cp_comm_s(LLAMA_32K, "param_dtype", 1, 1, 4, link, True) == pytest.approx(
        1.5 * cp_comm_s(LLAMA_32K, "param_dtype", 1, 1, 4, link, False)
    )  # a recomputed forward's 4 more
    one_batch = replace(MIXED, global_batch=1)
    times = {
        cp: step_time(
            LLAMA_32K,
            _zero3(1, cp),
            batching(one_batch, dp=1, pp=1, world_size=cp),
            one_batch,
            make_cluster("h100", gpus=cp),
        )
        for cp in (1, 2, 4)
    }
    for cp in (2, 4):
        assert times[cp].compute_s / times[1].compute_s == pytest.approx(1 / cp, rel=0.05)
        assert 0 < times[cp].cp_comm_s < 0.1 * times[cp].step_s


def test_cp_degrees_divide_the_heads_with_tp_within_a_node():
    assert cp_pairs(LLAMA_32K, H100x8, (2, 4, 8)) == ((1, 2), (1, 4), (1, 8), (2, 2), (2, 4), (4, 2))
    twelve = transformer_stats(GPTConfig(layers=2, hidden=768, heads=12, seq_len=4096), name="twelve")
    assert cp_pairs(twelve, H100x8, (2, 4)) == ((1, 2), (1, 4), (2, 2))  # 12 heads: not tp 4 x cp 2
    with pytest.raises(
        ConfigError,
        match=r"--cp 3: sequence length 32768 does not divide by 2 x cp = 6 \(the all-gather's: heads 32 and "
        r"key/value heads 8 do not divide by tp x cp = 3\); use one of 1, 2, 4, 8",
    ):
        cp_pairs(LLAMA_32K, H100x8, (), 3)
    # an explicit cp past the 8 key/value heads plans the all-gather; the search keeps to Ulysses' degrees
    assert cp_pairs(LLAMA_32K, make_cluster("h100", gpus=16), (2,), 16) == ((1, 16),)
    assert cp_pairs(LLAMA_32K, H100x8, (), 1) == ()
    with pytest.raises(ConfigError, match="--cp needs a transformer's shape"):
        cp_pairs(replace(LLAMA_32K, cp=None), H100x8, (), 2)


def test_layout_parsing_with_cp():
    assert exact_layout("dp=4,cp=2") == exact_layout(dp=4, cp=2) == exact_layout("dp=4", cp=2)
    assert exact_layout("dp=4,cp=2").world_size == 8 and exact_layout("dp=4,cp=2").cp == 2
    plan = make_plan(LLAMA_32K, PlanConfig(gpus=8, layout="dp=4,cp=2", training=Training(micro_batch=1)))
    assert [e.name for e in plan.estimates[1:]] == ["ddp+cp", "zero2+cp", "zero3+cp"]  # zero1 takes no cp
    assert all(e.layout.dp == 4 and e.layout.cp == 2 for e in plan.estimates[1:])
    assert exact_layout("zero3,cp=2", world=8) == ParallelDims(dp_replicate=4, cp=2)  # dp: the GPUs left
    assert layout_strategy("zero3,cp=2") == "zero3" and layout_strategy("dp=4,cp=2") is None
    named = make_plan(LLAMA_32K, PlanConfig(gpus=8, layout="zero3,cp=2", training=Training(micro_batch=1)))
    assert [(e.name, e.layout.dp) for e in named.estimates] == [("single", 1), ("zero3+cp", 4)]
    with pytest.raises(
        ConfigError,
        match=r"dp=2 x pp=1 x cp=2 x tp=2 is not planned as zero1; name one of ddp, "
        r"zero2, zero3 or none",
    ):
        make_plan(LLAMA_32K, PlanConfig(gpus=8, layout="zero1,tp=2,cp=2"))
    with pytest.raises(ConfigError, match=r"cannot read 'pipeline'; .* optionally with one of ddp, zero1, zero2, "):
        PlanConfig(gpus=8, layout="pipeline,cp=2")
    with pytest.raises(ConfigError, match="--layout says cp=2 but --cp 4; give the degree once"):
        PlanConfig(gpus=8, layout="dp=4,cp=2", cp=4)
    with pytest.raises(ConfigError, match=r"dp=4 x pp=1 x cp=2 x tp=1 needs 8 GPUs but the cluster has 16"):
        make_plan(LLAMA_32K, PlanConfig(gpus=16, layout="dp=4,cp=2"))
    with pytest.raises(ConfigError, match="context parallelism is planned with data and tensor parallelism only"):
        make_plan(LLAMA_32K, PlanConfig(gpus=8, layout="dp=2,pp=2,cp=2"))


class _Logits(nn.Module):
    """A transformers causal LM returning its logits, as ``saved_bytes`` reads a model's output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).logits


def test_the_activation_model_against_what_autograd_saves_on_a_long_sequence():
    """transformers' Llama (grouped-query attention, SwiGLU, RoPE) at 2048 tokens in fp32: the closed form's
    activations are within 2% of autograd's saved tensors. A cp rank's figure is that / cp plus what is not split
    (the token ids and targets, 16 bytes a token); outside attention a cp rank runs the model on s/cp tokens and
    inside it s tokens of a/cp heads (the same element counts), so the model run on s/cp tokens measures it. (Not
    split either, and counted apart: autocast's 16-bit weight copies and one layer's all-to-all buffers.)"""
    transformers = pytest.importorskip("transformers")
    from paratrain.planner.auto import closed_form_shape

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=300,
        max_position_embeddings=2048,
        attn_implementation="sdpa",
    )
    model = _Logits(transformers.AutoModelForCausalLM.from_config(config))
    stats = transformer_stats(closed_form_shape(model.model), name="llama")
    fp32 = Training(precision="fp32", micro_batch=1)
    one = activation_figures(stats, fp32, Layout.of(name="ddp", dp=4))[0]
    assert one == pytest.approx(saved_bytes(model, torch.randint(0, 300, (1, 2048)), False), rel=0.02)
    split = activation_figures(stats, fp32, Layout.of(name="ddp", dp=2, cp=2))[0]
    assert split == (one - 16 * 2048) / 2 + 16 * 2048
    assert split == pytest.approx(saved_bytes(model, torch.randint(0, 300, (1, 1024)), False), rel=0.02)
    # cp=4 is past the 2 key/value heads: the all-gather, whose layers save the whole sequence's keys and values
    gathered = 2 * 2 * 2048 * 2 * 8 * 4 * 3 / 4
    split = activation_figures(stats, fp32, Layout.of(name="ddp", dp=1, cp=4))[0]
    assert split == (one - 16 * 2048) / 4 + 16 * 2048 + gathered


LONG = GPTConfig(
    layers=4, hidden=256, heads=4, seq_len=4096, vocab=1000, gated=True, bias=False, learned_positions=False, tied=False
)


def test_auto_picks_cp_only_when_the_activations_do_not_fit():
    """4096-token samples: with memory for zero3's states and activations cp stays 1; with less, where zero3's
    activations do not fit but its states do, cp ranks split each sequence; with too little for the states, cp
    cannot help and is not picked."""
    with torch.device("meta"):
        model = GPT(LONG)
    stats = transformer_stats(LONG, name="long")
    fp32 = Training(precision="fp32", optimizer="adamw", micro_batch=1)
    need = {cp: estimate(stats, _zero3(8 // cp, cp), fp32, H100x8).memory.total for cp in (1, 4)}
    roomy = choose(model, H100x8, "fp32", cp=True, batch=(1, 4096))
    assert roomy.fits and roomy.cp == 1
    tight = make_cluster("h100", gpus=8, gpu_mem_gb=(need[1] + need[4]) / 2 / 2**30)
    assert not choose(model, tight, "fp32", batch=(1, 4096)).fits  # without cp=True: nothing fits
    choice = choose(model, tight, "fp32", cp=True, batch=(1, 4096))
    assert choice.fits and choice.cp in (2, 4) and choice.describe().endswith(f"with cp={choice.cp}")
    assert "the model states fit but the loader's activations do not" in choice.reason
    tiny = make_cluster("h100", gpus=8, gpu_mem_gb=H100x8.device.overhead_gib + 0.001)
    assert choose(model, tiny, "fp32", cp=True, batch=(1, 4096)).cp == 1
    longer = choose(
        model, make_cluster("h100", gpus=8, gpu_mem_gb=need[1] / 2**30), "fp32", cp=True, batch=(1, 8192)
    )  # rotary: a loader's sequences past the model's context are planned as they are
    assert longer.cp > 1 and "cp=" in longer.reason
