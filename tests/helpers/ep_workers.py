"""What the expert-parallel suite's launched jobs run (``tests/distributed/test_expert_parallel.py``), and their
one-process references: tiny transformers Mixtral, Qwen3-MoE, GPT-OSS (expert biases), OLMoE and Qwen2-MoE (a
shared expert), our GPT with experts and a DeepSeek-V3 shape as torchtitan writes it (experts named ``routed``,
given float counts), trained a few steps under ``Parallel(strategy, ep=E)``, saved, resumed, and
loaded at another ``ep``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import runpy
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn

import paratrain
from helpers.cases import each_case
from helpers.zoo import SHAPES, ZooModel, _lm_loss, _quiet_transformers, _sgd, _tokens
from paratrain.model.experts import find_expert_layers
from paratrain.testing import max_abs_diff

STEPS, PER_RANK = 3, 4
TOL = 2e-5  # the zoo's: the same gradients summed in another order


def mixtral(router_loss: bool = False, experts: int = 4) -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=32,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=65,
            num_local_experts=experts,
            num_experts_per_tok=2,
            max_position_embeddings=16,
            output_router_logits=router_loss,
        )
    )


def qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=8,
            vocab_size=65,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[0],
            max_position_embeddings=16,
        )
    )


def gpt_oss() -> nn.Module:
    from transformers import GptOssConfig, GptOssForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    return GptOssForCausalLM(
        GptOssConfig(
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=65,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=16,
            layer_types=["full_attention"] * 2,
        )
    )


def olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    return OlmoeForCausalLM(
        OlmoeConfig(
            hidden_size=32,
            intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=65,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=16,
        )
    )


def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    return Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            hidden_size=32,
            intermediate_size=64,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            vocab_size=65,
            num_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=16,
        )
    )


def gpt_moe(layers: int = 2) -> nn.Module:
    from paratrain.planner.moe import MoE
    from paratrain.planner.transformer import GPTConfig
    from paratrain.workloads.gpt import GPT

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            layers=layers,
            hidden=32,
            heads=2,
            seq_len=8,
            vocab=65,
            gated=True,
            bias=False,
            tied=False,
            learned_positions=False,
            moe=MoE(experts=4, top_k=2, ffn=16, shared=16),
        )
    )


def _adamw(model: nn.Module, **path: bool) -> torch.optim.Optimizer:
    """AdamW on CUDA's default multi-tensor path (``foreach``), or on ``path`` (``fused=True``)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-2, **(path or {"foreach": True}))


def _fused(model: nn.Module) -> torch.optim.Optimizer:
    return _adamw(model, fused=True)


@contextlib.contextmanager
def cpu_fp16() -> Iterator[None]:
    """``precision="fp16-mixed"`` on CPU: its grad scaler on the CPU (paratrain needs CUDA for fp16, for speed)."""
    from paratrain.precision import FP16Mixed, ScalerByLayout

    with mock.patch.object(
        FP16Mixed, "validate", lambda self, device: setattr(self, "scaler", ScalerByLayout(device.type))
    ):
        yield


MODELS = {
    m.name: m
    for m in (
        ZooModel("mixtral", mixtral, _tokens, _lm_loss, _sgd),
        ZooModel("mixtral_aux", lambda: mixtral(router_loss=True), _tokens, _lm_loss, _sgd),
        ZooModel("mixtral2", lambda: mixtral(experts=2), _tokens, _lm_loss, _sgd),  # 1 expert a rank at ep=2
        ZooModel("qwen3_moe", qwen3_moe, _tokens, _lm_loss, _adamw),
        ZooModel("mixtral_adamw", mixtral, _tokens, _lm_loss, _adamw),  # foreach: experts DTensors beside plain tensors
        ZooModel("mixtral_fused", mixtral, _tokens, _lm_loss, _fused),
        ZooModel("gpt_moe", gpt_moe, _tokens, _lm_loss, _sgd),
        ZooModel("gpt_moe4", lambda: gpt_moe(4), _tokens, _lm_loss, _sgd),  # 4 blocks: 2 pipeline stages a rank
        ZooModel("gpt_oss", gpt_oss, _tokens, _lm_loss, _sgd),
        ZooModel("olmoe", olmoe, _tokens, _lm_loss, _sgd),
        ZooModel("qwen2_moe", qwen2_moe, _tokens, _lm_loss, _sgd),
        SHAPES["titan_dsv3"],
    )
}


def dense() -> nn.Module:
    from paratrain.planner.transformer import GPTConfig
    from paratrain.workloads.gpt import GPT

    torch.manual_seed(0)
    return GPT(GPTConfig(layers=1, hidden=32, heads=2, seq_len=8, vocab=65))


MODELS["dense"] = ZooModel("dense", dense, _tokens, _lm_loss, _sgd)


def _train(par: paratrain.Parallel, spec: ZooModel, model, opt, steps: range) -> None:
    size, rank = par.data_parallel_size, par.data_parallel_rank
    for s in steps:
        x, y = spec.inputs(size * PER_RANK, torch.Generator().manual_seed(100 + s))
        x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        for xm, ym in zip(x.chunk(par.accumulate), y.chunk(par.accumulate), strict=True):  # the slice's micro-batches
            with par.step(model, opt):
                par.forward_backward(model, xm.to(par.device), ym.to(par.device), spec.loss)


