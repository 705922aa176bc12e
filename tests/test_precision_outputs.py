"""Lean mixed precision: forward_backward hands the loss the output in the compute dtype, under autocast, so no
fp32 copy of the whole output is made (pipelines too: their last stage); a direct call of the model still returns
fp32."""

from __future__ import annotations

import pytest
import torch
from helpers.zoo import ZOO
from torch.nn import functional as F

import paratrain
from paratrain.batch import ModelCall

# bf16: the pipeline computes each micro-batch apart (4 of them) where one process takes the batch at once; the
# sums of bf16 products round differently. Observed after 3 steps: 5.6e-4 (our GPT), 3.7e-5 (an nn.Sequential).
BF16_BOUND = 2e-3


@pytest.mark.parametrize("strategy", ["single", "zero3"])
def test_loss_sees_the_compute_dtype_and_a_direct_call_gets_fp32(strategy):
    spec = ZOO["nanogpt"]
    x, y = spec.inputs(4, torch.Generator().manual_seed(0))
    par = paratrain.Parallel(strategy, precision="bf16-mixed", monitor=False)
    model = spec.build()
    model, opt = par.prepare(model, spec.optimizer(model))
    seen = []

    def loss_fn(out, target):
        seen.append((out.dtype, torch.is_autocast_enabled("cpu")))
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    with torch.no_grad():  # the same weights, the loss computed both ways
        upcast = loss_fn(model(x), y)
        lean = par.precision.loss(model, ModelCall.of(x, y, loss_fn, {}), par.device)
    assert seen == [(torch.float32, False), (torch.bfloat16, True)]
    assert float(lean) == pytest.approx(float(upcast), rel=1e-2)
    with par.step(model, opt):
        par.forward_backward(model, x, y, loss_fn)
    assert seen[-1] == (torch.bfloat16, True)
    par.close()


def test_fp32_is_untouched():
    spec = ZOO["gpt2"]
    x, y = spec.inputs(4, torch.Generator().manual_seed(0))
    par = paratrain.Parallel("single", monitor=False)
    model = spec.build()
    model, opt = par.prepare(model, spec.optimizer(model))
    seen = []
    with par.step(model, opt):
        par.forward_backward(model, x, y, lambda out, t: (seen.append(out.logits.dtype), spec.loss(out, t))[1])
    assert seen == [torch.float32]


FAMILIES = ["gpt", "seq"]


@pytest.fixture(scope="module")
def lean() -> dict[str, list[dict]]:
    """Every family under bf16-mixed: pipelined over 2 ranks, and in one process; one launch each."""
    from helpers.cases import each_call
    from helpers.pipeline_model_workers import lean_precision

    from paratrain.testing import spawn

    return {
        strategy: spawn(each_call, world, ([(f, lean_precision, (f, strategy), {}) for f in FAMILIES],), timeout_s=120)
        for strategy, world in (("pipeline", 2), ("single", 1))
    }


@pytest.mark.launched
@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_stages_hand_on_the_compute_dtype_and_equal_one_process(lean, family):
    """The last stage's loss sees bf16 logits under autocast, and the stages pass on what their layers computed (a
    Linear's bf16 output stays bf16, as in one process): the result equals one process under bf16-mixed."""
    from paratrain.testing import max_abs_diff

    ranks = [results[family] for results in lean["pipeline"]]
    one = lean["single"][0][family]
    last = ranks[1]
    assert last["seen"] == [(torch.bfloat16, True)] == one["seen"]
    assert ranks[0]["seen"] == []  # the first stage computes no loss
    assert max_abs_diff(last["state"], one["state"]) <= BF16_BOUND
