"""cp's all-gather (``cp_method="allgather"``, :mod:`paratrain.distributed.context_parallel.allgather`), in one
process: each rank's rows of attention over the gathered keys and values equal the dense ``[b, 1, s, s]`` mask's
rows (outputs and gradients; causal or not, padded or not, SDPA and eager), the head-tail cut gives every rank the
same causal work, no mask holds more than a rank's rows, and the option's rule and bad input. The launched jobs
(``test_context_parallel.py``) train models with fewer key/value heads than cp equal to one process."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn import functional as F

from paratrain.composition import cp_method
from paratrain.distributed.context_parallel.allgather import attend_rows, in_order, row_masks
from paratrain.distributed.context_parallel.masks import key_mask
from paratrain.distributed.context_parallel.sequence import SequenceSplit
from paratrain.errors import ConfigError
from paratrain.options import CPConfig
from paratrain.strategies.composed import preset

B, H, KV, D, S = 2, 4, 1, 8, 16


def split_of(rank: int, ranks: int, balanced: bool) -> SequenceSplit:
    """Rank ``rank`` of a cp group of ``ranks`` as the layout sees it (no process group)."""
    split = SequenceSplit.__new__(SequenceSplit)
    split.rank, split.ranks, split.balanced = rank, ranks, balanced
    split.pieces = 2 * ranks if balanced else ranks
    return split


def local(t: torch.Tensor, split: SequenceSplit) -> torch.Tensor:
    """``[b, h, s, d]`` -> this rank's pieces along the sequence (dimension 2)."""
    return split.local(t.transpose(1, 2)).transpose(1, 2)


def kernel(form: str):
    """A transformers attention function: (module, q, k, v, mask, **kwargs) -> (out [b, s, h, d], weights)."""
    if form == "bool":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return lambda module, q, k, v, mask, **kwargs: eager_attention_forward(module, q, k, v, mask, D**-0.5)


def padding(kind: str) -> torch.Tensor | None:
    if kind == "none":
        return None
    keys = torch.ones(B, S, dtype=torch.bool)
    keys[0, :3], keys[1, 5:9], keys[1, S - 3 :] = False, False, False  # left (rows with no valid key), middle, right
    return keys


def inputs(seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, D, generator=g, requires_grad=True) for h in (H, KV, KV)]


def dense(form: str, module, q, k, v, keys, causal: bool):
    allowed = torch.ones(S, S, dtype=torch.bool)
    allowed = (allowed.tril() if causal else allowed)[None, None]
    if keys is not None:
        allowed = allowed & keys[:, None, None, :]
    out, weights = kernel(form)(module, q, k, v, key_mask(allowed, form, q.dtype), is_causal=False)
    return out.transpose(1, 2), weights  # [b, h, s, d]


@pytest.mark.parametrize("ranks, balanced", [(4, True), (2, False)])
@pytest.mark.parametrize("form", ["bool", "additive"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["none", "left"])
def test_each_rank_s_rows_equal_the_dense_mask_s(ranks, balanced, form, causal, kind):
    """Every rank's output rows, weights and its share of the gradients, summed over the ranks, equal one call with
    the dense mask (GQA: 4 query heads, 1 key/value head)."""
    module = SimpleNamespace(is_causal=causal, num_key_value_groups=H // KV, training=False)
    keys, (q, k, v) = padding(kind), inputs()
    want, want_weights = dense(form, module, q, k, v, keys, causal)
    upstream = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    want_grads = torch.autograd.grad(want, (q, k, v), upstream)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(ranks):
        split = split_of(rank, ranks, balanced)

        def run(qc, kc, vc, mask):
            out, weights = kernel(form)(module, qc, kc, vc, mask, is_causal=False)
            return out.transpose(1, 2), weights

        out, weights = attend_rows(run, local(q, split), k, v, split, keys, causal, form)
        assert torch.equal(out.isnan(), local(want, split).isnan())
        assert torch.allclose(out.nan_to_num(), local(want, split).nan_to_num(), atol=1e-6)
        if form == "additive":
            assert torch.allclose(weights, local(want_weights, split), atol=1e-6)
        for total, g in zip(grads, torch.autograd.grad(out, (q, k, v), local(upstream, split)), strict=True):
            total += g
    for got, expected in zip(grads, want_grads, strict=True):
        assert torch.allclose(got.nan_to_num(), expected.nan_to_num(), atol=1e-5), (got - expected).abs().max()


def test_sdpa_calls_keep_their_options():
    """What the function mode runs for a bare SDPA call (scale, grouping) equals the call on whole sequences."""
    q, k, v = inputs()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3, enable_gqa=True)
    for rank in range(2):
        split = split_of(rank, 2, True)

        def run(qc, kc, vc, mask):
            return F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask, scale=0.3, enable_gqa=True), None

        out, _ = attend_rows(run, local(q, split), k, v, split, None, True, "bool")
        assert torch.allclose(out, local(want, split), atol=1e-6)


