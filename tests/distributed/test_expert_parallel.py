"""Expert parallelism (``Parallel(strategy, ep=E)``) on transformers Mixtral, Qwen3-MoE, GPT-OSS, OLMoE and Qwen2-MoE,
our GPT with experts and a torchtitan-shaped DeepSeek-V3 (experts named ``routed``, float counts): equal to one plain
process on the same global batch, resumed from a save as it ran, loaded at another ``ep`` (or none), and bad layouts
refused in one line.

One launched job per world size runs every case (tests/helpers/ep_workers.py); the references are plain PyTorch in
this process, the global batch split into the replicas' slices.
"""

from __future__ import annotations

import random
import re

import pytest
import torch
from helpers.cli import run_cli
from helpers.ep_workers import (
    MODELS,
    PER_RANK,
    TOL,
    dense,
    expert_elements,
    gpt_moe,
    mixtral,
    reference,
    restart_job,
    run_cases,
)
from helpers.paths import SCRIPTS

from paratrain.distributed.expert_parallel.experts import find_experts
from paratrain.errors import ConfigError
from paratrain.strategies.registry import check_world
from paratrain.testing import max_abs_diff

# (model, strategy, options, layouts that load its save after step 2: the same one resumes, another reshards);
# Mixtral and Qwen3-MoE under ddp x ep=2: the adamw, fused, fp16 and checkpointed Mixtral cases, world 4's Qwen3-MoE
WORLD2 = [
    ("gpt_moe", "ddp", {"ep": 2}, (("ddp", {"ep": 2}), ("ddp", {}), ("zero3", {}))),
    ("gpt_moe", "zero3", {"ep": 2}, (("zero3", {"ep": 2}), ("zero3", {}))),
    ("mixtral", "zero3", {"ep": 2}, (("zero3", {"ep": 2}), ("ddp", {}))),
    ("qwen3_moe", "zero2", {"ep": 2}, (("zero2", {"ep": 2}),)),
    ("gpt_moe", "ddp", {"ep": 2, "accumulate": 2, "clip_grad_norm": 0.5}, ()),
    ("gpt_moe", "zero3", {"ep": 2, "accumulate": 2, "clip_grad_norm": 0.5}, ()),
    ("mixtral", "zero3", {"ep": 2, "precision": "bf16-mixed"}, ()),
    ("gpt_moe", "ddp", {"ep": 2, "precision": "bf16-mixed"}, ()),
    ("mixtral", "ddp", {"ep": 2, "activation_checkpointing": True}, ()),
    ("gpt_oss", "zero3", {"ep": 2}, ()),
    ("olmoe", "ddp", {"ep": 2}, ()),
    ("qwen2_moe", "zero2", {"ep": 2}, ()),
    ("mixtral", "zero3", {"ep": 2, "compile": True}, ()),  # each block compiled, graph breaks at the exchange
    ("dense", "ddp", {"ep": 2}, ()),
    # CUDA's optimizer paths over experts (DTensors) beside plain parameters in one param group: multi-tensor
    # AdamW resumed and loaded without ep, fused AdamW, and fp16's grad scaler (unscaled before clipping)
    ("mixtral_adamw", "ddp", {"ep": 2}, (("ddp", {"ep": 2}), ("ddp", {}))),
    ("mixtral_fused", "ddp", {"ep": 2}, ()),
    ("mixtral", "ddp", {"ep": 2, "precision": "fp16-mixed", "clip_grad_norm": 0.5}, ()),
    # experts found by what they are (a module named routed, 3-D weights), given their float counts as a tensor
    ("titan_dsv3", "zero3", {"ep": 2}, (("zero3", {"ep": 2}), ("zero3", {}))),  # under ddp: beside tp
]
# beside cp (world 2: one replica, its 2 cp ranks the expert group) and tp (world 4: 2 replicas x tp=2, each tp rank
# with its own expert group of the 2 replicas): loads keep the replicas, with and without ep
BESIDE_CP = [
    ("gpt_moe", "zero3", {"ep": 2, "cp": 2}, (("zero3", {"ep": 2, "cp": 2}), ("zero3", {"cp": 2}))),
    ("mixtral", "ddp", {"ep": 2, "cp": 2}, (("ddp", {"ep": 2, "cp": 2}),)),
]
ROUTER_LOSS_UNDER_CP = ("mixtral_aux", "zero3", {"ep": 2, "cp": 2}, ())  # refused: each rank's slice's router loss
BESIDE_TP = [
    ("mixtral", "zero3", {"ep": 2, "tp": 2}, (("zero3", {"ep": 2, "tp": 2}), ("zero3", {"tp": 2}))),
    ("gpt_moe", "ddp", {"ep": 2, "tp": 2}, (("ddp", {"ep": 2, "tp": 2}),)),  # sequence parallel: the MoE whole_sequence
    ("gpt_moe", "zero2", {"ep": 2, "tp": 2, "accumulate": 2, "clip_grad_norm": 0.5}, ()),
    ("titan_dsv3", "ddp", {"ep": 2, "tp": 2}, ()),  # world 2: under zero3
]
EXPORTED = WORLD2[1]  # gpt_moe, zero3 x ep=2: its save is exported by the CLI
BUILT = [("mixtral", "zero3", {"ep": 2}, "built"), ("mixtral", "ddp", {"ep": 2}, "built")]
# the layouts of 4 ranks on our GPT (its experts and each model's at world 2, in the hybrid and tp x ep cases here)
WORLD4 = [
    ("gpt_moe", "zero3", {"ep": 2}, (("zero3", {"ep": 2}), ("zero3", {"ep": 4}), ("ddp", {}))),
    ("gpt_moe", "ddp", {"ep": 2}, (("ddp", {"ep": 2}), ("zero3", {"ep": 4}))),
    ("gpt_moe", "zero3", {"ep": 4}, ()),
    ("qwen3_moe", "zero3", {"ep": 4}, ()),  # 8 experts, 2 a rank, under AdamW
    # 2 experts at ep=2 over 4 ranks: each rank's one expert sharded over its 2 ep_dp ranks on dimension 1
    ("mixtral2", "zero3", {"ep": 2}, (("zero3", {"ep": 2}), ("ddp", {}))),
]
# hybrid: 2 replicas x 2 stages, each stage's experts split over its 2 replicas; loads keep the 2 replicas
HYB, HYF = {"dp": 2, "ep": 2, "data": "ddp"}, {"dp": 2, "ep": 2, "data": "fsdp"}
HYI = {**HYB, "schedule": "interleaved-1f1b"}
# (data="ddp" on the first two models: in the loads of the first and by Qwen3-MoE and the interleaved GPT)
HYBRID = [
    ("mixtral", "hybrid", HYF, (("hybrid", HYF), ("hybrid", HYB))),
    ("gpt_moe", "hybrid", {**HYF, "clip_grad_norm": 0.5}, (("hybrid", {**HYF, "clip_grad_norm": 0.5}),)),
    # its first block is dense: stage 0 holds no experts
    ("qwen3_moe", "hybrid", HYB, (("hybrid", HYB), ("hybrid", {"dp": 2}))),
    ("gpt_moe4", "hybrid", HYI, (("hybrid", HYI),)),  # 4 stages, 2 a rank: each splits its own experts
]
STAGE0_EXPERTS = {"mixtral": 0.5, "gpt_moe": 0.5, "qwen3_moe": 0.0, "gpt_moe4": 0.5}  # the share in rank 0's stages