def _prepared(spec: ZooModel, strategy: str, options: dict):
    with cpu_fp16() if options.get("precision") == "fp16-mixed" else contextlib.nullcontext():
        par = paratrain.Parallel(strategy, monitor=False, **options)
    model = spec.build()
    model, opt = par.prepare(model, spec.optimizer(model))
    return par, model, opt


def expert_elements(model: nn.Module) -> int:
    """Elements of the routed experts' parameters this rank holds (a DTensor's local part)."""
    return sum(
        p.to_local().numel() if hasattr(p, "to_local") else p.numel()
        for layer in find_expert_layers(model)
        for p in layer.module.parameters()
    )


@contextlib.contextmanager
def counted_rows() -> Iterator[list[int]]:
    """Within it, the rows each call of an experts module on this rank sends to its experts (those it computes the
    experts of: its tp share), one entry a call."""
    from paratrain.distributed.expert_parallel import experts

    sent: list[int] = []

    def exchange(rows: torch.Tensor, counts: torch.Tensor, *rest: object) -> torch.Tensor:
        sent.append(len(rows))
        return original(rows, counts, *rest)

    original = experts.exchange
    with mock.patch.object(experts, "exchange", exchange):
        yield sent


def run_case(model_name: str, strategy: str, options: dict, folder: str, loads: tuple) -> dict:
    """Train 2 steps, save (and the full state dict saved; graphs compiled by then), train step 3: the final state.
    Then for each layout (strategy, options) of ``loads``: a new ``Parallel`` of that layout loads the save and
    trains step 3 again; its difference from the final state (the same layout: a resume; another ``ep``: a
    reshard)."""
    spec = MODELS[model_name]
    graphs = _graphs()
    par, model, opt = _prepared(spec, strategy, options)
    held = expert_elements(par.unwrap(model))
    with counted_rows() as sent:
        _train(par, spec, model, opt, range(STEPS - 1))
    graphs = _graphs() - graphs
    par.save(folder)
    saved = par.full_state_dict(model, rank0_only=False)  # what `paratrain export` of the save must give
    _train(par, spec, model, opt, range(STEPS - 1, STEPS))
    final = par.full_state_dict(model, rank0_only=False)
    par.close()
    out = {"state": final, "saved": saved, "held": held, "graphs": graphs, "sent": sent, "loads": {}}
    for s, o in loads:
        par, model, opt = _prepared(spec, s, o)
        par.load(folder)
        _train(par, spec, model, opt, range(STEPS - 1, STEPS))
        out["loads"][f"{s}{o}"] = max_abs_diff(final, par.full_state_dict(model, rank0_only=False))
        par.close()
    return out


def _graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def built_case(model_name: str, strategy: str, options: dict, folder: str) -> dict:
    """The model built on the meta device and prepared (each rank materializes its slice of the experts), and built
    there again with ``init_fn="empty"`` and its weights read with ``par.load_weights`` from a plain state dict:
    each full state dict's difference from the plain build."""
    spec, plain = MODELS[model_name], MODELS[model_name].build().state_dict()
    out = {}
    for label, init in (("meta", None), ("weights", "empty")):
        par = paratrain.Parallel(strategy, monitor=False, model=paratrain.ModelConfig(init_fn=init), **options)
        with torch.device("meta"):
            model = spec.build()
        model, _ = par.prepare(model, spec.optimizer(model))
        if init == "empty":
            path = os.path.join(folder, "plain.pt")
            if par.rank == 0:
                os.makedirs(folder, exist_ok=True)
                torch.save(plain, path)
            par.barrier()
            par.load_weights(model, path)
        out[label] = max_abs_diff(plain, par.full_state_dict(model, rank0_only=False))
        par.close()
    return out


def run_cases(cases: list[tuple], tmp: str) -> dict[str, dict]:
    """Every case (model, strategy, options, loads) in order, on one process group; loads ``"built"``: the case is
    :func:`built_case`'s."""

    def run(i: int, c: tuple) -> dict:
        folder = os.path.join(tmp, str(i))
        return built_case(*c[:3], folder) if c[3] == "built" else run_case(*c[:3], folder, c[3])

    return each_case(cases, run, key=lambda c: f"{c[0]}/{c[1]}{c[2]}{'/built' if c[3] == 'built' else ''}")


@functools.cache
def reference(model_name: str, replicas: int, clip: float | None = None) -> dict[str, torch.Tensor]:
    """One process, ``STEPS`` steps on global batches of ``replicas x PER_RANK``, one forward per replica's slice;
    the gradient's norm clipped to ``clip``. Computed once per arguments in a test process (many cases compare with
    the same one): read it, never change it."""
    spec = MODELS[model_name]
    model = spec.build()
    opt = spec.optimizer(model)
    for s in range(STEPS):
        x, y = spec.inputs(replicas * PER_RANK, torch.Generator().manual_seed(100 + s))
        for r in range(replicas):
            sl = slice(r * PER_RANK, (r + 1) * PER_RANK)
            (spec.loss(model(x[sl]), y[sl]) / replicas).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def restart_job(script: str) -> str:
    """The restart test's job (tests/scripts/ep_restart_job.py) whole, with no fault, as this job's ranks: its final
    parameters' digest on rank 0 (the uninterrupted run, without starting a launcher and importing torch anew)."""
    return runpy.run_path(script)["main"](None, None)
