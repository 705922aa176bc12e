"""The plans tensor parallelism gives mixtures of experts, read without starting a process: the MoE blocks left whole,
what inside split attention sees only a rank's heads (Qwen3-MoE's query/key norms, GPT-OSS's sinks), our GPT's
MoE blocks on the gathered sequence. That they train as one process does: tests/strategies/test_zoo_moe.py."""

from __future__ import annotations

import pytest
from helpers import moe_models

from paratrain.distributed.tensor_parallel.infer import infer_plan
from paratrain.distributed.tensor_parallel.names import spec_of, style
from paratrain.distributed.tensor_parallel.plans import plan_for
from paratrain.errors import ConfigError


def _printed(build) -> dict[str, str]:
    model = build()
    return (plan_for(model, None) if hasattr(model, "paratrain_tp_plan") else infer_plan(model, 2)).printed()


@pytest.mark.parametrize(
    "build",
    [
        moe_models.tiny_mixtral,
        moe_models.tiny_olmoe,
        moe_models.tiny_qwen2_moe,
        moe_models.tiny_qwen3_moe,
        moe_models.tiny_gpt_oss,
    ],
)
def test_no_router_or_routed_expert_is_split(build):
    plan = _printed(build)
    assert not [p for p in plan if ".gate" in p.replace(".gate_proj", "") or "experts" in p], plan


def test_per_head_norms_sum_their_gradients_and_sinks_split_with_the_heads():
    qwen3 = _printed(moe_models.tiny_qwen3_moe)
    assert qwen3["model.layers.*.self_attn.q_norm"] == qwen3["model.layers.*.self_attn.k_norm"] == "replicate(grad=sum)"
    assert _printed(moe_models.tiny_gpt_oss)["model.layers.*.self_attn"] == "heads"


def test_our_gpt_runs_its_experts_on_the_whole_sequence():
    plan = _printed(moe_models.tiny_gpt_experts)
    assert plan["blocks.*.moe"] == "whole_sequence" and "blocks.*.fc" not in plan


def test_a_gradient_other_than_a_sum_is_one_line():
    assert spec_of(style("replicate(grad=sum)")) == "replicate(grad=sum)"
    with pytest.raises(ConfigError, match="only gradient a plan names is 'sum'") as err:
        style("replicate(grad=mean)")
    assert "\n" not in str(err.value)
