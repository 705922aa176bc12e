"""Tensor parallelism on the zoo models that have a plan (GPT-2, Llama, our GPT), equal to one plain process on the
same global batch: ``tp`` at world 2, ddp/zero2/zero3 x tp=2 and ``auto`` choosing zero3 x tp=2 (when the memory
per rank holds zero3 only with tp) at world 4 (one launched job per world size,
tests/helpers/tp_workers.py), with accumulation, clipping over the sharded gradients, bf16 autocast, checkpoints that
resume bitwise, load onto another tp degree and export to one plain file.

Tolerances: fp32 runs sum the same products in another order (a row-split layer's partial sums are all-reduced)
and match one process to ~1e-8 with SGD; our GPT trains with AdamW, whose update divides by sqrt(v) and turns the
attention key bias's ~1e-9 rounding noise into larger steps (see tests/helpers/zoo.py), ~1e-5 — hence ``TOL`` as in
tests/strategies/test_zoo.py. bf16 autocast rounds every matmul's output to 8 bits of mantissa, and a split matmul
rounds partial sums before adding them: ``BF16_TOL``.
"""

from __future__ import annotations

import math
import subprocess
from dataclasses import replace
from typing import Any

import pytest
import torch
from helpers.tp_workers import STEPS, case_key, run_cases, step_batch
from helpers.zoo import ZOO
from helpers.zoo_workers import TOL

import paratrain
from paratrain import strategies
from paratrain.distributed.tensor_parallel import plan_for
from paratrain.planner import Layout
from paratrain.planner.auto import local_cluster, parameter_stats
from paratrain.planner.estimates import estimate
from paratrain.planner.optimizers import planned
from paratrain.planner.training import Training
from paratrain.strategies import check_world
from paratrain.strategies.tp_shape import model_shape
from paratrain.testing import max_abs_diff, spawn

BF16_TOL = 2e-3
MODELS = ("gpt2", "llama", "nanogpt")
CLIP = 0.05  # below every model's gradient norm, so every step clips
# clipping on GPT-2 (its tied embedding and head split over the vocabulary: the norm counts the tie once),
# accumulation on our GPT (AdamW, two groups) and bf16 on Llama: each one model's plan, the math the same on every plan
CLIPPED, ACCUMULATED, BF16 = ("gpt2",), ("nanogpt",), ("llama",)
WORLD2 = (
    [(m, "tp", {}) for m in MODELS]
    + [(m, "tp", {"clip_grad_norm": CLIP}) for m in CLIPPED]
    + [(m, "tp", {"accumulate": 2}) for m in ACCUMULATED]
    + [(m, "tp", {"precision": "bf16-mixed"}) for m in BF16]
    + [
        ("frozen", "tp", {"tp_plan": {"2": "colwise", "4": "rowwise"}}),
        ("nanogpt", "tp", {"compile": True}),
        ("nanogpt", "tp", {"compile": True, "activation_checkpointing": True}),
        ("gpt2", "tp", {}, ("zero2", {})),  # tp=2 -> tp=1
        ("llama", "ddp", {}, ("tp", {})),  # tp=1 -> tp=2
    ]
)


