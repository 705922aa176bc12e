"""Mixtures of experts (tests/helpers/zoo.py ``MOE_ZOO``) under every strategy, equal to one plain process on the same
global batch, and the router's load-balancing loss as one process computes it (``moe_aux_loss="global"``).

One launched job per world size runs every case (tests/helpers/zoo_moe_workers.py), with the dense zoo's
``run_case`` and ``reference`` (tests/helpers/zoo_workers.py): train, save, resume, compare. Routing is per token, so
without the router loss a replica's slice routes as the global batch does. The router loss is not per token: its
expert shares are the batch's, so the reference for it is the global batch in one forward (``slices=1``).

What a model brings (its blocks, routers, shared experts, biases, sinks, dense blocks) is proven per model where the
strategy handles the model itself: ddp and zero3 (FSDP units) at world 2, pipeline stages, tp plans. Where a
strategy only composes those with more ranks or another data engine (zero1, zero2, model_parallel on the CPU, hsdp,
hybrid, zero3 x tp=2), two to four of the models stand for all: each model whose own feature the composition
touches (Qwen3-MoE's dense first block in a stage, GPT-OSS's per-block attention types and its sinks split by tp),
and a transformers model beside our GPT where nothing does. docs/moe.md's table marks which.
"""

from __future__ import annotations

import pytest
import torch
from helpers.zoo import MOE_ZOO
from helpers.zoo_moe_workers import (
    ACCUMULATED,
    EXPERTS,
    MASKED,
    MICRO_SAMPLES,
    TOP_K,
    padded_batch,
    run_moe_cases,
)
from helpers.zoo_workers import MICRO, TOL, reference, step_batch

from paratrain.testing import max_abs_diff, spawn

EVERY = ("ddp", "zero3")  # every model: DDP's replicas, FSDP's units
# a wrapping that does not look inside the blocks (zero1: DDP's; zero2: zero3's units kept whole; model_parallel: DDP
# over stages all on the CPU): a transformers model and our GPT (Qwen2-MoE under zero2: CHECKPOINTED)
SOME = {"zero1": ("mixtral", "gpt_experts"), "zero2": ("qwen3_moe", "gpt_experts")}
SOME["model_parallel"] = ("mixtral", "gpt_experts")
WORLD2 = [(m, s) for s in EVERY for m in MOE_ZOO] + [(m, s) for s, models in SOME.items() for m in models]
ROUTED = [m for m in MOE_ZOO if m != "mixtral_aux"]  # no router loss: a pipeline stage can hold part of the blocks
GLOBAL = {"moe_aux_loss": "global"}
TP2 = {"tp": 2}
AUX2 = ("ddp", "zero3")
SMALL_UNITS = ("qwen2_moe", "gpt_oss", "gpt_experts")  # zero3 with the router and the experts as units
# the kv-cache-free recompute of a transformers block (Mixtral; GPT-OSS's eager attention; Qwen2-MoE's shared
# expert) and our GPT's blocks
CHECKPOINTED = [
    ("mixtral", "zero3"),
    ("gpt_oss", "ddp"),
    ("qwen2_moe", "zero2"),
    ("gpt_experts", "zero3"),
]
# world 4: hsdp and hybrid compose zero3's units and the pipeline's stages (every model at world 2) with replicas;
# zero3 x tp=2 shards tp's plans (every model under tp at world 2) over replicas: the models whose plans hold more
# than Mixtral's (Qwen3-MoE's summed norms, GPT-OSS's split sinks, our GPT's whole_sequence, the router loss's
# gathered logits). Mixtral x zero3 x tp=2 also trains with ep=2 (tests/distributed/test_expert_parallel.py).
HSDP = ("qwen3_moe", "gpt_experts")  # and Mixtral with its global router loss
HYBRID = ("qwen3_moe", "gpt_oss")  # a stage without experts; a stage's blocks' attention types
ZERO3_TP2 = ("qwen3_moe", "gpt_oss", "gpt_experts", "mixtral_aux")


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = [(m, s, {}) for m, s in WORLD2]
    cases += [(m, "pipeline", {}) for m in MOE_ZOO] + [(m, "tp", {}) for m in MOE_ZOO]
    cases += [(m, "zero3", {"min_params": 1}) for m in SMALL_UNITS]
    cases += [(m, s, {"activation_checkpointing": True}) for m, s in CHECKPOINTED]
    cases += [("mixtral_aux", s, GLOBAL) for s in AUX2] + [MASKED, ACCUMULATED]
    return spawn(run_moe_cases, 2, (cases, str(tmp_path_factory.mktemp("moe2"))), timeout_s=600)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = [(m, "hsdp", {}) for m in HSDP] + [(m, "hybrid", {}) for m in HYBRID]
    cases += [("mixtral_aux", "hsdp", GLOBAL)] + [(m, "zero3", TP2) for m in ZERO3_TP2]
    return spawn(run_moe_cases, 4, (cases, str(tmp_path_factory.mktemp("moe4"))), timeout_s=600)[0]


