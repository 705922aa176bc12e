"""Packed batches (paratrain.model.packed): transformers' flattening collator's rows attend within each document,
through the attention function paratrain registers, and equal each document run alone. The strategies' cases are
in tests/strategies/test_zoo.py (world 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import packed
from torch import nn
from torch.nn import functional as F

from paratrain.errors import ConfigError
from paratrain.model.packed import (
    PACKED_ATTENTION,
    document_starts,
    is_packed,
    packed_attention_forward,
    use_packed_attention,
)
from paratrain.testing import max_abs_diff

DOCS = [[3, 9, 4, 1, 5], [2, 6], [7, 7, 1, 8, 2, 8, 1], [5, 3, 2]]


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return out


@pytest.mark.parametrize("model_name", ["llama", "qwen3", "mixtral"])  # qwen2: tests/strategies/test_zoo.py
def test_packed_rows_equal_each_document_alone(model_name):
    model = packed.BUILD[model_name]()
    packed.alone_loss(model, DOCS).backward()
    alone = _grads(model)
    batch = packed.packed(DOCS)
    model(**batch).loss.backward()
    assert max_abs_diff(_grads(model), alone) > 1e-4  # sdpa given restarting positions attends across documents
    use_packed_attention(model)
    assert model.config._attn_implementation == PACKED_ATTENTION
    model(**batch).loss.backward()
    assert max_abs_diff(_grads(model), alone) <= 1e-6


def test_cu_seq_lens_from_the_collator_are_read_and_no_dense_mask_is_built(monkeypatch):
    from transformers import DataCollatorWithFlattening

    model = packed.BUILD["llama"]()
    expected = packed.alone_loss(model, DOCS)
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in DOCS]
    )
    assert "cu_seq_lens_q" in batch
    masks, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(
        torch.nn.functional,
        "scaled_dot_product_attention",
        lambda *a, **k: masks.append(k.get("attn_mask")) or sdpa(*a, **k),
    )
    use_packed_attention(model)
    assert torch.allclose(model(**batch).loss, expected, atol=1e-6)
    assert len(masks) == 2 * len(DOCS) and all(m is None for m in masks)  # 2 layers, one call per document


def test_a_padded_batch_keeps_its_padding_mask():
    model = packed.BUILD["llama"]()
    ids = torch.tensor([[3, 9, 4, 1], [2, 6, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    expected = model(input_ids=ids, attention_mask=mask).logits
    use_packed_attention(model)
    assert torch.allclose(model(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-6)


def test_packed_batches_are_found_from_restarting_positions():
    assert document_starts(torch.tensor([[0, 1, 2, 0, 1, 0]])).tolist() == [[True, False, False, True, False, True]]
    assert is_packed({"position_ids": torch.tensor([[0, 1, 0, 1]])})
    assert not is_packed({"position_ids": torch.arange(4)[None].expand(2, 4)})
    assert not is_packed({"position_ids": torch.tensor([[5, 6, 7, 8]])})  # a continuing row, not a restart
    assert not is_packed({"position_ids": torch.tensor([[0, 1, 6, 7]])})  # a cp rank's head and tail chunks
    assert is_packed({"positions": torch.tensor([[0, 1, 2, 0]])})  # our GPT's keyword
    assert is_packed({"cu_seq_lens_q": torch.tensor([0, 2, 4])})
    assert not is_packed({"attention_mask": torch.ones(1, 4)})


def test_attention_that_would_cross_documents_is_refused():
    with pytest.raises(ConfigError, match="Sequential \\(not transformers\\).*attention would cross documents"):
        use_packed_attention(nn.Sequential(nn.Embedding(16, 8), nn.MultiheadAttention(8, 2)))
    use_packed_attention(_gpt())  # paratrain's GPT reads the documents from its positions: left alone
    model = packed.BUILD["llama"]()
    model.config._attn_implementation = "flex_attention"
    use_packed_attention(model)  # isolates documents itself: left alone
    assert model.config._attn_implementation == "flex_attention"


def test_a_document_longer_than_the_sliding_window_is_refused():
    q = torch.randn(1, 2, 6, 4)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2]])
    out, _ = packed_attention_forward(nn.Module(), q, q, q, None, position_ids=positions, sliding_window=3)
    assert out.shape == (1, 6, 2, 4)
    with pytest.raises(ConfigError, match="longer than this layer's sliding window"):
        packed_attention_forward(nn.Module(), q, q, q, None, position_ids=positions, sliding_window=2)


def test_forward_backward_trains_a_collated_batch_as_each_document_alone():
    result = packed.run_packed("llama", "single", {}, "")
    assert max_abs_diff(result["state"], packed.reference("llama", 1)) <= 1e-6


def test_one_host_read_per_packed_forward():
    """The document lengths are read to the host once a forward (every layer is handed the same positions), not once
    an attention layer: each read waits for the GPU's queue."""
    from paratrain.testing.host_syncs import HostSyncs

    model = packed.BUILD["llama"]()
    use_packed_attention(model)
    batch = packed.packed(DOCS)
    assert model.config.num_hidden_layers > 1
    with HostSyncs() as syncs:
        model(**batch)
    assert syncs.count == 1, dict(syncs.calls)