@pytest.mark.parametrize("ranks, balanced", [(2, True), (4, True), (4, False)])
def test_gathered_pieces_come_back_in_sequence_order(ranks, balanced):
    x = torch.arange(B * 3 * S * 2.0).view(B, 3, S, 2)
    pieces = [local(x, split_of(r, ranks, balanced)) for r in range(ranks)]
    assert torch.equal(in_order(torch.cat(pieces), split_of(0, ranks, balanced)), x)


def test_head_tail_pieces_give_every_rank_the_same_causal_work():
    """The query-key pairs a causal mask lets each rank compute: equal under the head-tail cut (rank 0 holds pieces 0
    and 7 of 8 at cp=4), growing with the rank under a contiguous cut; no mask larger than a rank's rows."""
    s, ranks = 64, 4

    def work(balanced: bool) -> list[int]:
        pairs = []
        for r in range(ranks):
            split = split_of(r, ranks, balanced)
            masks = list(row_masks(split, s, None, True, "bool", torch.float32, torch.device("cpu")))
            assert all(m.numel() <= s * s // ranks for _, _, m in masks), "a mask beyond the rank's rows"
            pairs.append(sum(int(m.sum()) for _, _, m in masks))
        return pairs

    assert split_of(0, ranks, True).chunks(s) == (0, 56)
    assert len(set(work(True))) == 1 and sum(work(True)) == s * (s + 1) // 2
    assert work(False) == sorted(work(False)) and work(False)[0] < work(False)[-1]


@pytest.mark.parametrize(
    "requested, heads, kv_heads, ranks, chosen",
    [
        ("auto", 8, 8, 4, "ulysses"),
        ("auto", 8, 1, 2, "allgather"),
        ("auto", 8, 2, 4, "allgather"),
        ("auto", 6, 6, 4, "allgather"),
        ("auto", None, None, 4, "ulysses"),
        ("allgather", 8, 8, 2, "allgather"),
        ("ulysses", 8, 1, 2, "ulysses"),
    ],
)
def test_auto_runs_ulysses_where_the_heads_divide(requested, heads, kv_heads, ranks, chosen):
    assert cp_method(requested, heads, kv_heads, ranks) == chosen


def test_cp_method_is_an_option_of_cp():
    assert CPConfig.pop({"cp": 2, "cp_method": "allgather"}) == CPConfig(degree=2, method="allgather")
    assert CPConfig.pop({"cp": 2}).method == "auto"
    assert preset("zero3")(cp=2, cp_method="allgather").describe().endswith("cp=2, cp_method=allgather)")
    with pytest.raises(ConfigError, match="cp_method must be one of auto, ulysses, allgather, got 'ring'"):
        preset("ddp")(cp=2, cp_method="ring")
    with pytest.raises(ConfigError, match="cp_method='allgather' chooses how cp runs attention; add cp=N"):
        preset("ddp")(cp_method="allgather")


def test_row_masks_are_built_on_the_inputs_device():
    """On CUDA the kernel refuses a host mask beside device inputs: the rows' masks are made where q lives."""
    keys = padding("left").to("meta")
    masks = list(row_masks(split_of(1, 2, True), S, keys, True, "additive", torch.float32, torch.device("meta")))
    assert {m.device.type for _, _, m in masks} == {"meta"}


def test_a_kernel_module_beside_transformers_attention_is_one_line():
    """The all-gather runs a kernel module through its SDPA call, found by the model's first call, which does not
    run where transformers attention is wrapped: refused at prepare, not left unexchanged."""
    from helpers.cp_workers import CausalAttention, NanoGPTForCP, llama

    from paratrain.distributed.context_parallel.attention import wrap_attention

    model = llama(kv_heads=1)
    model.extra = CausalAttention(NanoGPTForCP().config)
    with pytest.raises(ConfigError, match="cp_method='allgather' runs an attention kernel module through its SDPA"):
        wrap_attention(model, split_of(0, 2, True), 2, "allgather")


def test_a_sliding_window_shorter_than_the_sequence_is_one_line():
    """cp's kernels mask causally over the whole sequence: a window the model's own mask carried would be lost
    (a silent wrong result), so a transformers model whose attention is windowed over the sequence is refused at the
    call; a window at least as long as the sequence attends as full attention does and runs."""
    transformers = pytest.importorskip("transformers")
    from paratrain.distributed.context_parallel import attention

    config = transformers.Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=0,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    calls = []
    for module in model.modules():
        if attention._is_hf_attention(module):
            module.paratrain_cp = lambda m, q, *a, **k: calls.append(q.shape) or (q.transpose(1, 2), None)
            module.paratrain_cp.split = SimpleNamespace(ranks=2)
    attention._register()
    model.config._attn_implementation = attention.DISPATCH_NAME
    with pytest.raises(ConfigError, match="sliding window of 4 tokens"):
        model(torch.zeros(1, 3, dtype=torch.long))  # 3 tokens a rank: 6 in all
    model(torch.zeros(1, 2, dtype=torch.long))  # 4 in all: within the window
    assert len(calls) == 1
