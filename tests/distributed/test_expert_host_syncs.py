"""Expert parallelism's hot path reads the device on the host once per MoE layer per forward: the counts its
all-to-all splits by, read together (``.tolist()``), nothing else (no ``nonzero``/``bincount``/unsized
``repeat_interleave``, which CUDA answers by reading the device), the monitor's expert counts included.

Each model's experts are dispatched over a one-rank group in this process (the same code as over ``ep`` ranks), and
its forward counted with :class:`paratrain.testing.host_syncs.HostSyncs`; its output and gradients stay those of
the model before. Experts that read their counts on the host themselves (torchtitan's loop) keep that read: the
layer adds its one. The counts reach the local experts as the model gave them (a tensor of its dtype, or a list).
The equality over several ranks is tests/distributed/test_expert_parallel.py's. On a GPU, CUDA's own sync check
counts inside the experts modules.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.ep_workers import MODELS
from torch import nn

from paratrain.distributed.expert_parallel.experts import dispatch_experts, find_experts
from paratrain.errors import ConfigError
from paratrain.model.experts import find_expert_layers
from paratrain.monitor.experts import ExpertCounter
from paratrain.testing.host_syncs import HostSyncs

TOKENS = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))


def _forward(model: torch.nn.Module) -> tuple[torch.Tensor, HostSyncs, dict[str, torch.Tensor]]:
    """One forward (its host reads counted) and backward: the output and every gradient."""
    with HostSyncs() as syncs:
        out = model(TOKENS)
    out = out.logits if hasattr(out, "logits") else out
    out.float().square().mean().backward()
    return out.detach(), syncs, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD  # the conftest destroys it


@pytest.mark.parametrize("name", ["gpt_moe", "mixtral", "gpt_oss", "qwen2_moe"])
def test_one_host_read_per_moe_layer_per_forward(name, one_rank_group):
    model = MODELS[name].build()
    expected, _, expected_grads = _forward(model)
    model.zero_grad(set_to_none=True)
    layers = find_experts(model, 1)
    for layer in layers:
        dispatch_experts(layer, one_rank_group)
    counter = ExpertCounter(torch.device("cpu"))
    counter.watch(model)  # the monitor's tokens per expert: counted on the device, read only at its window
    out, syncs, grads = _forward(model)
    assert syncs.count == len(layers) == len(find_expert_layers(model)), dict(syncs.calls)
    assert dict(syncs.calls) == {"tolist": len(layers)}
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], rtol=0, atol=1e-6, msg=key)
    assert sum(load.total for load in counter.window(None, 1)) == TOKENS.numel() * 2 * len(layers)  # top 2


def test_ep_adds_one_host_read_per_layer_to_the_models_own(one_rank_group):
    """torchtitan's shape (experts named ``routed`` reading their float counts on the host themselves): the layer's
    one read for the all-to-all's splits, and the model's own, nothing more; the output and gradients unchanged."""
    model = MODELS["titan_dsv3"].build()
    expected, plain, expected_grads = _forward(model)
    model.zero_grad(set_to_none=True)
    layers = find_experts(model, 1)
    for layer in layers:
        dispatch_experts(layer, one_rank_group)
    out, syncs, grads = _forward(model)
    assert len(layers) == 2 and syncs.count == plain.count + len(layers), (dict(plain.calls), dict(syncs.calls))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], rtol=0, atol=1e-6, msg=key)


@pytest.mark.parametrize("name", ["gpt_moe", "mixtral", "titan_dsv3"])
def test_a_tp_ranks_share_of_the_rows_adds_no_host_read(name, one_rank_group):
    """Beside tp each rank cuts its share of the rows (and their counts or choices) and gathers the outputs over tp
    (a one-rank tp mesh here: the same DTensor redistributions): the host reads of ep alone (one a layer, beside the
    model's own), the output and gradients those of ep alone."""
    from torch.distributed.device_mesh import init_device_mesh

    tp = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    runs = []
    for beside in (None, tp):
        model = MODELS[name].build()
        for layer in find_experts(model, 1):
            dispatch_experts(layer, one_rank_group, tp=beside)
        runs.append(_forward(model))
    (expected, alone, expected_grads), (out, syncs, grads) = runs
    assert dict(syncs.calls) == dict(alone.calls) and alone.count >= len(find_expert_layers(model))
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    assert grads.keys() == expected_grads.keys()
    for key, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[key], rtol=0, atol=1e-6, msg=key)