def memory_for_tp(model_name: str, world: int) -> float:
    """GiB per rank (of a CPU node of ``world`` ranks) halfway between what zero3 with tp=2 needs and the least any
    layout without tp needs (ddp, zero1, zero2, zero3), for the model and its optimizer by the planner (``auto`` plans
    the optimizer ``prepare`` gets with the model): where ``strategy="auto"`` must choose tp."""
    model = ZOO[model_name].build()
    stats = replace(parameter_stats(model), tp=model_shape(model))
    cluster = local_cluster(torch.device("cpu"), world, world)
    one_gib = replace(cluster, device=replace(cluster.device, memory_gib=1.0))
    training = Training(precision="fp32", optimizer=planned(ZOO[model_name].optimizer(model)).key, micro_batch=1)

    def need(zero: int, tp: int = 1) -> Any:
        name = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}[zero]
        return estimate(
            stats,
            Layout.of(name=name, dp=world // tp, zero=zero, shard=world // tp if zero else 1, tp=tp),
            training,
            one_gib,
        )

    with_tp = need(3, tp=2)
    without = min((need(zero) for zero in (0, 1, 2, 3)), key=lambda e: e.memory.total)
    assert with_tp.memory.total < without.memory.total
    return (without.memory.total + with_tp.memory.total) / 2 / with_tp.capacity


# zero3 x tp on every model; ddp, zero1 and zero2 x tp each on one model (the data-parallel layer over the tp mesh is
# the same for every plan): the tied GPT-2 and our GPT under ddp and zero1, Llama under zero2
LAYOUTS4 = {"ddp": ("gpt2",), "zero1": ("nanogpt",), "zero2": ("llama",), "zero3": MODELS}
WORLD4 = [(m, s, {"tp": 2}) for s, models in LAYOUTS4.items() for m in models] + [
    ("nanogpt", "zero3", {"tp": 2}, ("ddp", {})),  # 2 x tp=2 -> 4 replicas, tp=1
    ("llama", "zero3", {}, ("zero3", {"tp": 2})),  # 4 shards -> 2 shards x tp=2
    ("llama", "auto", {"memory_gib": memory_for_tp("llama", 4)}),
]


def plain(model_name: str, clip: float | None = None, bf16: bool = False) -> tuple[dict, list[float], torch.nn.Module]:
    """One process, plain PyTorch: the final state, each step's gradient norm, and the model."""
    spec = ZOO[model_name]
    model = spec.build()
    opt = spec.optimizer(model)
    norms = []
    for s in range(STEPS):
        x, y = step_batch(spec, s)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = spec.loss(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip or math.inf)))
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, model


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn(run_cases, 2, (WORLD2, str(tmp_path_factory.mktemp("tp2"))), timeout_s=300)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp4")
    return spawn(run_cases, 4, (WORLD4, str(tmp)), timeout_s=300)[0], tmp


@pytest.fixture(scope="module")
def references():
    return {m: plain(m) for m in (*MODELS, "frozen")}


def check(result: dict, expected: dict, tol: float = TOL) -> None:
    assert "error" not in result, result.get("error")
    assert max_abs_diff(result["state"], expected) <= tol


@pytest.mark.launched
@pytest.mark.parametrize("model_name", MODELS)
def test_tp_world2_equals_one_process(world2, references, model_name):
    result = world2[case_key(model_name, "tp", {})]
    check(result, references[model_name][0])
    assert result["resumed"] == 0.0, "save -> load -> continue differs from the uninterrupted run"
    assert result["seen"] == ["DTensor(Shard(dim=2),)"], "the loss must get the logits split over the vocabulary"
    # called directly, the model hands back full plain logits, the one-process values
    assert result["logits_type"] == "Tensor"
    x = step_batch(ZOO[model_name], 0)[0]
    expected = getattr(out := references[model_name][2](x), "logits", out).detach()
    assert max_abs_diff({"l": result["logits"]}, {"l": expected}) <= TOL * expected.abs().max()  # logits reach ~16


@pytest.mark.launched
@pytest.mark.parametrize("model_name", CLIPPED)
def test_tp_clips_the_global_norm_of_the_sharded_gradients(world2, model_name):
    result = world2[case_key(model_name, "tp", {"clip_grad_norm": CLIP})]
    state, norms, _ = plain(model_name, clip=CLIP)
    check(result, state)
    assert result["norms"] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > CLIP


@pytest.mark.launched
def test_tp_compiles_the_split_blocks(world2, references):
    """Tensor parallelism first, then compile of the blocks it split (torchtitan's order): the same training math
    as one process, every block compiled. With activation checkpointing too, torch's compiler fails deep inside
    (a recomputed block of DTensors): refused in one line instead."""
    result = world2[case_key("nanogpt", "tp", {"compile": True})]
    check(result, references["nanogpt"][0], tol=5 * TOL)  # inductor's fused kernels round unlike eager's
    assert result["resumed"] == 0.0
    assert result["blocks"] == {"compiled": True, "checkpointed": False}
    refused = world2[case_key("nanogpt", "tp", {"compile": True, "activation_checkpointing": True})]
    assert refused["error"].startswith("activation checkpointing with compile fails under tensor parallelism"), refused


