"""cp's attention over whole padded sequences (:mod:`paratrain.distributed.context_parallel.masks`) equals the
kernel called once with the dense ``[b, 1, s, s]`` mask, every row and gradient, for right, left and middle padding,
causal or not, SDPA (bool) and eager (additive) — and builds nothing quadratic in the sequence under SDPA."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from helpers.storage import LargestStorage

from paratrain.distributed.context_parallel.masks import attend, key_mask, read_padding

B, H, KV, D = 3, 4, 2, 8
CPU = torch.device("cpu")


def _kernel(form: str):
    if form == "bool":
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return lambda module, q, k, v, mask, **kwargs: eager_attention_forward(module, q, k, v, mask, D**-0.5)


def _module(causal: bool) -> SimpleNamespace:
    return SimpleNamespace(is_causal=causal, num_key_value_groups=H // KV, training=False)


def _padding(kind: str, s: int) -> torch.Tensor:
    keys = torch.ones(B, s, dtype=torch.long)
    if kind == "right":
        keys[0, s - 5 :], keys[1, s // 2 :] = 0, 0
    elif kind == "left":
        keys[0, :3], keys[1, : s - 1] = 0, 0
    elif kind == "middle":
        keys[0, 2:5], keys[1, 0], keys[1, 7:9], keys[1, s - 2 :], keys[2, 1 : s - 1] = 0, 0, 0, 0, 0
    elif kind == "empty":
        keys[0, 3:6], keys[0, 9:12], keys[1] = 0, 0, 0
    return keys


def _dense(kernel, module, q, k, v, keys: torch.Tensor, causal: bool, form: str):
    """The reference: one call with the whole ``[b, 1, s, s]`` mask."""
    s = q.shape[2]
    allowed = torch.ones(s, s, dtype=torch.bool)
    allowed = (allowed.tril() if causal else allowed)[None, None] & keys.bool()[:, None, None, :]
    return kernel(module, q, k, v, key_mask(allowed, form, q.dtype))


def _inputs(s: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, s, D, generator=g, requires_grad=True) for h in (H, KV, KV)]


@pytest.mark.parametrize("form", ["bool", "additive"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kind", ["none", "right", "left", "middle", "empty"])
def test_padded_attention_equals_the_dense_mask(form, causal, kind):
    s, kernel, module = 16, _kernel(form), _module(causal)
    keys = _padding(kind, s)
    inputs = _inputs(s)
    out, weights = attend(kernel, module, *inputs, read_padding(keys, CPU), causal, form, {})
    want, want_weights = _dense(kernel, module, *inputs, keys, causal, form)
    assert torch.allclose(out, want, atol=1e-6), (out - want).abs().max()
    if form == "additive":
        assert torch.allclose(weights, want_weights, atol=1e-6)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    grads = torch.autograd.grad(out, inputs, upstream)
    want_grads = torch.autograd.grad(want, inputs, upstream)
    for got, expected in zip(grads, want_grads, strict=True):
        assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


def _largest(s: int, kind: str) -> int:
    q, k, v = _inputs(s)
    keys = _padding(kind, s)
    with LargestStorage() as seen:
        out, _ = attend(_kernel("bool"), _module(True), q, k, v, read_padding(keys, CPU), True, "bool", {})
        out.sum().backward()
    return seen.bytes


@pytest.mark.parametrize("kind", ["right", "middle"])
def test_sdpa_with_padding_builds_nothing_quadratic_in_the_sequence(kind):
    """Doubling a padded sequence doubles the largest tensor of one attention's forward and backward, not
    quadruples it as a dense mask does (``middle`` has left padding and runs with and without valid tokens before
    them)."""
    small, large = _largest(1024, kind), _largest(2048, kind)
    assert large <= 2.5 * small, (small, large)


def test_right_padding_calls_sdpa_without_a_mask():
    """CUDA's flash kernel takes no mask: right padding (the common case) reaches SDPA with none, the valid tokens
    causal with as many keys as queries; a mask is left only for rows with no valid token before them."""
    calls = []

    def kernel(module, q, k, v, mask, **kwargs):
        calls.append((mask, kwargs.get("is_causal"), q.shape[2], k.shape[2]))
        return _kernel("bool")(module, q, k, v, mask, **kwargs)

    s = 16
    attend(kernel, _module(True), *_inputs(s), read_padding(_padding("right", s), CPU), True, "bool", {})
    assert all(mask is None for mask, *_ in calls), "a mask keeps SDPA off the flash kernel"
    assert (None, True, s - 5, s - 5) in calls and (None, True, s // 2, s // 2) in calls


def test_padding_is_indexed_on_the_inputs_device():
    """A CPU attention mask beside inputs on an accelerator: the gather indices go where the kernel runs."""
    padding = read_padding(_padding("middle", 16), torch.device("meta"))
    assert {t.device.type for s in padding.samples for t in (s.valid, s.order)} | {padding.keys.device.type} == {"meta"}