def test_a_share_of_rows_sorted_by_expert_counts_its_own_rows_on_the_device():
    """Rows sorted by expert cut into tp chunks (``torch.chunk``'s, uneven): each chunk's counts per expert, clamped
    on the device in the counts' dtype, sum to the chunk and, over the chunks, to the counts."""
    from paratrain.distributed.expert_parallel.tp_share import _within, share_bounds

    counts = torch.tensor([3.0, 0.0, 5.0, 2.0])  # 10 rows; 3 ranks: chunks of 4, 4, 2
    shares = []
    for rank in range(3):
        lo, hi = share_bounds(10, rank, 3)
        with HostSyncs() as syncs:
            share = _within(counts, lo, hi)
        assert syncs.count == 0 and share.dtype == counts.dtype and share.sum() == hi - lo
        shares.append(share.tolist())
    assert shares == [[3, 0, 1, 0], [0, 0, 4, 0], [0, 0, 0, 2]]
    assert [share_bounds(5, r, 4) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # torch.chunk's cut


class Recorded(nn.Module):
    """Experts (any name) that keep the counts they are given and take them as a tensor or a list, as they come."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0)))
        self.given: list[torch.Tensor | list[int]] = []

    def forward(self, rows: torch.Tensor, per_expert: torch.Tensor | list[int]) -> torch.Tensor:
        self.given.append(per_expert)
        sizes = per_expert.tolist() if isinstance(per_expert, torch.Tensor) else per_expert
        return torch.cat([part @ w.T for part, w in zip(rows.split([int(c) for c in sizes]), self.w, strict=True)])


class Sorted(nn.Module):
    """A router that sends token i to expert i % 4 and hands its experts the counts as ``kind`` says."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.anything = kind, Recorded()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen = torch.arange(len(x)) % 4
        counts = torch.histc(chosen.float(), bins=4, min=0, max=4)  # floats, as torchtitan's router gives them
        given = {"float": counts, "int32": counts.to(torch.int32), "list": [int(c) for c in counts.tolist()]}
        order = chosen.argsort(stable=True)
        out = torch.empty_like(x)
        out[order] = self.anything(x[order], given[self.kind])
        return out


@pytest.mark.parametrize("beside_tp", [False, True], ids=["ep", "tp-share"])
@pytest.mark.parametrize("kind", ["float", "int32", "list"])
def test_the_experts_get_their_counts_as_the_model_gave_them(kind, beside_tp, one_rank_group):
    """With ep alone and beside tp (a one-rank tp mesh: the share's counts, cut from the model's, keep their type)."""
    from torch.distributed.device_mesh import init_device_mesh

    model, x = Sorted(kind), torch.randn(10, 8, generator=torch.Generator().manual_seed(1))
    expected = model(x)
    (layer,) = find_experts(model, 1)
    dispatch_experts(layer, one_rank_group, tp=init_device_mesh("cpu", (1,)) if beside_tp else None)
    model.anything.given.clear()
    torch.testing.assert_close(model(x), expected, rtol=0, atol=1e-6)
    (given,) = model.anything.given
    if kind == "list":
        assert given == [3, 3, 2, 2]
    else:
        dtype = {"float": torch.float32, "int32": torch.int32}[kind]
        assert isinstance(given, torch.Tensor) and given.dtype == dtype and given.device == x.device
        assert given.tolist() == [3, 3, 2, 2]


def test_a_call_without_the_routers_choice_is_one_line(one_rank_group):
    """3-D weights of one first dimension and two arguments, but the second is no routing: refused at the call."""
    model = Sorted("list")
    (layer,) = find_experts(model, 1)
    dispatch_experts(layer, one_rank_group)
    with pytest.raises(ConfigError, match=r"ep split anything \(Recorded: 3-D parameters of 4 experts\), but") as err:
        model.anything(torch.zeros(10, 8), torch.zeros(10, 8))
    assert "\n" not in str(err.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gpt_moe", "mixtral"])
@pytest.mark.parametrize("beside_tp", [False, True], ids=["ep", "tp-share"])
def test_on_cuda_an_ep_layer_synchronizes_once_per_forward(name, beside_tp):
    """A one-rank NCCL group; ``torch.cuda.set_sync_debug_mode("warn")`` within each experts module's call; beside tp
    (a one-rank tp mesh) the share and the gather over tp add none."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    tp = init_device_mesh("cuda", (1,), mesh_dim_names=("tp",)) if beside_tp else None
    model = MODELS[name].build().cuda()
    layers = find_experts(model, 1)
    for layer in layers:
        dispatch_experts(layer, dist.group.WORLD, tp=tp)
        layer.module.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("warn"))
        layer.module.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(TOKENS.cuda())
    torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchronizing" in str(w.message)]) == len(layers)