@pytest.mark.launched
@pytest.mark.parametrize("model_name", ACCUMULATED)
def test_tp_accumulation_equals_the_whole_batch(world2, references, model_name):
    check(world2[case_key(model_name, "tp", {"accumulate": 2})], references[model_name][0])


@pytest.mark.launched
@pytest.mark.parametrize("model_name", BF16)
def test_tp_bf16_mixed_matches_one_process_under_autocast(world2, model_name):
    check(world2[case_key(model_name, "tp", {"precision": "bf16-mixed"})], plain(model_name, bf16=True)[0], BF16_TOL)


@pytest.mark.launched
def test_tp_with_a_user_plan(world2, references):
    result = world2[case_key("frozen", "tp", {"tp_plan": {"2": "colwise", "4": "rowwise"}})]
    check(result, references["frozen"][0])
    assert result["resumed"] == 0.0


@pytest.mark.launched
@pytest.mark.parametrize("case", [c for c in WORLD2 if len(c) == 4], ids=lambda c: case_key(*c))
def test_tp_checkpoint_loads_onto_another_tp_degree(world2, references, case):
    result = world2[case_key(*case)]
    check(result, references[case[0]][0])
    assert result["resumed"] <= TOL


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy", [(m, s) for s, models in LAYOUTS4.items() for m in models])
def test_data_parallel_x_tp_world4_equals_one_process(world4, references, model_name, strategy):
    result = world4[0][case_key(model_name, strategy, {"tp": 2})]
    check(result, references[model_name][0])
    assert result["resumed"] == 0.0
    assert result["seen"] == ["DTensor(Shard(dim=2),)"]
    assert not [w for w in result["warned"] if "view tensor" in w], result["warned"]  # the gathered logits: no view


@pytest.mark.launched
def test_auto_chooses_zero3_with_tp_when_zero3_alone_does_not_fit(world4, references):
    result = world4[0][case_key(*WORLD4[-1])]
    check(result, references["llama"][0])
    assert result["layout"] == "zero3(reshard_after_forward=True, tp=2)"
    assert result["resumed"] == 0.0
    assert result["dp"] == 2  # the loader's shards are the dp groups, not the four ranks
    assert len(result["early"]) == 3
    for refusal in result["early"]:  # asked before the model: the layout is not chosen yet
        assert refusal.startswith("strategy 'auto' chooses the layout when prepare() sees the model"), refusal


def test_the_runtime_tp_shape_is_what_the_plan_splits():
    model = ZOO["gpt2"].build()  # wte and lm_head tied: one weight, split over the vocabulary
    shape = model_shape(model)
    units = dict(parameter_stats(model).units)
    split = dict(zip(units, shape.split))
    block = model.transformer.h[0]
    whole = sum(p.numel() for n, p in block.named_parameters() if n.startswith("ln_") or n.endswith("c_proj.bias"))
    assert split["transformer.h.0"] == units["transformer.h.0"] - whole
    assert split["transformer.wte"] == units["transformer.wte"] and split["transformer.wpe"] == 0
    assert dict(shape.divides) == {"n_head": 2, "n_inner": 128} and shape.layers == 2
    assert model_shape(ZOO["bert"].build()) is None


@pytest.mark.launched
@pytest.mark.parametrize("case", [c for c in WORLD4 if len(c) == 4], ids=lambda c: case_key(*c))
def test_2d_checkpoint_loads_onto_another_layout(world4, references, case):
    result = world4[0][case_key(*case)]
    check(result, references[case[0]][0])
    assert result["resumed"] <= TOL


@pytest.mark.launched
def test_export_consolidates_a_2d_checkpoint(world4, paratrain_cmd, tmp_path):
    results, tmp = world4
    index = WORLD4.index(("llama", "zero3", {"tp": 2}))
    out = tmp_path / "llama.pt"
    subprocess.run([*paratrain_cmd, "export", str(tmp / str(index)), str(out)], check=True, capture_output=True)
    exported = torch.load(out, weights_only=True)
    assert max_abs_diff(exported, results[case_key("llama", "zero3", {"tp": 2})]["saved"]) == 0.0
    ZOO["llama"].build().load_state_dict(exported)


