"""Models built on the meta device: every strategy lays the model out first, then each rank materializes only what it
holds, initialized by the model's own init; the result equals the model built normally in one process, before and
after training (ties kept, rotary tables and position ids recomputed).

One launched job per world size runs every case (tests/helpers/meta_workers.py). Refusals run in this process.
"""

from __future__ import annotations

import pytest
import torch
from helpers.meta_workers import run_meta_cases
from helpers.zoo import ZOO
from helpers.zoo_workers import MICRO, TOL, reference
from torch import nn

import paratrain
from paratrain.model.materialize import Materializer
from paratrain.strategies.base import Runtime, Strategy
from paratrain.testing import max_abs_diff, spawn

MODELS = ("gpt2", "llama", "bert", "nanogpt")
SPLIT_MODELS = ("gpt2", "llama", "nanogpt")  # tensor parallelism and pipelines: the causal language models
# Every model under each way a layout holds parameters: replicated (ddp), sharded (zero3), placed whole
# (model_parallel), split (tp), cut into stages (pipeline). zero1 lays the model out as ddp does and zero2 as zero3
# does (only the optimizer and resharding differ): once each, on the tied GPT-2 and on Llama. hsdp is zero3's shards
# on a 2-D mesh, on GPT-2 and Llama; zero3 x tp=2 on Llama and nanoGPT's tied GPT (GPT-2's plan is its tp case's).
WORLD2 = [(m, s, {}) for m in MODELS for s in ("ddp", "zero3", "model_parallel")]
WORLD2 += [("gpt2", "zero1", {}), ("llama", "zero2", {})]
WORLD2 += [(m, "tp", {}) for m in SPLIT_MODELS] + [(m, "pipeline", {}) for m in SPLIT_MODELS]
WORLD2 += [("nanogpt", "zero3", {"min_params": 1}), ("gpt2", "zero3", {"min_params": 1})]
WORLD4 = [(m, "hsdp", {}) for m in ("gpt2", "llama")]
WORLD4 += [(m, "zero3", {"tp": 2}) for m in ("llama", "nanogpt")] + [("llama", "ddp", {"tp": 2})]
WORLD4 += [("llama", "hybrid", {"data": "fsdp"}), ("gpt2", "hybrid", {}), ("llama", "pipeline", {"tp": 2})]


@pytest.fixture(scope="module")
def world2():
    return spawn(run_meta_cases, 2, (WORLD2,), timeout_s=600)[0]


@pytest.fixture(scope="module")
def world4():
    return spawn(run_meta_cases, 4, (WORLD4,), timeout_s=600)[0]


def _check(result: dict, model_name: str, strategy: str) -> None:
    assert "error" not in result, result.get("error")
    if strategy not in ("pipeline", "hybrid"):  # a pipeline rank holds part of a tie; prepare checks it there
        assert not result["problems"], result["problems"]
    normal = ZOO[model_name].build()
    assert max_abs_diff(result["initial"], normal.state_dict()) == 0.0, "materialized != built normally"
    buffers = dict(normal.named_buffers())  # also those outside the state dict (Llama's rotary inv_freq)
    for name, value in result["buffers"].items():
        assert torch.equal(value, buffers[name]), name
    micro = MICRO if strategy in ("pipeline", "hybrid") else 1
    assert max_abs_diff(result["state"], reference(model_name, result["replicas"], microbatches=micro)) <= TOL


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy, options", WORLD2, ids=[f"{m}-{s}{o or ''}" for m, s, o in WORLD2])
def test_meta_world2_equals_normal_build(world2, model_name, strategy, options):
    _check(world2[f"{model_name}/{strategy}{options or ''}"], model_name, strategy)


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy, options", WORLD4, ids=[f"{m}-{s}{o or ''}" for m, s, o in WORLD4])
def test_meta_world4_equals_normal_build(world4, model_name, strategy, options):
    _check(world4[f"{model_name}/{strategy}{options or ''}"], model_name, strategy)


@pytest.mark.parametrize("model_name", MODELS)
def test_materialize_in_one_process_equals_normal_build(model_name):
    with torch.device("meta"):
        model = ZOO[model_name].build()
    Materializer.of(model, torch.device("cpu"))(model)
    after = torch.get_rng_state()
    normal = ZOO[model_name].build()
    assert max_abs_diff(model.state_dict(), normal.state_dict()) == 0.0
    assert torch.equal(torch.get_rng_state(), after), "the random stream ends where a normal build leaves it"


def test_init_fn_replaces_the_models_own_init():
    def init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.constant_(m.weight, 0.5)
            if m.bias is not None:
                nn.init.zeros_(m.bias)

    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    par = paratrain.Parallel("single", monitor=False, model=paratrain.ModelConfig(init_fn=init))
    prepared = par.prepare(model)
    assert torch.all(prepared[0].weight == 0.5) and torch.all(prepared[2].bias == 0)
    par.close()


class _Keeps(Strategy):
    name = "keeps"

    def uses_group(self, env):
        return False

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        return model


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))


def _refusal(model_fn, **options) -> str:
    with torch.device("meta"):
        model = model_fn()
    par = paratrain.Parallel(options.pop("strategy", "single"), monitor=False, **options)
    try:
        with pytest.raises(paratrain.ConfigError) as err:
            par.prepare(model)
    finally:
        par.close()
    assert "\n" not in str(err.value)
    return str(err.value)


def test_bad_input_is_one_line():
    assert "cannot materialize a model built on the meta device" in _refusal(lambda: nn.Linear(2, 2), strategy=_Keeps())
    leaves_meta = lambda m: setattr(m, "weight", nn.Parameter(torch.empty(2, 2, device="meta")))  # noqa: E731
    assert "left 'weight' on the meta device" in _refusal(lambda: nn.Linear(2, 2), init_fn=leaves_meta)
    assert "nothing initialized ['scale']" in _refusal(_NoReset)
    half = lambda m: nn.init.zeros_(m.weight[0]) if isinstance(m, nn.Linear) else None  # noqa: E731
    assert "initialized only part of 'weight'" in _refusal(lambda: nn.Linear(2, 2), init_fn=half)
    par = paratrain.Parallel("single", monitor=False, model=paratrain.ModelConfig(init_fn=lambda m: None))
    with pytest.raises(paratrain.ConfigError, match="already allocated"):
        par.prepare(nn.Linear(2, 2))
    par.close()
