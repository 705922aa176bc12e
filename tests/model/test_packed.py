"""Packed batches (paratrain.model.packed): transformers' flattening collator's rows attend within each document,
through the attention function paratrain registers, and equal each document run alone. The strategies' cases are
in tests/strategies/test_zoo.py (world 2)."""

from __future__ import annotations

import pytest
import torch
from helpers import packed
from torch import nn

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
    assert is_packed({"positions": torch.tensor([[0, 1, 2, 0]])})  # our GPT's keyword: refused below
    assert is_packed({"cu_seq_lens_q": torch.tensor([0, 2, 4])})
    assert not is_packed({"attention_mask": torch.ones(1, 4)})


def test_attention_that_would_cross_documents_is_refused():
    from paratrain.workloads.gpt import GPT, GPTConfig

    with pytest.raises(ConfigError, match="GPT \\(not transformers\\).*attention would cross documents"):
        use_packed_attention(GPT(GPTConfig(layers=1, hidden=8, heads=2, seq_len=8, vocab=16)))
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