def test_a_model_without_a_plan_is_refused_in_one_line():
    with pytest.raises(paratrain.ConfigError, match=r"no plan for BertForSequenceClassification.*tp_plan=") as err:
        plan_for(ZOO["bert"].build(), None)
    assert "\n" not in str(err.value)


def test_a_plan_pattern_that_matches_nothing_is_refused():
    plan = plan_for(ZOO["frozen"].build(), {"layers.*.up": "colwise"})
    with pytest.raises(paratrain.ConfigError, match="matches no module"):
        plan.per_module(ZOO["frozen"].build())
    with pytest.raises(paratrain.ConfigError, match="not a style"):
        plan_for(ZOO["frozen"].build(), {"2": "diagonal"}).per_module(ZOO["frozen"].build())


def test_degrees_that_do_not_divide_the_world_name_the_valid_layouts():
    with pytest.raises(
        paratrain.ConfigError,
        match=r"valid layouts: zero3 tp=2 \(3 x 2\), zero3 tp=3 \(2 x 3\), "
        r"zero3 tp=6 \(1 x 6\)",
    ):
        check_world("zero3", 6, tp=4)
    with pytest.raises(paratrain.ConfigError, match=r"Parallel\('ddp', tp=2\)"):
        check_world("tp", 4, tp=2)
    with pytest.raises(paratrain.ConfigError, match="without tp"):
        paratrain.Parallel("ddp", tp_plan={"0": "colwise"})
    with pytest.raises(paratrain.ConfigError, match="options"):
        paratrain.Parallel("ddp", tp=2, bucket_cap_mb=5)
    with pytest.raises(paratrain.ConfigError, match="'hsdp' does not take tp"):
        check_world("hsdp", 4, tp=2)


def test_tp_under_pipelines_checks_its_layout_in_one_line():
    check_world("pipeline", 4, tp=2)
    check_world("pipeline", 4, tp=2, schedule="interleaved-1f1b")  # two stages per rank, each split over tp
    check_world("hybrid", 8, tp=2)
    cases = [
        (("pipeline", 6, {"tp": 4}), r"valid layouts: pipeline tp=2 \(3 x 2\), pipeline tp=3 \(2 x 3\)"),
        (("pipeline", 2, {"tp": 2}), r"at least 2 pipeline stages \(4 processes with tp=2\)"),
        (("hybrid", 4, {"tp": 2}), r"dp >= 2 and pp >= 2 \(got dp=1 x pp=2 x tp=2 from 4 processes\); launch 8"),
        (("hybrid", 8, {"tp": 2, "dp": 3}), r"into dp=3 pipelines of tp=2"),
    ]
    for (strategy, world, options), message in cases:
        with pytest.raises(paratrain.ConfigError, match=message) as err:
            check_world(strategy, world, **options)
        assert "\n" not in str(err.value)
    with pytest.raises(paratrain.ConfigError, match="not an nn.Sequential"):
        strategies.create("pipeline", tp=2).wrap_model(torch.nn.Sequential(torch.nn.Linear(2, 2)), None)


def test_one_process_tp_runs_the_model_unsplit():
    """``python train.py`` with tp: a one-rank group, the plan applied over one rank."""
    par = paratrain.Parallel("tp", monitor=False)
    model = ZOO["nanogpt"].build()
    model, opt = par.prepare(model, ZOO["nanogpt"].optimizer(model))
    x, y = step_batch(ZOO["nanogpt"], 0)
    with par.step(model, opt):
        loss = par.forward_backward(model, x, y, ZOO["nanogpt"].loss)
    assert isinstance(loss, torch.Tensor) and type(loss) is torch.Tensor
    par.close()


def test_ddp_with_tp_on_a_torch_without_fsdp2_replicate_is_one_line(monkeypatch):
    import sys

    from torch import nn

    from paratrain.distributed.data_parallel import apply_replicate

    monkeypatch.setitem(sys.modules, "torch.distributed._composable.replicate_with_fsdp", None)  # as before 2.9
    with pytest.raises(paratrain.ConfigError, match=r"replicate, which torch .* does not have.*use zero2 or zero3"):
        apply_replicate(nn.Linear(2, 2), mesh=None)
