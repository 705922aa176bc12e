"""strategy='auto' on a mixture of experts: the planner is let weigh expert parallelism, and the ep degree it picks
becomes the strategy's ``ep=`` option (the choice only: no process starts, the world comes from a ClusterEnv)."""

import pytest
import torch

from paratrain.env import ClusterEnv
from paratrain.model.experts import has_experts
from paratrain.planner.auto import AutoChoice
from paratrain.planner.hardware import make_cluster
from paratrain.planner.moe import MoE
from paratrain.strategies import auto
from paratrain.workloads.gpt import GPT, GPTConfig

MOE = GPTConfig(
    layers=4,
    hidden=256,
    heads=4,
    seq_len=64,
    vocab=1000,
    gated=True,
    bias=False,
    learned_positions=False,
    tied=False,
    moe=MoE(experts=8, top_k=2, ffn=1024),
)
DENSE = GPTConfig(
    layers=4, hidden=256, heads=4, seq_len=64, vocab=1000, gated=True, bias=False, learned_positions=False, tied=False
)
WORLD = ClusterEnv(rank=0, local_rank=0, world_size=8, local_world_size=8, launched=True)


def _choose(monkeypatch, model, memory_gib):
    """``choose_strategy`` on 8 GPUs of ``memory_gib``; what it asked ``create`` for, and its lines."""
    asked, build = {}, auto.create

    def create(name, **options):  # record the request; the strategy is built as asked
        asked.update(name=name, options=options)
        return build(name, **options)

    monkeypatch.setattr(auto, "local_cluster", lambda *a: make_cluster("h100", gpus=8, gpu_mem_gb=memory_gib))
    monkeypatch.setattr(auto, "create", create)
    monkeypatch.setattr(auto, "model_shape", lambda model: None)  # no tp: ep alone is weighed
    strategy, lines = auto.choose_strategy(model, WORLD, torch.device("cpu"), "fp32", lambda x: x)
    asked["built"] = strategy.describe()
    return asked, lines


def test_auto_asks_for_expert_parallelism_when_the_planner_picks_it(monkeypatch):
    """26M parameters, 97% of them experts, on GPUs where zero3 alone does not fit but 1/2 of the experts per rank
    does: the strategy is asked for ep=2 and the line the ranks print names it; with room to spare, no ep."""
    model = GPT(MOE).to("meta")
    assert has_experts(model)
    asked, lines = _choose(monkeypatch, model, 0.84)
    assert asked["options"] == {"ep": 2}, asked
    assert "ep=2" in asked.pop("built")  # what the ranks agree on names the split
    assert f"strategy 'auto' chose {asked['name']} with ep=2:" in lines[0], lines[0]
    assert "ep=2 gives each rank 1/2 of the experts" in lines[0]
    asked, lines = _choose(monkeypatch, model, 80)
    assert asked.pop("built") == "ddp(bucket_cap_mb=25)"
    assert asked == {"name": "ddp", "options": {}} and "ep=" not in lines[0]


def test_a_dense_model_is_never_given_expert_parallelism(monkeypatch):
    """The same shape without experts on memory where only sharding fits: no ep is weighed or asked for."""
    model = GPT(DENSE).to("meta")
    assert not has_experts(model)
    asked, lines = _choose(monkeypatch, model, 0.8)
    asked.pop("built")
    assert asked == {"name": "zero2", "options": {}} and "ep=" not in lines[0], lines[0]


@pytest.mark.parametrize(
    "tp, ep, options", [(1, 1, {}), (2, 1, {"tp": 2}), (1, 4, {"ep": 4}), (2, 2, {"tp": 2, "ep": 2})]
)
def test_strategy_options_carry_the_chosen_degrees(tp, ep, options):
    assert auto.strategy_options(AutoChoice(strategy="zero3", reason="", tp=tp, ep=ep)) == options