def _gpt(learned_positions: bool = True) -> nn.Module:
    """paratrain's GPT, grouped-query and gated; a position table restarts with each document."""
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    shape = dict(layers=2, hidden=16, heads=4, kv_heads=2, seq_len=32, vocab=16, bias=False, gated=True)
    return GPT(GPTConfig(**shape, learned_positions=learned_positions))


def _gpt_batch(rows: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of packed documents: token ids and positions restarting at each document, ``[rows, seq]`` each."""
    ids = torch.tensor([[t for doc in row for t in doc] for row in rows])
    positions = torch.tensor([[p for doc in row for p in range(len(doc))] for row in rows])
    return ids, positions


def _gpt_loss(logits: torch.Tensor, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Next-token loss summed over the targets within each document (not across a document's end)."""
    same = positions[:, 1:] != 0
    return F.cross_entropy(logits[:, :-1][same], ids[:, 1:][same], reduction="sum")


def test_our_gpt_attends_within_each_document_of_packed_positions(monkeypatch):
    """Restarting ``positions=`` run paratrain's GPT's attention once per document, no mask: gradients equal each
    document alone; the same ids without positions attend across documents."""
    model = _gpt()
    rows = [[DOCS[0], DOCS[1], DOCS[3]], [DOCS[2], [4, 4, 6]]]  # two rows of 10 tokens, 3 and 2 documents
    for doc in (d for row in rows for d in row):
        ids, positions = _gpt_batch([[doc]])
        _gpt_loss(model(ids), ids, positions).backward()
    alone = _grads(model)
    ids, positions = _gpt_batch(rows)
    _gpt_loss(model(ids), ids, positions).backward()
    assert max_abs_diff(_grads(model), alone) > 1e-2  # whole rows: attention crosses documents
    masks, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(
        F, "scaled_dot_product_attention", lambda *a, **k: masks.append(k.get("attn_mask")) or sdpa(*a, **k)
    )
    _gpt_loss(model(ids, positions=positions), ids, positions).backward()
    assert max_abs_diff(_grads(model), alone) <= 1e-5  # summed over 15 targets: float32 rounding
    assert len(masks) == 2 * 5 and all(m is None for m in masks)  # 2 layers, one call per document


def test_our_gpt_reads_packed_positions_once_a_forward():
    """Packed: one host read a forward, not one a layer. A context-parallel slice's ``[1, seq]`` positions (going on
    by one from its offset, or jumping forward between its head and tail chunks) are one read too and keep whole-row
    attention."""
    from paratrain.testing.host_syncs import HostSyncs

    model = _gpt(learned_positions=False)
    ids, positions = _gpt_batch([[DOCS[0], DOCS[1], DOCS[3]]] * 2)
    with HostSyncs() as syncs:
        model(ids, positions=positions)
    assert syncs.count == 1, dict(syncs.calls)
    ids = ids[:, :6]
    expected = model(ids)
    for positions in (torch.arange(8, 14), torch.tensor([0, 1, 2, 9, 10, 11])):  # Ulysses', all-gather's slices
        with HostSyncs() as syncs:
            sliced = model(ids, positions=positions[None])
        assert syncs.count == 1, dict(syncs.calls)
        assert torch.allclose(sliced, expected)  # no learned positions: the same attention over the whole slice


def test_finding_a_packed_batch_reads_what_its_forward_then_reuses():
    """``is_packed`` (before the forward, in ``forward_backward``) and the attention read the same positions once."""
    from paratrain.testing.host_syncs import HostSyncs

    model = packed.BUILD["llama"]()
    use_packed_attention(model)
    batch = packed.packed(DOCS)
    batch.pop("cu_seq_lens_q", None)
    with HostSyncs() as syncs:
        assert is_packed(batch)
        model(**batch)
    assert syncs.count == 1, dict(syncs.calls)
    model = _gpt()  # paratrain's GPT, given positions= (a loss_fn's call)
    ids, positions = _gpt_batch([[DOCS[0], DOCS[1], DOCS[3]]] * 2)
    with HostSyncs() as syncs:
        assert is_packed({"positions": positions})
        model(ids, positions=positions)
    assert syncs.count == 1, dict(syncs.calls)
