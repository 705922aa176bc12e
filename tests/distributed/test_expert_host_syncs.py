"""Expert parallelism's hot path reads the device on the host once per MoE layer per forward: the counts its
all-to-all splits by, read together (``.tolist()``), nothing else (no ``nonzero``/``bincount``/unsized
``repeat_interleave``, which CUDA answers by reading the device), the monitor's expert counts included.

Each model's experts are dispatched over a one-rank group in this process (the same code as over ``ep`` ranks), and
its forward counted with :class:`paratrain.testing.host_syncs.HostSyncs`; its output and gradients stay those of
the model before. The equality over several ranks is tests/distributed/test_expert_parallel.py's. On a GPU,
CUDA's own sync check counts inside the experts modules.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.ep_workers import MODELS

from paratrain.distributed.expert_parallel.experts import dispatch_experts, find_experts
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["gpt_moe", "mixtral"])
def test_on_cuda_an_ep_layer_synchronizes_once_per_forward(name):
    """A one-rank NCCL group; ``torch.cuda.set_sync_debug_mode("warn")`` within each experts module's call."""
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, device_id=torch.device("cuda", 0))
    model = MODELS[name].build().cuda()
    layers = find_experts(model, 1)
    for layer in layers:
        dispatch_experts(layer, dist.group.WORLD)
        layer.module.register_forward_pre_hook(lambda *_: torch.cuda.set_sync_debug_mode("warn"))
        layer.module.register_forward_hook(lambda *_: torch.cuda.set_sync_debug_mode("default"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(TOKENS.cuda())
    torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchronizing" in str(w.message)]) == len(layers)
