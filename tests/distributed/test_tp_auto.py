"""``tp_plan="auto"``: a tensor-parallel plan inferred for models paratrain has none for.

One launched job at world 2 (tests/helpers/tp_auto_workers.py) trains, under ``Parallel("tp")``: a nanoGPT-style GPT
written here (fused ``c_attn``, tied head: everything split), the same with nanoGPT's own ``C // n_head`` reshape (the
attention left replicated, the rest split), transformers' GPT-2 and Llama with grouped-query attention forced to
``"auto"``, BERT with no plan given (inferred by default), Qwen2 (grouped-query attention, biases, tied head) and
GPT-2 with PEFT LoRA adapters on every block layer (each adapter split with its base layer); a second job at world 4
trains zero3 x tp=2 (two replicas of two tp ranks) on the nanoGPT-style GPT, Mistral, BERT and LoRA over GPT-2 and
Qwen2, and ``tp`` over all four ranks on the nanoGPT-style GPT with 4 heads and a Qwen2 with 8 query
and 4 key/value heads. Both jobs also train tests/helpers/shapes.py's torchtitan-shaped Llama 3, Qwen3 (tied) and
DeepSeek-V3 (latent attention, mixtures of experts) with no plan given; the first job also DeepSeek-V3 with its
queries from a latent too. Each equal to one plain process (fp32 and SGD:
``TOL``, as tests/distributed/test_tensor_parallel.py). The inference itself — what it splits, adjusts and leaves whole,
and what it refuses — is checked in this process, without a process group (the probe runs on one process).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from helpers.shapes import titan_dsv3, titan_llama, titan_qwen3
from helpers.tp_auto_workers import MODELS, STEPS, NanoGPT, nano, run_auto, titan_dsv3_query_latent, train
from helpers.zoo import HIDDEN, MOE_ZOO, ZOO
from helpers.zoo_workers import TOL
from torch import nn

import paratrain
from paratrain.cli.main import main
from paratrain.distributed.tensor_parallel.compose import TensorParallel
from paratrain.distributed.tensor_parallel.infer import choose_plan
from paratrain.distributed.tensor_parallel.probe import Split, _gradients, block_call, evaluating, verify
from paratrain.distributed.tensor_parallel.styles import Colwise, FusedColwise, PerHead, Replicated, Rowwise
from paratrain.testing import max_abs_diff, spawn

CASES = [
    ("nano", "auto"),
    ("nano_input_heads", "auto"),
    ("gpt2", "auto"),
    ("llama", "auto"),
    ("bert", None),
    ("qwen", "auto"),
    ("lora_gpt2", "auto"),
    ("titan_llama", None),
    ("titan_qwen3", None),
    ("titan_dsv3", None),
    ("titan_dsv3_query_latent", None),
]
# GPT-2 and Qwen2 under zero3 x tp: as the bases of lora_gpt2 and lora_qwen (every block layer adapted, each adapter
# split with its base layer), and alone under tp at world 2
ZERO3_TP = [
    ("nano", "auto"),
    ("mistral", "auto"),
    ("bert", None),
    ("lora_gpt2", "auto"),
    ("lora_qwen", "auto"),
    ("titan_llama", None),
    ("titan_qwen3", None),
    ("titan_dsv3", None),
]
TP4 = [("nano4", "auto", ("tp", {})), ("qwen8", "auto", ("tp", {}))]  # tp=4: 4 heads; 8 query, 4 key/value heads


@pytest.fixture(scope="module")
def world2():
    return spawn(run_auto, 2, (CASES,), timeout_s=240)


@pytest.fixture(scope="module")
def world4():
    """zero3 x tp: two replicas (dp=2), each split over tp=2; then ``tp`` over all four ranks."""
    return spawn(run_auto, 4, (ZERO3_TP + TP4, "zero3", {"tp": 2}), timeout_s=480)


def one_process(name: str) -> dict:
    spec = MODELS[name]
    model = spec.build()
    opt = spec.optimizer(model)
    train(spec, model, opt)
    return model.state_dict()


@pytest.mark.launched
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_auto_plan_trains_like_one_process(world2, name):
    result = world2[0][name]
    assert "error" not in result, result["error"]
    assert max_abs_diff(result["state"], one_process(name)) <= TOL
    printed = result["printed"]
    assert printed.startswith(f"paratrain: tp_plan='auto' for {type(MODELS[name].build()).__name__} over tp=2"), printed
    assert "rowwise" in printed and world2[1][name]["printed"] == "", "printed once, on rank 0"
    assert result["norms"] == {"local": True, "dtensors": True}, "norms run on local weights, held as DTensors"
    # once the first step has made its state, the optimizer updates the replicated parameters on local tensors
    assert result["optimizer"] == {"local_steps": [False] + [True] * (STEPS - 1), "dtensors": True}
    warned = [rank[name]["warned"] for rank in world2]
    if name == "nano_input_heads":  # attention left whole: said on every rank, one line
        assert all(len(w) == 1 and "leaves whole on every rank" in w[0] and "\n" not in w[0] for w in warned), warned
        assert "transformer.h.* attention (attn.c_attn, attn.c_proj: split, its forward fails" in warned[0][0]
    else:
        assert warned == [[], []], warned


@pytest.mark.launched
@pytest.mark.parametrize("name", [c[0] for c in ZERO3_TP])
def test_auto_plan_under_zero3_x_tp_trains_like_one_process(world4, name):
    result = world4[0][name]
    assert "error" not in result, result["error"]
    assert max_abs_diff(result["state"], one_process(name)) <= TOL
    assert "rowwise" in result["printed"] and all(r[name]["printed"] == "" for r in world4[1:])
    assert result["norms"] == {"local": True, "dtensors": True}, "inside FSDP's units too"
    assert result["optimizer"] == {"local_steps": [False] * STEPS, "dtensors": True}, "FSDP shards them over dp"


@pytest.mark.launched
@pytest.mark.parametrize("name", [c[0] for c in TP4])
def test_auto_plan_over_four_tp_ranks_trains_like_one_process(world4, name):
    result = world4[0][f"{name}/tp"]
    assert "error" not in result, result["error"]
    assert max_abs_diff(result["state"], one_process(name)) <= TOL
    assert "over tp=4" in result["printed"] and "attention" in result["printed"], result["printed"]
    assert result["optimizer"] == {"local_steps": [False] + [True] * (STEPS - 1), "dtensors": True}


def test_nanogpt_style_is_split_whole_and_tied():
    plan = choose_plan(nano(), "auto", 2)
    styles = dict(plan.styles)
    assert isinstance(styles["transformer.h.*.attn.c_attn"], FusedColwise)
    assert isinstance(styles["transformer.h.*.mlp.c_proj"], Rowwise)
    assert {"transformer.wte", "lm_head", "transformer.h.*.attn.c_proj", "transformer.h.*.mlp.c_fc"} <= set(styles)
    assert not plan.sequence_parallel
    summary = "\n".join(plan.summary)
    assert "tied to transformer.wte" in summary and "transformer.h.*.attn.n_head" in summary, summary
    assert summary.endswith("replicated: everything else")
    model = nano()
    plan.adjust(model, 2)
    assert model.transformer.h[1].attn.n_head == 1 and model.transformer.h[1].attn.n_embd == HIDDEN // 2


def test_attention_whose_split_changes_its_output_stays_replicated():
    """nanoGPT's own reshape takes the head size from the input's width; an attention module whose head count
    paratrain cannot name runs split but computes other heads: both are caught by the probe and left whole."""
    summary = "\n".join(choose_plan(nano(heads_from_input=True), "auto", 2).summary)
    assert "c_attn ->" not in summary and "mlp.c_fc -> colwise" in summary
    assert "replicated: transformer.h.* attention (attn.c_attn, attn.c_proj: split, its forward fails" in summary

    model = nano()
    for block in model.transformer.h:
        block.attn.__class__, block.attn.heads = UnnamedHeads, block.attn.n_head
        del block.attn.n_head
    summary = "\n".join(choose_plan(model, "auto", 2).summary)
    assert "c_attn ->" not in summary and "its output differs from one process's" in summary, summary


class UnnamedHeads(nn.Module):
    """Attention keeping its head count under a name paratrain does not know; split, each rank would cut its
    heads' features into ``heads`` smaller heads and attend over those."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.c_attn(x).split(self.n_embd, dim=2))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def test_heads_that_do_not_divide_are_one_line():
    torch.manual_seed(0)
    with pytest.raises(paratrain.ConfigError, match=r"attn has n_head=3 heads, which do not split over tp=2") as err:
        choose_plan(NanoGPT(n_head=3, n_embd=48), "auto", 2)
    assert "\n" not in str(err.value)


