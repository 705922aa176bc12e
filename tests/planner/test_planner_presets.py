"""Planner shapes at cluster scale: the named presets against their published sizes, grouped-query attention and
transformers' config.json against the real modules, and exact layouts (``--layout dp=8,pp=12,tp=4``)."""

import json
import re

import pytest
import torch

from paratrain.cli.main import main
from paratrain.dims import ParallelDims
from paratrain.errors import ConfigError
from paratrain.planner import (
    TRANSFORMERS,
    GPTConfig,
    InputSpec,
    ModelSpec,
    PlanConfig,
    Training,
    make_plan,
    trace_module,
    transformer_stats,
)
from paratrain.planner.hf_config import read_model_config
from paratrain.planner.layout import exact_layout
from paratrain.planner.moe import MoE
from paratrain.planner.published import MOE_COUNTS, preset_counts
from paratrain.planner.tensor_parallel import rank_params
from paratrain.planner.transformer import transformer_params
from paratrain.workloads.gpt import GPT
from paratrain.workloads.model_names import resolve_model

PUBLISHED = {
    # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", table 2.1: 175.0B
    "gpt3-175b": 175.0e9,
    # the Hugging Face model pages' safetensors counts (meta-llama/Meta-Llama-3-8B, Meta-Llama-3-70B,
    # Llama-3.1-405B; Dubey et al. 2024 table 3 gives the shapes)
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.6e9,
    "llama3-405b": 405.9e9,
    # mistralai/Mistral-7B-v0.1 model page: 7.24B (Jiang et al. 2023, table 1, the shape)
    "mistral-7b": 7.24e9,
    # Qwen/Qwen2-7B model page: 7.62B (the Qwen2.5-7B card, same shape: 7.61B, 6.53B without embeddings)
    "qwen2-7b": 7.62e9,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_a_preset_has_its_published_parameter_count(name):
    assert transformer_params(TRANSFORMERS[name])["total"] == pytest.approx(PUBLISHED[name], rel=0.01)


@pytest.mark.parametrize("name", list(MOE_COUNTS))
def test_a_mixture_of_experts_preset_has_its_published_total_and_active_counts(name):
    """Counted as each source counts: OpenAI's active count leaves out the embedding table (a lookup)."""
    total, active = preset_counts(name)
    assert total == pytest.approx(MOE_COUNTS[name].total, rel=0.02)
    assert active == pytest.approx(MOE_COUNTS[name].active, rel=0.02)
    counts, stats = transformer_params(TRANSFORMERS[name]), transformer_stats(TRANSFORMERS[name], name=name)
    assert stats.moe.active == counts["active"] and stats.params == counts["total"] == total


def test_qwen3_30b_a3b_without_embeddings_is_its_published_29_9b():
    counts = transformer_params(TRANSFORMERS["qwen3-30b-a3b"])
    assert counts["total"] - 2 * 151936 * 2048 == pytest.approx(29.9e9, rel=0.005)


def test_qwen2_7b_without_embeddings_is_its_published_6_53b():
    counts = transformer_params(TRANSFORMERS["qwen2-7b"])
    assert counts["total"] - 2 * 152064 * 3584 == pytest.approx(6.53e9, rel=0.005)


def _hf(kind: str, **shape):
    transformers = pytest.importorskip("transformers")
    config_cls = {
        "llama": "LlamaConfig",
        "mistral": "MistralConfig",
        "qwen2": "Qwen2Config",
        "gpt2": "GPT2Config",
        "qwen3": "Qwen3Config",
        "mixtral": "MixtralConfig",
        "qwen2_moe": "Qwen2MoeConfig",
        "qwen3_moe": "Qwen3MoeConfig",
    }
    return getattr(transformers, config_cls[kind])(**shape)


HF_SHAPES = {
    "llama-gqa": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=176,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            vocab_size=300,
            max_position_embeddings=128,
        ),
    ),
    "llama-tied": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            vocab_size=256,
            tie_word_embeddings=True,
        ),
    ),
    "mistral": (
        "mistral",
        dict(
            hidden_size=96,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=3,
            vocab_size=320,
            max_position_embeddings=64,
        ),
    ),
    "qwen2": (
        "qwen2",
        dict(
            hidden_size=64,
            intermediate_size=192,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=400,
            max_position_embeddings=64,
        ),
    ),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=32, vocab_size=500)),
    "qwen3": (
        "qwen3",
        dict(
            hidden_size=64,
            intermediate_size=160,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=300,
            max_position_embeddings=64,
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
    ),
    "qwen2_moe": (
        "qwen2_moe",
        dict(
            hidden_size=64,
            intermediate_size=160,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=300,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=64,
        ),
    ),
    "qwen3_moe": (
        "qwen3_moe",
        dict(
            hidden_size=64,
            intermediate_size=160,
            moe_intermediate_size=32,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=300,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            decoder_sparse_step=2,
            max_position_embeddings=64,
        ),
    ),
}