def key(case: tuple) -> str:
    return f"{case[0]}/{case[1]}{case[2]}"


@pytest.fixture(scope="module")
def ep2_dir(tmp_path_factory):
    """Where the world-2 job saves: case i in folder i."""
    return tmp_path_factory.mktemp("ep2")


@pytest.fixture(scope="module")
def world2(ep2_dir):
    from paratrain.testing import spawn

    return spawn(run_cases, 2, (WORLD2 + BUILT + BESIDE_CP + [ROUTER_LOSS_UNDER_CP], str(ep2_dir)), timeout_s=420)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    from paratrain.testing import spawn

    return spawn(run_cases, 4, (WORLD4 + HYBRID + BESIDE_TP, str(tmp_path_factory.mktemp("ep4"))), timeout_s=480)[0]


def check(result: dict, case: tuple, replicas: int, expected: dict[str, torch.Tensor], share: float = 1.0) -> None:
    """Equal to one process; the experts split as the layout says (``share``: of them in rank 0's pipeline stage);
    every load of the save equal to the run. ``replicas``: data-parallel ones (a cp group's ranks split a copy too)."""
    assert "error" not in result, result.get("error")
    state, model_name, strategy, options, loads = result["state"], *case
    # against the fp32 process, as status.md says
    tol = 3e-3 if options.get("precision") in ("bf16-mixed", "fp16-mixed") else TOL
    assert max(((state[k].double() - v.double()).abs().max().item() for k, v in expected.items())) <= tol
    assert state.keys() == expected.keys()  # the full state dict: plain names, the whole experts
    assert all(state[k].shape == v.shape for k, v in expected.items())
    whole = expert_elements(MODELS[model_name].build())
    sharded = replicas * options.get("cp", 1) if strategy.startswith("zero") else options["ep"]
    assert result["held"] * sharded == whole * share, "each rank holds its 1/ep of the experts (1/dp under zero)"
    for (s, o), diff in zip(loads, result["loads"].values(), strict=True):
        # a resume is bitwise under zero; DDP's buckets are rebuilt after its first step, so the first step after a
        # resume sums the non-expert gradients in another order than the uninterrupted run did (the zoo's bound)
        same = (s, o) == (strategy, options)
        bound = 0.0 if same and s.startswith("zero") else 1e-6 if same else TOL
        assert diff <= bound, f"loaded into {s}{o}: {diff}"


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", [c for c in WORLD2 if c[0] != "dense"], ids=key)  # accumulate: the same batch
def test_world2_equals_one_process(world2, case):
    check(world2[key(case)], case, 2, reference(case[0], 2, case[2].get("clip_grad_norm")))


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", WORLD4, ids=key)
def test_world4_equals_one_process(world4, case):
    check(world4[key(case)], case, 4, reference(case[0], 4))


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", BESIDE_CP, ids=key)
def test_ep_beside_cp_routes_each_ranks_slice_of_the_sequences(world2, case):
    """zero3/ddp x cp=2 x ep=2 at world 2: the cp pair is the expert group, each routing its half of every sequence;
    equal to one process on the one replica's batch, resumed bitwise, loaded without ep."""
    check(world2[key(case)], case, 1, reference(case[0], 1))


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_router_loss_inside_forward_under_cp_is_one_line(world2):
    error = world2[key(ROUTER_LOSS_UNDER_CP)]["error"]
    assert "cp cannot train MixtralForCausalLM with its router's load-balancing loss" in error
    assert "\n" not in error


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", BESIDE_TP, ids=key)
def test_ep_beside_tp_splits_attention_by_tp_and_experts_by_ep(world4, case):
    """tp=2 x ep=2 at world 4 (2 replicas): attention and dense layers split over tp, the experts whole to tp and split
    over each tp rank's group of replicas, each tp rank computing the experts of its half of the rows; equal to one
    process (accumulation, clipping), resumed, loaded without ep."""
    check(world4[key(case)], case, 2, reference(case[0], 2, case[2].get("clip_grad_norm")))


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_each_tp_rank_sends_its_share_of_the_rows_as_the_planner_counts(world4):
    """Rows a rank sends to its experts per call (counted in the job): under tp=2 x ep=2 half of what a rank of the
    same micro-batch sends under ep alone (our GPT), and what the planner's ``tokens_per_rank`` says (Mixtral)."""
    from dataclasses import replace

    from helpers.zoo import SEQ

    from paratrain.planner import transformer_stats
    from paratrain.planner.expert_parallel import tokens_per_rank
    from paratrain.planner.hf_config import config_from_dict

    alone = world4[key(WORLD4[0])]["sent"]
    shared = world4[key(BESIDE_TP[1])]["sent"]
    assert len(set(alone)) == 1 and shared == [alone[0] // 2] * len(alone)
    config = replace(config_from_dict(mixtral().config.to_dict(), "mixtral"), seq_len=SEQ)
    planned = tokens_per_rank(transformer_stats(config, name="mixtral"), PER_RANK, tp=2)
    sent = world4[key(BESIDE_TP[0])]["sent"]
    assert sent and all(n == planned for n in sent), (sent, planned)


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", HYBRID, ids=key)
def test_hybrid_stages_split_their_experts_over_their_replicas(world4, case):
    """Parallel("hybrid", dp=2, ep=2) at world 4: equal to one process on the 2 replicas' batch, resumed bitwise,
    loaded without ep and under the other data engine."""
    check(world4[key(case)], case, 2, reference(case[0], 2, case[2].get("clip_grad_norm")), STAGE0_EXPERTS[case[0]])


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("case", BUILT, ids=key)
def test_a_meta_build_and_load_weights_fill_the_expert_slices(world2, case):
    result = world2[f"{key(case)}/built"]
    assert "error" not in result, result.get("error")
    assert result == {"meta": 0.0, "weights": 0.0}


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_export_of_an_ep_save_is_the_plain_full_state_dict(world2, ep2_dir, tmp_path):
    """``paratrain export`` of the zero3 x ep=2 save: the whole experts under their plain names, equal to
    ``par.full_state_dict`` at the save, loadable by the plain model."""
    out = tmp_path / "gpt_moe.pt"
    done = run_cli("export", str(ep2_dir / str(WORLD2.index(EXPORTED))), str(out), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    exported, saved = torch.load(out, weights_only=True), world2[key(EXPORTED)]["saved"]
    assert list(exported) == list(saved)
    assert max_abs_diff(exported, saved) == 0.0
    MODELS["gpt_moe"].build().load_state_dict(exported)


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_compile_with_ep_compiles_the_blocks(world2):
    """The compile case above equals one process (test_world2_equals_one_process); here: it did compile."""
    assert world2["mixtral/zero3{'ep': 2, 'compile': True}"]["graphs"] > 0
    assert world2["mixtral/zero3{'ep': 2}"]["graphs"] == 0


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_dense_model_is_refused_inside_every_rank(world2):
    error = world2["dense/ddp{'ep': 2}"]["error"]
    assert "has no module with 3-D [experts, out, in] parameters" in error and "\n" not in error


def test_experts_are_found_with_their_expert_dimension():
    layers = find_experts(mixtral(), 2)
    assert [(layer.name, layer.experts, layer.split) for layer in layers] == [
        (f"model.layers.{i}.mlp.experts", 4, ("gate_up_proj", "down_proj")) for i in range(2)
    ]
    assert [(layer.name, layer.split) for layer in find_experts(gpt_moe(), 4)] == [
        (f"blocks.{i}.moe.experts", ("gate_up", "down")) for i in range(2)
    ]
    assert [(layer.name, layer.split) for layer in find_experts(MODELS["titan_dsv3"].build(), 2)] == [
        (f"layers.{i}.moe.routed", ("w1", "w2", "w3")) for i in (1, 2)
    ]


@pytest.mark.parametrize(
    ("build", "degree", "says"),
    [
        (dense, 2, "GPT has no module with 3-D .experts, out, in. parameters called with the router's choice"),
        (mixtral, 3, "ep=3 must divide the 4 experts of model.layers.0.mlp.experts"),
    ],
)
def test_models_that_cannot_split_are_one_line(build, degree, says):
    with pytest.raises(ConfigError, match=says) as err:
        find_experts(build(), degree)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("strategy", "world", "options", "says"),
    [
        ("ps", 2, {"ep": 2}, "does not take ep=2; expert parallelism runs inside ddp, zero2, zero3 and hybrid"),
        ("dp", 1, {"ep": 2}, "does not take ep=2"),
        ("single", 1, {"ep": 2}, "does not take ep=2"),
        ("model_parallel", 2, {"ep": 2}, "does not take ep=2"),
        ("pipeline", 2, {"ep": 2}, r"'pipeline' has one replica.*use Parallel\('hybrid', dp=2, ep=2\)"),
        ("hybrid", 4, {"dp": 2, "ep": 2, "data": "zero1"}, "hybrid with data='zero1' and ep is not supported"),
        ("hybrid", 8, {"dp": 2, "ep": 2, "tp": 2}, "hybrid with both tp and ep is not supported yet"),
        ("hybrid", 4, {"dp": 2, "ep": 4}, "ep=4 must divide the 2 data-parallel ranks"),
        ("zero1", 2, {"ep": 2}, "does not take ep=2"),
        ("hsdp", 4, {"ep": 2}, "does not take ep=2"),
        ("zero3", 8, {"ep": 2, "tp": 2, "cp": 2}, "ep beside both cp=2 and tp=2 is not supported yet"),
        ("zero3", 4, {"ep": 4, "tp": 2}, "ep=4 must divide the 2 data-parallel ranks"),
        ("ddp", 4, {"ep": 8, "cp": 2}, r"ep=8 must divide the 4 data-parallel ranks .*\(dp_replicate x cp\)"),
        ("zero3", 4, {"ep": 3}, "ep=3 must divide the 4 data-parallel ranks"),
        ("ddp", 2, {"ep": 4}, "ep=4 must divide the 2 data-parallel ranks"),
        ("zero3", 2, {"ep": 0}, "ep must be an integer >= 1"),
    ],
)
def test_layouts_that_cannot_hold_ep_are_one_line(strategy, world, options, says):
    with pytest.raises(ConfigError, match=says) as err:
        check_world(strategy, world, **options)
    assert "\n" not in str(err.value)


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_rank_killed_at_random_restarts_and_ends_bitwise_equal(tmp_path):
    """zero3 x ep=2 under ``paratrain run --max-restarts 1``: a rank SIGKILLed after a random step comes back from the
    latest save and the job ends with the uninterrupted run's parameters (the same job under ``spawn``), bit for
    bit."""
    from paratrain.testing import spawn

    step, rank = random.randint(1, 11), random.randint(0, 1)  # the job takes 12 steps (2 epochs of 6)
    script = str(SCRIPTS / "ep_restart_job.py")
    clean = spawn(restart_job, 2, (script,), timeout_s=150)[0]
    killed = run_cli(
        "run",
        "-n",
        "2",
        "--max-restarts",
        "1",
        "--checkpoint-dir",
        str(tmp_path),
        "--checkpoint-every",
        "4",
        script,
        str(step),
        str(rank),
        timeout=150,
    )
    why = f"killed rank {rank} after step {step}\n{killed.stderr[-3000:]}"
    assert killed.returncode == 0 and f"SIGKILL rank {rank} after step {step}" in killed.stderr, why
    found = re.search(r"final parameters sha256 ([0-9a-f]{64})", killed.stdout)
    assert found and found.group(1) == clean, why


def test_a_torch_that_cannot_unflatten_a_mesh_is_one_line(monkeypatch):
    from torch.distributed.device_mesh import DeviceMesh

    from paratrain.distributed.expert_parallel.part import ExpertParallel

    monkeypatch.delattr(DeviceMesh, "_unflatten")
    with pytest.raises(ConfigError, match=r"ep=2 needs torch 2.10 or later"):
        ExpertParallel(2)