def test_nothing_to_split_is_one_line_and_auto_needs_a_degree():
    with pytest.raises(paratrain.ConfigError, match="tp_plan='auto' found nothing in Sequential it can split") as err:
        choose_plan(ZOO["frozen"].build(), "auto", 2)
    assert "\n" not in str(err.value)
    with pytest.raises(paratrain.ConfigError, match="infers a plan for a tp degree; give tp=N"):
        choose_plan(nano(), "auto", None)
    with pytest.raises(paratrain.ConfigError, match="tp_plan must be 'auto' or a dict"):
        paratrain.Parallel("tp", tp_plan="magic")


def test_built_in_plans_still_win_unless_auto_is_asked():
    assert choose_plan(ZOO["gpt2"].build(), None, 2).name == "GPT-2"
    assert choose_plan(ZOO["gpt2"].build(), "auto", 2).name == "tp_plan='auto' for GPT2LMHeadModel"
    assert choose_plan(ZOO["nanogpt"].build(), None, 2).name == "paratrain GPT"


def test_lora_adapters_are_split_with_their_base_layer():
    """A column-split base: its ``lora_B`` column-split alike (by the same blocks when fused), ``lora_A`` whole; a
    row-split base: its ``lora_A`` row-split, ``lora_B`` whole (tensor_parallel/adapters.py)."""
    styles = dict(choose_plan(MODELS["lora_gpt2"].build(), "auto", 2).styles)
    block = "base_model.model.transformer.h.*"
    assert isinstance(styles[f"{block}.attn.c_attn.base_layer"], FusedColwise)
    assert styles[f"{block}.attn.c_attn.lora_B.default"].parts == 3
    for row in ("attn.c_proj", "mlp.c_proj"):
        assert isinstance(styles[f"{block}.{row}.base_layer"], Rowwise)
        assert isinstance(styles[f"{block}.{row}.lora_A.default"], Rowwise)
    assert not any(k.endswith(("c_attn.lora_A.default", "c_proj.lora_B.default")) for k in styles), styles