@pytest.mark.parametrize("name", list(HF_SHAPES))
def test_a_transformers_config_json_plans_the_parameters_its_model_has(name, tmp_path):
    """The closed form and the config reader against the real transformers module of the same tiny shape."""
    import transformers

    kind, shape = HF_SHAPES[name]
    config = _hf(kind, **shape)
    config.save_pretrained(tmp_path)
    cfg = read_model_config(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert transformer_params(cfg)["total"] == sum(p.numel() for p in model.parameters())
    assert read_model_config(tmp_path / "config.json") == cfg
    from_config = resolve_model(ModelSpec(model_config=str(tmp_path / "config.json")))
    assert from_config.find_stats().params == transformer_params(cfg)["total"]


@pytest.mark.parametrize(
    "name, moe",
    [
        ("mixtral", MoE(experts=4, top_k=2, ffn=96)),
        ("qwen2_moe", MoE(experts=4, top_k=2, ffn=32, shared=48, shared_gate=True)),
        ("qwen3_moe", MoE(experts=8, top_k=2, ffn=32, dense_layers=(0, 2))),  # mlp_only_layers, decoder_sparse_step 2
    ],
)
def test_a_moe_config_json_gives_its_experts(name, moe, tmp_path):
    kind, shape = HF_SHAPES[name]
    _hf(kind, **shape).save_pretrained(tmp_path)
    cfg = read_model_config(tmp_path)
    assert cfg.moe == moe and cfg.qk_norm == (kind == "qwen3_moe")
    assert cfg.head_dim == (32 if kind == "qwen3_moe" else None)  # 4 heads of 32 over 64: wider than hidden / heads


def test_a_transformers_moe_from_a_factory_is_planned_in_closed_form(capsys):
    """``--model module:factory`` building a transformers MoE: its routing cannot run on the meta device, so its
    config is read instead (experts, top k, expert width, dense blocks), and the count is the module's."""
    from helpers.moe_models import QWEN3_MOE, qwen3_moe

    assert (
        main(["plan", "--model", "helpers.moe_models:qwen3_moe", "--input", "long:256", "--gpus", "8", "--json"]) == 0
    )
    plan = json.loads(capsys.readouterr().out)
    with torch.device("meta"):
        params = sum(p.numel() for p in qwen3_moe().parameters())
    assert plan["model"]["params"] == params and plan["model"]["source"].startswith("closed-form transformer")
    assert plan["model"]["moe"]["experts"] == QWEN3_MOE["num_experts"] and plan["model"]["moe"]["layers"] == 3
    assert "seq 256" in plan["model"]["source"]


def test_the_pretraining_context_is_read_from_rope_scaling(tmp_path):
    raw = {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "max_position_embeddings": 131072,
        "rope_scaling": {"rope_type": "llama3", "original_max_position_embeddings": 8192},
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert read_model_config(tmp_path).seq_len == 8192


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 2]", "not a transformers config.json (no model_type)"),
        ("{not json", "not a transformers config.json (JSONDecodeError)"),
        ('{"model_type": "bert"}', "model_type 'bert' is not planned in closed form"),
        ('{"model_type": "llama", "hidden_size": 64}', "llama config without a usable 'num_attention_heads'"),
    ],
)
def test_a_file_that_is_not_a_usable_config_is_one_line(tmp_path, text, message):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        read_model_config(path)
    assert "\n" not in str(err.value)


def test_grouped_query_attention_shrinks_the_kv_projections_and_their_activations():
    mha = GPTConfig(
        layers=2, hidden=64, heads=8, seq_len=32, vocab=100, gated=True, bias=False, learned_positions=False, tied=False
    )
    gqa = GPTConfig(**{**mha.__dict__, "kv_heads": 2})
    saved = 2 * 64 * (64 - 16)  # k and v: 64 -> 16 wide each (2 heads of 8)
    assert transformer_params(mha)["block"] - transformer_params(gqa)["block"] == saved
    a, b = transformer_stats(mha, name="mha"), transformer_stats(gqa, name="gqa")
    assert a.activation_bytes_per_sample - b.activation_bytes_per_sample == 2 * 4 * 32 * 2 * (64 - 16)  # fp32, 2 layers
    assert a.flops_per_sample - b.flops_per_sample == 6 * 2 * saved * 32  # the attention scores do not change
    traced = trace_module(lambda: GPT(gqa), InputSpec.parse("long:32"), name="gqa")
    assert traced.params == b.params and traced.flops_per_sample == pytest.approx(b.flops_per_sample, rel=0.05)


def test_tensor_parallelism_splits_the_key_value_heads_and_needs_them_to_divide():
    stats = transformer_stats(TRANSFORMERS["llama3-8b"], name="llama3-8b")
    assert ("key/value heads", 8) in stats.tp.divides
    assert stats.tp.why_not(16) == "key/value heads 8 does not divide by tp=16"
    cfg = TRANSFORMERS["llama3-8b"]
    norms = 2 * cfg.hidden
    split = transformer_params(cfg)["block"] - norms  # no biases: everything but the two RMSNorms
    table = cfg.vocab * cfg.hidden  # the embedding and the untied head, each split by vocabulary rows
    assert rank_params(stats, 8) == 2 * table // 8 + 32 * (split // 8 + norms) + cfg.hidden


