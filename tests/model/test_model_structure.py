"""What a model is made of (paratrain.model): blocks, ties, sharding units, and the audit of prepare()."""

from __future__ import annotations

import pytest
import torch
from helpers.zoo import ZOO
from torch import nn

from paratrain import ConfigError
from paratrain.model import find_blocks, find_ties, outer_modules
from paratrain.model.facts import ModelFacts
from paratrain.model.units import shard_units


@pytest.mark.parametrize(
    "name, container, cls",
    [
        ("gpt2", "transformer.h", "GPT2Block"),
        ("llama", "model.layers", "LlamaDecoderLayer"),
        ("bert", "bert.encoder.layer", "BertLayer"),
        ("lora", "base_model.model.transformer.h", "GPT2Block"),
        ("nanogpt", "blocks", "Block"),
        ("cnn", None, None),
        ("frozen", None, None),
    ],
)
def test_blocks_of_the_zoo(name, container, cls):
    blocks = find_blocks(ZOO[name].build())
    if container is None:
        assert blocks is None  # a stack of plain layers has no blocks
    else:
        assert (blocks.container, blocks.cls.__name__, len(blocks.names)) == (container, cls, 2)


def test_modules_around_the_blocks():
    model = ZOO["llama"].build()
    before, after = outer_modules(model, find_blocks(model))
    assert before == ["model.embed_tokens"] and set(after) == {"lm_head", "model.norm", "model.rotary_emb"}


def test_ties():
    assert find_ties(ZOO["gpt2"].build()).groups == (("transformer.wte.weight", "lm_head.weight"),)
    assert not find_ties(ZOO["llama"].build())
    ties = find_ties(ZOO["nanogpt"].build())
    assert ties.partner("head.weight") == "wte.weight" and ties.owners() == [["wte", "head"]]


def _unit_names(model: nn.Module, **kwargs) -> list[list[str]]:
    names = {id(m): n for n, m in model.named_modules()}
    return [[names[id(m)] for m in unit] for unit in shard_units(model, **kwargs)]


def test_units_are_blocks_plus_one_group_for_a_tied_embedding_and_head():
    units = _unit_names(ZOO["gpt2"].build(), min_params=1000)
    assert units == [["transformer.h.0"], ["transformer.h.1"], ["transformer.wte", "lm_head"]]


def test_untied_embedding_and_head_are_units_of_their_own_by_size():
    units = _unit_names(ZOO["llama"].build(), min_params=1000)
    assert units == [["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["lm_head"]]


def test_a_peft_model_never_gets_a_bare_container_as_a_unit():
    units = _unit_names(ZOO["lora"].build(), min_params=1)
    assert ["base_model.model.transformer.h.0"] in units
    model = ZOO["lora"].build()
    assert not any(isinstance(model.get_submodule(u[0]), (nn.ModuleList, nn.ModuleDict)) for u in units)


def test_without_blocks_units_go_by_size_and_user_classes_win():
    mlp = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10))
    assert _unit_names(mlp, min_params=5000) == [["0"]]
    assert _unit_names(ZOO["nanogpt"].build(), wrap_classes=[nn.LayerNorm], min_params=10**9)[0] == ["blocks.0.norm1"]


def test_audit_refuses_an_optimizer_of_another_model():
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="2 of 2 parameters that are not in the model"):
        ModelFacts.of(model).check_source(torch.optim.SGD(other.parameters(), lr=0.1))


def test_audit_names_a_split_tie_and_a_parameter_the_optimizer_lost():
    model = ZOO["nanogpt"].build()
    record = ModelFacts.of(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    record.check_ties(model, "zero3")
    record.check_kept(opt, opt, model, "zero3")
    model.head.weight = nn.Parameter(model.head.weight.detach().clone())  # what FSDP2 on torch 2.11 did
    with pytest.raises(ConfigError, match="split the tied parameters 'wte.weight' and 'head.weight'"):
        record.check_ties(model, "zero3")
    rebuilt = torch.optim.SGD([p for n, p in model.named_parameters() if n != "head.weight"], lr=0.1)
    with pytest.raises(ConfigError, match="no longer trains 'head.weight' \\(tied to 'wte.weight'\\)"):
        record.check_kept(opt, rebuilt, model, "zero3")


def test_model_parallel_opens_a_transformers_model_to_its_blocks_and_keeps_ties_on_one_stage():
    from paratrain.model.cuts import layers, placement

    model = ZOO["gpt2"].build()
    names = [n for n, _ in layers(model)]
    assert names == [
        "transformer.wte",
        "transformer.wpe",
        "transformer.drop",
        "transformer.h.0",
        "transformer.h.1",
        "transformer.ln_f",
        "lm_head",
    ]
    stages = dict(zip(names, placement(model, [4])))
    assert stages["transformer.h.0"] == 0 and stages["transformer.h.1"] == 1
    assert stages["transformer.wte"] == stages["lm_head"] == 1  # one tensor, one device: the head's stage


def test_a_tied_module_of_a_user_class_is_sharded_only_with_its_partner():
    units = _unit_names(ZOO["nanogpt"].build(), wrap_classes=[nn.Linear, nn.Embedding], min_params=10**9)
    assert units[-1] == ["wte", "head"] and sum(u.count("head") for u in units) == 1


class _Pair(nn.Module):
    """Blocks as plain attributes, beside a norm of another class."""

    def __init__(self) -> None:
        super().__init__()
        self.block0 = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.block1 = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        self.norm = nn.LayerNorm(4)


@pytest.mark.parametrize(
    "name, container, count",
    [("titan_llama", "layers", 2), ("titan_qwen3", "layers", 2), ("titan_dsv3", "layers", 3)],
)
def test_blocks_in_a_module_dict_and_of_several_shapes(name, container, count):
    """torchtitan's layout: blocks keyed "0", "1", … in a ModuleDict; DeepSeek-V3's dense first block and its
    mixture-of-experts blocks are one class of two shapes, all blocks."""
    from helpers.zoo import SHAPES

    model = SHAPES[name].build()
    blocks = find_blocks(model)
    assert (blocks.container, blocks.names) == (container, tuple(f"layers.{i}" for i in range(count)))
    assert _unit_names(model) == [[n] for n in blocks.names] + (
        [["tok_embeddings", "output"]] if "qwen3" in name else []
    )


def test_blocks_as_plain_attributes():
    blocks = find_blocks(_Pair())
    assert (blocks.container, blocks.names) == ("", ("block0", "block1"))


def test_module_dict_blocks_are_cut_checkpointed_and_compiled_one_by_one():
    from helpers.zoo import SHAPES

    from paratrain.model.cuts import layers
    from paratrain.model.transforms import transform_blocks
    from paratrain.options import BlockTransforms

    model = SHAPES["titan_llama"].build()
    assert [n for n, _ in layers(model)] == ["tok_embeddings", "layers.0", "layers.1", "norm", "output"]
    compiled = transform_blocks(model, ModelFacts.of(model), BlockTransforms.of(True, True))
    assert compiled == ["layers.0", "layers.1"]
    assert all("forward" in vars(b) and b._compiled_call_impl is not None for b in model.layers.values())