def check(result: dict, expected: dict[str, torch.Tensor], model_name: str) -> None:
    assert "error" not in result, result.get("error")
    assert not result["problems"], result["problems"]
    assert max_abs_diff(result["state"], expected) <= TOL
    assert result["resumed"] <= 1e-6, "save -> load -> continue differs from the uninterrupted run"
    MOE_ZOO[model_name].build().load_state_dict(result["state"])


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy", WORLD2)
def test_moe_world2_equals_one_process(world2, model_name, strategy):
    check(world2[f"{model_name}/{strategy}"], reference(model_name, 2), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", SMALL_UNITS)
def test_moe_with_routers_and_experts_as_units(world2, model_name):
    check(world2[f"{model_name}/zero3{{'min_params': 1}}"], reference(model_name, 2), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy", CHECKPOINTED)
def test_moe_with_activation_checkpointing(world2, model_name, strategy):
    """GPT-OSS's eager attention failed here: the recompute appended the keys to the key/value cache again."""
    check(world2[f"{model_name}/{strategy}{{'activation_checkpointing': True}}"], reference(model_name, 2), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", ROUTED)
def test_moe_pipeline_world2(world2, model_name):
    check(world2[f"{model_name}/pipeline"], reference(model_name, 1, microbatches=MICRO), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", HSDP)
def test_moe_hsdp_world4(world4, model_name):
    check(world4[f"{model_name}/hsdp"], reference(model_name, 4), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", HYBRID)
def test_moe_hybrid_world4(world4, model_name):
    check(world4[f"{model_name}/hybrid"], reference(model_name, 2, microbatches=MICRO), model_name)


@pytest.mark.launched
def test_a_pipeline_refuses_the_router_loss_in_one_line(world2):
    error = world2["mixtral_aux/pipeline"]["error"]
    assert "router's load-balancing loss" in error and "output_router_logits=False" in error and "\n" not in error


@pytest.mark.launched
@pytest.mark.parametrize("model_name", list(MOE_ZOO))
def test_moe_tp_world2(world2, model_name):
    """Attention and dense MLPs split over the 2 tp ranks, each mixture-of-experts block whole on both, on the same
    tokens (the router loss too: one replica sees the global batch); Qwen3's per-head query/key norms have their
    gradients summed over the ranks, GPT-OSS's attention sinks are split with the heads."""
    check(world2[f"{model_name}/tp"], reference(model_name, 1), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", ZERO3_TP2)
def test_moe_zero3_x_tp2_world4(world4, model_name):
    """Two replicas (dp=2) of a 2-way tp split: each MoE block whole on the tp ranks of a replica, sharded by zero3
    over the replicas like any other parameter."""
    check(world4[f"{model_name}/zero3{TP2}"], reference(model_name, 2), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("strategy", AUX2)
def test_the_global_router_loss_equals_one_process_on_the_global_batch(world2, strategy):
    check(world2[f"mixtral_aux/{strategy}{GLOBAL}"], reference("mixtral_aux", 2, slices=1), "mixtral_aux")


@pytest.mark.launched
def test_the_global_router_loss_under_hsdp(world4):
    check(world4[f"mixtral_aux/hsdp{GLOBAL}"], reference("mixtral_aux", 4, slices=1), "mixtral_aux")


@pytest.mark.launched
@pytest.mark.parametrize("strategy", AUX2)
def test_without_the_option_each_rank_balances_its_own_slice(world2, strategy):
    """The model's own router loss is each replica's: equal to the per-slice reference, apart from the global one."""
    state = world2[f"mixtral_aux/{strategy}"]["state"]
    assert max_abs_diff(state, reference("mixtral_aux", 2)) <= TOL
    assert max_abs_diff(state, reference("mixtral_aux", 2, slices=1)) > 10 * TOL


@pytest.mark.launched
def test_the_router_loss_over_padded_slices_is_the_global_batch(world2):
    """Unequal token counts (padding) on the ranks: the mean of their losses and gradients is transformers' loss
    of the global batch and its gradient."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    logits, mask = padded_batch()
    leaves = [x.clone().requires_grad_(True) for x in logits]
    expected = load_balancing_loss_func(tuple(leaves), EXPERTS, TOP_K, mask)
    expected.backward()
    got = world2["/".join(MASKED[:2])]
    assert torch.allclose(got["loss"], expected.detach(), atol=1e-6)
    assert torch.allclose(got["grads"], torch.stack([x.grad for x in leaves]), atol=1e-6)


@pytest.mark.launched
def test_with_accumulation_the_router_loss_is_global_per_micro_batch(world2):
    """2 micro-batches per step: each micro-batch's router loss is the one of the ranks' micro-batches together, as
    one process computes it running those unions as its micro-batches."""
    spec = MOE_ZOO[ACCUMULATED[0]]
    model = spec.build()
    opt = spec.optimizer(model)
    union = 2 * MICRO_SAMPLES
    for s in range(2):
        x, y = step_batch(spec, s, 2 * union)
        for m in range(2):
            (model(x[m * union : (m + 1) * union], labels=y[m * union : (m + 1) * union]).loss / 2).backward()
        opt.step()
        opt.zero_grad()
    got = world2["/".join(ACCUMULATED[:2]) + str(ACCUMULATED[2])]["state"]
    assert max_abs_diff(got, model.state_dict()) <= TOL