def test_shape_flags_override_a_preset_and_tie_or_untie_its_head():
    untied = resolve_model(ModelSpec(model="gpt2", tied=False)).find_stats()
    assert untied.params - resolve_model("gpt2").find_stats().params == 50257 * 768
    tied = resolve_model(ModelSpec(model="llama3-8b", tied=True, kv_heads=32, ffn_hidden=14336)).find_stats()
    assert (
        tied.params
        == transformer_params(GPTConfig(**{**TRANSFORMERS["llama3-8b"].__dict__, "tied": True, "kv_heads": 32}))[
            "total"
        ]
    )
    assert resolve_model(ModelSpec(params="8B", heads=32, hidden=4096, kv_heads=8)).params == 8_000_000_000


def test_the_exact_layout_of_a_384_gpu_run_splits_its_global_batch_over_dp_not_the_gpus():
    """Megatron-style dp=8 x pp=12 x tp=4 on 48 nodes: 2048 samples are 256 per replica, though not 2048 / 384."""
    stats = transformer_stats(TRANSFORMERS["llama3-70b"], name="llama3-70b")
    plan = make_plan(
        stats,
        PlanConfig(
            gpus=8,
            nodes=48,
            inter_node="ib-ndr",
            layout="dp=8,pp=12,tp=4",
            training=Training(micro_batch=1, global_batch=2048),
        ),
    )
    assert [e.layout.describe() for e in plan.estimates] == ["1 rank", "dp=8 pp=12 tp=4", "dp=8 pp=12 shard=8 tp=4"]
    assert [e.name for e in plan.estimates[1:]] == ["hybrid+tp", "hybrid+zero1+tp"]  # DDP or ZeRO-1 across dp
    assert plan.choice.layout.dims == ParallelDims(dp_replicate=8, pp=12, tp=4)
    assert plan.choice.batch.micro_batches == 256 and plan.choice.fits
    assert plan.reason.startswith("the layout asked for (dp=8 pp=12 tp=4) fits as hybrid+tp")
    searched = make_plan(
        stats,
        PlanConfig(gpus=8, nodes=48, inter_node="ib-ndr", tp=4, training=Training(micro_batch=1, global_batch=2048)),
    )
    assert all(2048 % e.layout.dp == 0 for e in searched.estimates)
    left_out = "does not split evenly over 384 GPUs: layouts of dp=3, dp=6, dp=12, dp=24, dp=48"
    assert any(left_out in n for n in searched.notes)


def test_an_exact_data_parallel_layout_compares_its_flavours():
    stats = transformer_stats(TRANSFORMERS["gpt2"], name="gpt2")
    plan = make_plan(stats, PlanConfig(gpus=8, dp=4, tp=2))
    assert {e.name for e in plan.estimates[1:]} == {"ddp+tp", "zero2+tp", "zero3+tp"}
    assert exact_layout(tp=2) is None  # --tp alone still searches
    assert exact_layout("pp=2", tp=4) == ParallelDims(pp=2, tp=4)


def test_an_exact_layout_that_fits_nowhere_is_planned_and_shown_with_how_far_over(capsys):
    """A layout the user names is never turned into a refusal: its rows say by how many GiB they are over, and the
    plan recommends nothing (the search, asked for nothing, still refuses in one line)."""
    argv = ["plan", "--params", "70B", "--gpu", "rtx-4090", "--gpus", "8", "--batch", "1"]
    assert main([*argv, "--layout", "dp=8", "--breakdown"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith(("zero3 ", "ddp "))}
    over = float(rows["zero3"].split("no +")[1].split()[0])
    total = float(rows["zero3"].split("no +")[1].split()[1])
    assert over == pytest.approx(total - 24.0, abs=0.5)  # the GiB over the 24 GiB of an RTX 4090 (whole GiB above 100)
    assert "recommended: none — the layout asked for (dp=8) fits in no way to run it: need " in out
    seventy = resolve_model(ModelSpec(params="70B"))
    plan = make_plan(seventy, PlanConfig(gpu="rtx-4090", gpus=8, dp=8, training=Training(micro_batch=1)))
    assert plan.choice is None and all(e.over > 0 for e in plan.estimates)
    with pytest.raises(ConfigError, match="^no strategy fits: need "):
        make_plan(seventy, PlanConfig(gpu="rtx-4090", gpus=8, training=Training(micro_batch=1)))


def test_cli_plans_a_config_json_with_an_exact_layout(tmp_path, capsys):
    _hf("llama", **HF_SHAPES["llama-gqa"][1]).save_pretrained(tmp_path)
    assert main(["plan", "--model-config", str(tmp_path), "--gpus", "4", "--layout", "dp=2,tp=2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert {s["name"] for s in plan["strategies"]} >= {"ddp+tp"}
    assert "2 key/value" in plan["model"]["source"]
