"""``Parallel(compile=True)``: each block compiled in place before sharding; the same training math as eager, the
user's parameter names kept, under zero3 and ddp (one process); under a pipeline in
tests/distributed/test_pipeline_models.py. Small cases: compiling costs seconds on 2 cores."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

import paratrain
from paratrain import ConfigError
from paratrain.testing import max_abs_diff
from paratrain.workloads.gpt import GPT, GPTConfig


def _train(strategy: str, compile: bool = False) -> dict[str, torch.Tensor]:
    model_config = paratrain.ModelConfig(activation_checkpointing=True, compile=compile)
    par = paratrain.Parallel(strategy, monitor=False, model=model_config)
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=32))
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(2):
        ids = torch.randint(0, 32, (4, 9), generator=g)
        with par.step(model, opt):
            par.forward_backward(
                model, ids[:, :-1], ids[:, 1:], lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
            )
    if compile:
        assert all(getattr(b, "_compiled_call_impl", None) is not None for b in par.unwrap(model).blocks)
    state = par.full_state_dict(model, rank0_only=False)
    par.close()
    return state


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["zero3", "ddp"])
def test_compiled_blocks_equal_eager(strategy):
    import torch._inductor.config

    eager = _train(strategy)
    with torch._inductor.config.patch(compile_threads=1):  # no worker pool outliving the test
        compiled = _train(strategy, compile=True)
    assert compiled.keys() == eager.keys()
    assert max_abs_diff(compiled, eager) <= 1e-5


def test_bad_compile_value():
    try:
        paratrain.Parallel("single", model=paratrain.ModelConfig(compile="max"))
    except ConfigError as err:
        assert "compile must be" in str(err)
    else:
        raise AssertionError("compile='max' was accepted")
