"""The monitor on mixtures of experts: tokens per expert over the global batch, the imbalance, the collapse warning;
nothing at all on a dense model. Unit tests on made-up routing and one process; one 2-rank gloo job for the rest."""

import pytest
import torch
from helpers.moe_models import routed_mixtral
from helpers.routing_workers import BATCH, SEQ, gpt_experts, routing_job, train
from helpers.zoo import SHAPES
from torch import nn

from paratrain.errors import ConfigError
from paratrain.model.experts import dispatched_bytes, find_expert_layers, has_experts, routing
from paratrain.monitor import MonitorConfig, RunSummary
from paratrain.monitor.experts import (
    ExpertCounter,
    ExpertLoad,
    expert_figures,
    find_routing_collapse,
)
from paratrain.testing import spawn

CFG = MonitorConfig()


def _load(*counts, layer="model.layers.3.mlp.experts"):
    return ExpertLoad(layer, "layer3", tuple(counts))


# ----------------------------------------------------------------- made-up routing
def test_imbalance_is_the_busiest_expert_over_the_mean():
    assert _load(25, 25, 25, 25).imbalance == 1.0
    assert _load(50, 30, 10, 10).imbalance == pytest.approx(2.0)
    assert _load(50, 50, 0, 0).idle == (2, 3) and _load(0, 0, 0, 0).idle == ()


def test_balanced_routing_is_not_news():
    assert find_routing_collapse([_load(30, 22, 27, 21), _load(25, 25, 25, 25, layer="x.0.experts")], CFG) == []


def test_a_collapse_names_the_worst_layer_the_numbers_and_the_fix():
    found = find_routing_collapse(
        [
            _load(30, 22, 27, 21, layer="model.layers.0.mlp.experts"),
            _load(70, 10, 20, 0),
            _load(45, 30, 25, 0, layer="model.layers.5.mlp.experts"),
        ],
        CFG,
    )
    assert [(f.kind, f.rank) for f in found] == [("routing", -1)]
    message = found[0].message
    assert message.startswith(
        "routing collapsed in MoE layer model.layers.3.mlp.experts and 1 more: expert 0 gets "
        "70% of its routed tokens, 2.8x the mean of its 4 experts (2x warns), 1 of its 4 "
        "experts got no token (expert 3); "
    ), message
    assert "router_aux_loss_coef" in message and "z-loss" in message and "learning rate" in message
    assert "\n" not in message


def test_the_threshold_is_a_setting_and_a_bad_one_is_one_line():
    assert find_routing_collapse([_load(40, 20, 20, 20)], MonitorConfig(expert_imbalance=1.5))
    assert not find_routing_collapse([_load(40, 20, 20, 20)], CFG)
    for bad in (1.0, 0.5, True, "2"):
        with pytest.raises(ConfigError, match="expert_imbalance is the busiest expert's tokens over the mean"):
            MonitorConfig(expert_imbalance=bad)


def test_trackers_get_each_layers_imbalance_and_idle_experts():
    assert expert_figures([_load(50, 30, 10, 10), _load(0, 0, 0, 0, layer="x")]) == {
        "moe/imbalance/layer3": pytest.approx(2.0),
        "moe/idle_experts/layer3": 0.0,
    }


def test_the_table_shows_every_layer_and_to_dict_its_counts():
    summary = RunSummary(rows=[], experts=[_load(50, 30, 10, 10), _load(*range(1, 33), layer="big.7.experts")])
    table = summary.table()
    assert "model.layers.3.mlp.experts       2.00     0  50 30 10 10" in table, table
    assert "least 1, median 17, most 32" in table
    assert "experts' routing balanced" in table
    assert summary.to_dict()["experts"][0] == {
        "layer": "model.layers.3.mlp.experts",
        "counts": [50, 30, 10, 10],
        "imbalance": 2.0,
        "idle": [],
    }
    assert "MoE layer" not in RunSummary(rows=[]).table()


# ----------------------------------------------------------------- one process
def test_experts_are_found_in_transformers_and_paratrain_models_and_not_in_dense_ones():
    assert [(x.name, x.experts, x.label) for x in find_expert_layers(routed_mixtral())] == [
        ("model.layers.0.mlp.experts", 4, "layer0"),
        ("model.layers.1.mlp.experts", 4, "layer1"),
    ]
    assert [x.name for x in find_expert_layers(nn.Sequential(gpt_experts()))] == [
        "0.blocks.0.moe.experts",
        "0.blocks.1.moe.experts",
    ]
    assert not has_experts(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def test_a_dense_model_gets_no_hook_and_no_collective(monkeypatch):
    from paratrain.workloads.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=64))
    counter = ExpertCounter(torch.device("cpu"))
    counter.watch(model)
    assert _hooks(model) == 0 and counter.layers == []
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *a, **k: pytest.fail("a dense model all-reduced"))
    assert counter.window(None, copies=1) == []


