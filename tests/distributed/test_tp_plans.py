"""Tensor-parallel plans as users meet them, in one process: the vocabulary embedding found by what it is, the plan
``paratrain tp-plan`` prints valid ``tp_plan=`` input as printed, and a user plan may name any subset. Training with
these plans, equal to one process, is in tests/test_real_code.py."""

from __future__ import annotations

import ast
import sys

import pytest
from helpers.paths import ROOT
from helpers.zoo import ZOO
from torch.distributed.tensor.parallel import ParallelStyle

from paratrain.distributed.tensor_parallel.infer import choose_plan
from paratrain.distributed.tensor_parallel.names import STYLES, spec_of, style
from paratrain.distributed.tensor_parallel.plans import gpt2_plan, llama_plan, plan_for
from paratrain.distributed.tensor_parallel.styles import Rowwise, VocabHead
from paratrain.errors import ConfigError
from paratrain.plan_commands.tp_plan import tp_plan_lines
from paratrain.planner.inputs import InputSpec, TrainingCall
from paratrain.planner.model_stats import RunnableModel

sys.path.insert(0, str(ROOT / "tests" / "realcode"))
from nanogpt_model import GPT, GPTConfig  # noqa: E402


def char_level() -> GPT:
    """nanoGPT's shakespeare_char shape: the position table (64 rows) larger than the vocabulary (48)."""
    return GPT(GPTConfig(block_size=64, vocab_size=48))


def printed_plan(build, degree: int = 2, infer: bool = True) -> dict:
    call = TrainingCall(input=InputSpec.parse("long:8"))
    lines = tp_plan_lines(RunnableModel(name="m", factory=build, call=call), degree, infer)
    code = "\n".join(line for line in lines if not line.startswith("#"))
    return ast.literal_eval(code.split("=", 1)[1].strip())


def test_the_vocabulary_embedding_is_the_one_fed_token_ids_and_tied_to_the_head():
    plan = choose_plan(char_level(), "auto", 2)
    assert plan.styles["transformer.wte"].spec == "rowwise"
    assert "transformer.wpe" not in plan.styles
    assert isinstance(plan.styles["lm_head"], VocabHead)
    assert list(plan.styles)[-1] == "lm_head"  # after the blocks, as the model runs it


def test_an_untied_vocabulary_is_found_by_the_ids_it_reads():
    model = ZOO["llama"].build()
    model.config.max_position_embeddings = 512  # no bearing on which table holds the vocabulary
    plan = choose_plan(model, "auto", 2)
    assert "model.embed_tokens" in plan.styles and "lm_head" in plan.styles


@pytest.mark.parametrize(
    "build", [char_level, ZOO["gpt2"].build, ZOO["llama"].build], ids=["nanogpt-char", "gpt2", "llama"]
)
@pytest.mark.parametrize("infer", [True, False], ids=["auto", "built-in"])
def test_the_printed_plan_is_valid_input_as_printed(build, infer):
    printed = printed_plan(build, infer=infer)
    assert printed and all(isinstance(v, str) for v in printed.values())
    again = plan_for(build(), printed)
    resolved = dict(again.per_module(build()))
    for made in resolved.values():
        assert isinstance(made, ParallelStyle)
    heads = [n for n, s in resolved.items() if isinstance(s, VocabHead)]
    assert heads and heads[-1].endswith("lm_head")


def test_built_in_plans_print_every_style_by_name():
    for plan in (gpt2_plan(), llama_plan(), ZOO["nanogpt"].build().paratrain_tp_plan()):
        for pattern, spec in plan.printed().items():
            assert spec.split("(")[0] in STYLES or spec == "colwise", (pattern, spec)


def test_style_names_parse_with_their_arguments():
    assert spec_of(style("rowwise(output=sequence)")) == "rowwise(output=sequence)"
    assert style("fused_colwise(3)").parts == 3
    assert style("replicate(output_shard=0)").output_shard == 0
    assert isinstance(style("rowwise"), Rowwise)
    with pytest.raises(ConfigError, match="is not a style"):
        style("columnwise")
    with pytest.raises(ConfigError, match="only layout a plan names is 'sequence'"):
        style("colwise(input=shard)")


def test_colwise_after_the_blocks_is_the_vocabulary_head():
    plan = plan_for(
        char_level(),
        {
            "transformer.h.*.mlp.c_fc": "colwise",
            "transformer.h.*.mlp.c_proj": "rowwise",
            "lm_head": "colwise",
            "transformer.wte": "rowwise",
        },
    )
    resolved = dict(plan.per_module(char_level()))
    assert isinstance(resolved["lm_head"], VocabHead)
    assert not isinstance(resolved["transformer.h.0.mlp.c_fc"], VocabHead)
