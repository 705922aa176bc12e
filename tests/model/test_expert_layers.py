"""Routed experts found by what they are (:mod:`paratrain.model.experts`): a module of any name whose 3-D parameters
share one expert dimension and whose forward takes the router's choice; each call's routing read from what it
carries (counts as a tensor of any dtype or a list, or each token's experts and weights), not from argument names."""

import pytest
import torch
from helpers.shapes import GroupedExperts
from helpers.zoo import SHAPES
from torch import nn

from paratrain.model.experts import find_expert_layers, has_experts, routing


class Banana(nn.Module):
    """A mixture of experts whose experts are named ``banana``, called with keywords in another order."""

    def __init__(self) -> None:
        super().__init__()
        self.banana = GroupedExperts(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.banana(num_tokens_per_expert=torch.tensor([1.0, 0, 2, 1]), x=x)


class OneArgument(nn.Module):
    """3-D weights of one first dimension, but nothing routed reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(4, 8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Uneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Parameter(torch.zeros(4, 2, 2)), nn.Parameter(torch.zeros(3, 2, 2))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        return x


def test_experts_are_found_under_any_name():
    assert [(x.name, x.experts, x.label) for x in find_expert_layers(SHAPES["titan_dsv3"].build())] == [
        ("layers.1.moe.routed", 4, "layer1"),
        ("layers.2.moe.routed", 4, "layer2"),
    ]
    assert [x.name for x in find_expert_layers(nn.Sequential(Banana()))] == ["0.banana"]


@pytest.mark.parametrize(
    "model",
    [
        nn.Sequential(nn.Conv1d(4, 8, 3), nn.ReLU()),  # a 3-D weight called with one argument
        OneArgument(),
        Uneven(),  # 3-D weights of two first dimensions: no expert dimension
        nn.Sequential(GroupedExperts(1, 8)),  # one expert: nothing to route
        SHAPES["titan_llama"].build(),
    ],
    ids=["conv1d", "one_argument", "uneven", "one_expert", "titan_llama"],
)
def test_modules_that_are_not_routed_experts_are_not_found(model):
    assert not has_experts(model)


def test_counts_of_any_dtype_or_a_list_are_read_as_they_come():
    rows = torch.zeros(4, 8)
    for counts in (torch.tensor([1.0, 0, 2, 1]), torch.tensor([1, 0, 2, 1], dtype=torch.int32), [1, 0, 2, 1]):
        found = routing((rows, counts), 4)
        assert found is not None and not found.top_k and found.rows is rows
        assert found.chosen is counts if isinstance(counts, torch.Tensor) else found.chosen == counts
    assert routing((rows, torch.tensor([1.0, 0, 3])), 4) is None  # 3 entries for 4 experts
    assert routing((rows, [1, 0, 2, 2]), 4) is None  # a list that does not sum to the rows
    assert routing((rows, torch.tensor([True, False, True, True])), 4) is None
    assert routing((rows,), 4) is None


def test_each_tokens_experts_and_weights_are_read_as_they_come():
    hidden, index, weights = torch.zeros(5, 8), torch.zeros(5, 2, dtype=torch.long), torch.zeros(5, 2)
    found = routing((hidden, index, weights), 4)
    assert found is not None and found.top_k and found.chosen is index and found.weights is weights
    assert routing((hidden, index), 4) is None  # no weights
    assert routing((hidden, index[:3], weights[:3]), 4) is None  # not one row a token


def test_a_call_by_keyword_is_read_in_the_forwards_order():
    model = Banana()
    (layer,) = find_expert_layers(model)
    seen = []
    layer.module.register_forward_pre_hook(lambda _m, a, k: seen.append(layer.routing(a, k)), with_kwargs=True)
    model(torch.randn(4, 32))
    assert seen[0] is not None and seen[0].chosen.dtype == torch.float32 and seen[0].rows.shape == (4, 32)