def _top_k(model: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Each Mixtral layer's top_k_index, recorded by its router's own output."""
    seen = []
    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(lambda _m, _a, out: seen.append(out[2]))
    model(x)
    return seen


def test_counts_are_the_routers_choices_and_a_checkpointed_recompute_is_not_counted_twice():
    model = routed_mixtral()
    x = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    expected = [tuple(torch.bincount(i.flatten(), minlength=4).tolist()) for i in _top_k(routed_mixtral(), x)]
    counter = ExpertCounter(torch.device("cpu"))
    counter.watch(model)
    model.activation_checkpointing_enable()  # transformers' own: each layer's forward runs again in the backward
    model.train()
    model(x, labels=x).loss.backward()
    with torch.no_grad():
        model(x)  # evaluation: not counted
    assert [x.counts for x in counter.window(None, copies=1)] == expected
    assert [sum(c) for c in expected] == [BATCH * SEQ * 2] * 2
    counter.close()
    assert not any(layer.module._forward_pre_hooks for layer in find_expert_layers(model))


def test_the_dispatched_bytes_are_each_token_once_per_expert():
    hidden = torch.zeros(10, 32)
    assert dispatched_bytes(routing((hidden, torch.zeros(10, 2, dtype=torch.long), torch.zeros(10, 2)), 3)) == (
        10 * 2 * 32 * 4
    )
    assert dispatched_bytes(routing((torch.zeros(20, 32), [5, 0, 15]), 3)) == 20 * 32 * 4  # rows: one per slot
    assert dispatched_bytes(routing((torch.zeros(20, 32), torch.tensor([5.0, 0, 15])), 3)) == 20 * 32 * 4
    assert dispatched_bytes(routing((hidden,), 3)) == 0


def test_float_counts_given_to_experts_named_otherwise_are_counted_on_the_device():
    """torchtitan's shape: the experts a module named ``routed``, given ``torch.histc``'s float counts."""
    model = SHAPES["titan_dsv3"].build()
    given = []
    for layer in find_expert_layers(model):
        layer.module.register_forward_pre_hook(lambda _m, args: given.append(args[1].clone()))
    counter = ExpertCounter(torch.device("cpu"))
    counter.watch(model)
    model(torch.randint(0, 65, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)))
    loads = counter.window(None, copies=1)
    assert [x.layer for x in loads] == ["layers.1.moe.routed", "layers.2.moe.routed"]
    assert all(g.dtype == torch.float32 for g in given)
    assert [x.counts for x in loads] == [tuple(int(c) for c in g.tolist()) for g in given]
    assert [x.total for x in loads] == [BATCH * SEQ * 2] * 2  # top 2


# ----------------------------------------------------------------- 2 ranks
@pytest.fixture(scope="module")
def job():
    return spawn(routing_job, 2, timeout_s=170)[0]


@pytest.mark.launched
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "name, strategy",
    [("mixtral", "ddp"), ("mixtral", "zero3"), ("gpt", "ddp"), ("mixtral", "zero3 ep=2"), ("gpt", "ddp ep=2")],
)
def test_two_ranks_report_the_routing_of_the_global_batch(job, name, strategy):
    """Every window's tokens per expert, summed over the ranks, equal one process's on the global batch; with
    expert parallelism too (each rank counts what its router chose, before the tokens travel)."""
    reference = train(name, "single")
    got = job[(name, strategy)]
    assert got["windows"] == reference["windows"] and len(got["windows"]) == 2, (got, reference)
    assert all(
        sum(counts) == 2 * (2 * BATCH) * (SEQ - (name == "gpt")) * 2 for w in got["windows"] for counts in w.values()
    )
    assert got["warnings"] == [] and got["emitted"] == []


@pytest.mark.launched
@pytest.mark.timeout(240)
def test_the_ranks_of_a_cp_group_count_their_own_slices_of_the_sequences(job):
    """zero3 x cp=2 at world 2: one replica, each rank routing half of every sequence; their counts together are
    one process's on that replica's samples, not half of them."""
    reference = train("mixtral", "single", samples=BATCH)
    got = job[("mixtral", "zero3 cp=2")]
    assert got["windows"] == reference["windows"] and len(got["windows"]) == 2, (got, reference)


@pytest.mark.launched
@pytest.mark.timeout(240)
def test_a_collapsed_router_warns_once_on_rank_0(job):
    got = job[("collapsed", "ddp")]
    assert [kind for kind, _ in got["warnings"]] == ["routing"]
    assert len(got["emitted"]) == 1 and got["emitted"][0].startswith(
        "paratrain monitor: routing collapsed in MoE layer blocks."
    )
    assert "2 of its 4 experts got no token (experts 2, 3)" in got["emitted"][0]
    assert all(counts[2:] == (0, 0) for w in got["windows"] for counts in w.values())


@pytest.mark.launched
@pytest.mark.timeout(240)
def test_the_all_to_all_of_a_step_is_timed_on_the_group(job):
    got = job[("all_to_all", "")]
    # 4 per layer, 2 layers: 2 samples x 64 tokens x top 2 x 64 x fp32
    assert got["bytes"] == 4 * 2 * (2 * 64 * 2 * 64 * 4)
    assert 0 < got["seconds"] < 5


class _Trackers:
    """What the monitor needs of ``Trackers``: it is active, and takes each window's figures."""

    active, config = True, None

    def __init__(self):
        self.logged = []

    def log(self, figures, step):
        self.logged.append((step, figures))


def test_each_window_sends_the_layers_imbalance_to_the_trackers_beside_the_job_figures():
    from paratrain.monitor import Monitor

    trackers = _Trackers()
    monitor = Monitor(
        MonitorConfig(every=2), rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"), trackers=trackers
    )
    model = routed_mixtral()
    for step in range(4):
        x = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        with monitor.block(model, True):
            model(x, labels=x).loss.backward()
        monitor.stepped()
    assert [step for step, _ in trackers.logged] == [2, 4]
    figures = trackers.logged[-1][1]
    assert {k for k in figures if k.startswith("moe/")} == {
        "moe/imbalance/layer0",
        "moe/imbalance/layer1",
        "moe/idle_experts/layer0",
        "moe/idle_experts/layer1",
    }
    assert figures["moe/imbalance/layer0"] == monitor.expert_loads[0].imbalance >= 1.0 and "monitor/step_ms" in figures
    monitor.close(print_fn=lambda _text: None)
    assert not any(layer.module._forward_pre_hooks for layer in find_expert_layers(model))
