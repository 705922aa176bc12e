"""Packed batches under cp (Ulysses and the all-gather), on a one-rank cp group in this process: the documents are
found from the whole sequences' positions before cp cuts them, attention stays within each document, the loss counts
the real tokens, one host read a forward; what cannot keep documents apart is one line. The launched cases (two
ranks, trained equal to one process) are in test_context_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers import packed
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from paratrain.distributed.context_parallel.masks import read_documents
from paratrain.distributed.context_parallel.part import ContextParallel
from paratrain.errors import ConfigError
from paratrain.model.packed import is_packed
from paratrain.options import CPConfig
from paratrain.testing import max_abs_diff
from paratrain.testing.host_syncs import HostSyncs

DOCS = [[3, 9, 4, 1, 5], [2, 6], [7, 7, 1, 8, 2, 8, 1], [5, 3, 2, 4]]  # 18 tokens: head and tail pieces of 9


@pytest.fixture
def cp_group():
    """A cp group of one rank: cp's hooks and exchanges run as on every rank of a larger one."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))


def _with_cp(model: nn.Module, mesh, method: str) -> nn.Module:
    return ContextParallel(CPConfig(degree=2, method=method)).apply(model, mesh)


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("method", ["ulysses", "allgather"])
def test_a_packed_row_under_cp_equals_each_document_alone(cp_group, method):
    alone = packed.BUILD["llama"]()
    expected = packed.alone_loss(alone, DOCS)
    expected.backward()
    model = _with_cp(packed.BUILD["llama"](), cp_group, method)
    batch = packed.packed(DOCS)
    with HostSyncs() as syncs:
        assert is_packed(batch)  # forward_backward's look, before the forward
        loss = model(**batch).loss
    assert syncs.count == 1, dict(syncs.calls)  # the document lengths, once for the look, cp's cut and every layer
    loss.backward()
    assert torch.allclose(loss, expected, atol=1e-6)
    assert max_abs_diff(_grads(model), _grads(alone)) <= 1e-6


@pytest.mark.parametrize("method", ["ulysses", "allgather"])
def test_the_collators_cu_seq_lens_are_read_too(cp_group, method):
    from transformers import DataCollatorWithFlattening

    expected = packed.alone_loss(packed.BUILD["llama"](), DOCS)
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in DOCS]
    )
    del batch["position_ids"]
    model = _with_cp(packed.BUILD["llama"](), cp_group, method)
    assert torch.allclose(model(**batch).loss, expected, atol=1e-6)


def test_packing_and_padding_together_are_one_line(cp_group):
    model = _with_cp(packed.BUILD["llama"](), cp_group, "allgather")
    batch = packed.packed(DOCS)
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -1] = 0
    with pytest.raises(ConfigError, match="a packed batch .* or a padding mask, not both; fill a packed row"):
        model(**batch, attention_mask=mask)


def test_attention_that_cannot_keep_documents_apart_is_one_line(cp_group):
    """An attention kernel module that takes no ``documents=`` (paratrain's GPT's, unmarked)."""
    from paratrain.workloads.gpt import GPT, GPTConfig

    model = GPT(GPTConfig(layers=1, hidden=8, heads=2, seq_len=8, vocab=16))
    model.blocks[0].attention.packs_documents = False
    model = _with_cp(model, cp_group, "ulysses")
    with pytest.raises(ConfigError, match="packed batch .* under cp, which keeps documents apart in transformers"):
        model(torch.zeros(1, 8, dtype=torch.long), positions=torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]))


class _Made(TorchDispatchMode):
    """Records the tensors made from host values (``torch.tensor(list)``): on a GPU, a copy that waits for its
    queue."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.lift_fresh.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("given", ["position_ids", "cu_seq_lens_q"])
def test_document_ids_are_computed_where_the_positions_are(given):
    """The all-gather's document ids come from the positions on their device, not from the host's lengths."""
    from transformers import DataCollatorWithFlattening

    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in DOCS]
    )
    positions, cu = (batch["position_ids"], None) if given == "position_ids" else (None, batch["cu_seq_lens_q"])
    with _Made() as made:
        found = read_documents(positions, cu, 1, 18, torch.device("cpu"))
    assert made.count == 0
    assert found.lengths == ((5, 2, 7, 4),)
    assert found.ids.tolist() == [[0] * 5 + [1] * 2 + [2] * 7 + [3] * 4]