def test_a_lora_variant_stays_whole_and_says_so():
    """DoRA normalises by the whole base weight, so its layer is not split; the MLP beside it still is (found by
    definition order when no attention is recognised to give the hidden width)."""
    import warnings

    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            ZOO["gpt2"].build(), LoraConfig(r=4, target_modules=["c_attn"], use_dora=True, fan_in_fan_out=True)
        )
    summary = "\n".join(choose_plan(model, "auto", 2).summary)
    assert "replicated: base_model.model.transformer.h.*.attn.c_attn (a LoRA variant such as DoRA" in summary, summary
    assert "mlp.c_fc -> colwise (MLP)" in summary and "mlp.c_proj -> rowwise (MLP)" in summary, summary


def test_latent_attention_is_found_by_its_kernel_call_and_split_around_its_latent():
    """DeepSeek-V3's attention has no key or value projection to name: it is the module around the attention kernel's
    call; its latent projection stays whole (its output's gradient summed: every rank's heads read it), the layer
    the latent feeds splits with the heads, the norm between sees this rank's heads; the dense block's MLP and the
    shared expert split, the routed experts stay whole, and nothing is warned."""
    plan = choose_plan(titan_dsv3(), "auto", 2)
    styles = dict(plan.styles)
    attention = "layers.*.attention"
    assert isinstance(styles[f"{attention}.wq"], Colwise) and isinstance(styles[f"{attention}.wo"], Rowwise)
    assert isinstance(styles[f"{attention}.wkv_b"], PerHead)
    latent, norm = styles[f"{attention}.wkv_a"], styles[f"{attention}.kv_norm"]
    assert isinstance(latent, Replicated) and latent.output_summed and not latent.summed
    assert isinstance(norm, Replicated) and norm.summed and not norm.output_summed
    for mlp in ("feed_forward", "moe.shared"):
        assert isinstance(styles[f"layers.*.{mlp}.w1"], Colwise) and isinstance(styles[f"layers.*.{mlp}.w2"], Rowwise)
    assert not any("routed" in k or "gate" in k for k in styles), styles
    assert "  layers.{1,2}.moe.routed: whole on every rank (routed experts)" in plan.summary
    assert plan.warning is None and plan.per_module(titan_dsv3())
    printed = choose_plan(titan_dsv3_query_latent(), None, 2).printed()  # queries from a latent too: no colwise
    assert {k.rpartition(".")[2]: v for k, v in printed.items() if ".attention." in k} == {
        "wo": "rowwise",
        "wkv_b": "heads",
        "wq_b": "heads",
        "kv_norm": "replicate(grad=sum)",
        "q_norm": "replicate(grad=sum)",
        "wkv_a": "replicate(output_grad=sum)",
        "wq_a": "replicate(output_grad=sum)",
    }


def test_torchtitan_shaped_llama_and_qwen3_split_every_block_layer():
    for build, norms in ((titan_llama, False), (titan_qwen3, True)):
        plan = choose_plan(build(), None, 2)
        printed = plan.printed()
        assert [printed[f"layers.*.attention.{n}"] for n in ("wq", "wk", "wv", "wo")] == ["colwise"] * 3 + ["rowwise"]
        assert (printed.get("layers.*.attention.q_norm") == "replicate(grad=sum)") is norms
        assert printed["layers.*.feed_forward.w2"] == "rowwise" and plan.warning is None


def test_blocks_of_two_shapes_that_split_a_layer_differently_are_named_block_by_block():
    """A layer held by blocks of two shapes is one pattern only where both split it alike."""
    model = titan_dsv3()
    model.layers["0"].attention.inner_attention = Values()  # no attention kernel in the dense block
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = choose_plan(model, "auto", 2)
    assert "layers.0.attention.wq" not in plan.styles and "layers.*.attention.wq" not in plan.styles
    assert isinstance(plan.styles["layers.1.attention.wq"], Colwise)
    assert isinstance(plan.styles["layers.2.attention.wkv_b"], PerHead)
    assert plan.warning.startswith("tp_plan='auto' for Decoder over tp=2 leaves whole on every rank"), plan.warning
    assert "layers.0 attention (no query/key/value projections recognised" in plan.warning
    plan.per_module(model)


class Values(nn.Module):
    """Each position's values as they are: a stand-in for attention that calls no attention kernel."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return v


def test_a_plan_leaving_block_parts_whole_warns_on_every_rank_and_tp_plan_prints_it(capsys):
    """The warning is ``prepare``'s on every rank (no process group here: this process is every rank), one line;
    ``paratrain tp-plan`` prints it too, and needs no ``--input`` (the docs' example)."""
    plan = choose_plan(nano(heads_from_input=True), "auto", 2)
    with pytest.warns(UserWarning, match=r"leaves whole on every rank .*transformer\.h\.\* attention") as caught:
        TensorParallel._say(plan)
    assert len(caught) == 1 and "\n" not in str(caught[0].message)
    capsys.readouterr()
    assert main(["tp-plan", "--model", "helpers.tp_auto_workers:nano_input_heads", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert f"# warning: {plan.warning}" in out.splitlines() and "'transformer.h.*.mlp.c_fc': 'colwise'," in out
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a plan splitting all of every block warns nothing
        TensorParallel._say(choose_plan(nano(), "auto", 2))


def test_a_mixture_with_no_dense_mlp_keeps_its_experts_whole_without_a_warning():
    """Mixtral's blocks have routed experts and no shared expert: whole by design, said in the summary, not warned."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = choose_plan(MOE_ZOO["mixtral"].build(), "auto", 2)
    assert plan.warning is None and "  model.layers.*.mlp.experts: whole on every rank (routed experts)" in plan.summary
    assert not any("MLP" in line for line in plan.summary), plan.summary


def test_the_probe_runs_a_latent_split_backward_and_refuses_wrong_gradients():
    """A latent every rank's heads read: splits whose output is right can still give wrong gradients (a norm between
    latent and heads not summed; the latent's output not summed, its gradient then this rank's heads' only)."""
    model = titan_dsv3()
    block = model.layers["1"]
    call = block_call(model, block, 65)
    right = Split(
        columns={"attention.wq": 1},
        rows=("attention.wo",),
        heads=("attention.wkv_b",),
        summed=("attention.kv_norm",),
        latent=("attention.wkv_a",),
    )
    plain = Split(columns={"attention.wq": 1, "attention.wkv_b": 1}, rows=("attention.wo",))
    with evaluating(model):
        assert verify(block, right, 2, *call) is None
        unsummed = verify(block, dataclasses.replace(right, summed=()), 2, *call)
        assert unsummed == "split, the gradient of attention.kv_norm.weight differs from one process's", unsummed
        assert verify(block, plain, 2, *call) is None, "its output is right"
        assert _gradients(block, plain, 2, *call) == "split, the gradient of its input differs from one process's"
