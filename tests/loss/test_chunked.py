"""``chunked_cross_entropy`` (:mod:`paratrain.loss.chunked`) equals ``F.cross_entropy`` of the head's logits, loss
and gradients, without ever holding the ``tokens x vocabulary`` logits."""

from __future__ import annotations

import pytest
import torch
from helpers.storage import LargestStorage
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.errors import ConfigError

V, C = 300, 16


def _plain(hidden, head, targets, softcap=None, **kwargs):
    logits = head(hidden)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), **kwargs)


def _case(bias: bool, shape=(2, 37), seed=0):
    torch.manual_seed(seed)
    head = nn.Linear(C, V, bias=bias)
    hidden = torch.randn(*shape, C, requires_grad=True)
    targets = torch.randint(0, V, shape)
    targets.view(-1)[3] = -100
    return head, hidden, targets


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("softcap", [None, 5.0])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 10, 1000])
def test_loss_and_gradients_equal_the_plain_cross_entropy(bias, softcap, reduction, chunk):
    head, hidden, targets = _case(bias)
    inputs = [hidden, *head.parameters()]
    want = _plain(hidden, head, targets, softcap, reduction=reduction)
    want_grads = torch.autograd.grad(want * 3.0, inputs)  # a gradient arriving scaled (accumulation, loss scale)
    got = paratrain.chunked_cross_entropy(hidden, head, targets, chunk=chunk, softcap=softcap, reduction=reduction)
    got_grads = torch.autograd.grad(got * 3.0, inputs)
    assert abs(float((got - want).detach())) <= 1e-6 * abs(float(want.detach()))
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype and _rel(g, w) <= 2e-6


def test_another_ignore_index_and_any_leading_shape():
    head, hidden, targets = _case(False, shape=(2, 3, 11))
    targets[targets == -100] = -1
    want = _plain(hidden, head, targets, ignore_index=-1)
    got = paratrain.chunked_cross_entropy(hidden, head, targets, chunk=4, ignore_index=-1)
    assert abs(float((got - want).detach())) <= 1e-6 * float(want.detach())


def test_a_frozen_head_gets_no_gradient_and_no_grad_computes_none():
    head, hidden, targets = _case(True)
    head.requires_grad_(False)
    loss = paratrain.chunked_cross_entropy(hidden, head, targets, chunk=8)
    loss.backward()
    assert head.weight.grad is None and hidden.grad is not None
    with torch.no_grad():
        value = paratrain.chunked_cross_entropy(hidden, head, targets, chunk=8)
    assert not value.requires_grad and torch.equal(value, loss.detach())


def test_the_logits_never_exist_whole():
    head, hidden, targets = _case(False, shape=(4, 64))
    whole = 4 * 64 * V * 4  # the fp32 logits
    with LargestStorage() as plain:
        _plain(hidden, head, targets).backward()
    with LargestStorage() as chunked:
        paratrain.chunked_cross_entropy(hidden, head, targets, chunk=16).backward()
    assert plain.bytes >= whole
    assert chunked.bytes <= whole // 16 + V * C * 4  # one chunk's logits, or the head's gradient


def test_bf16_autocast_stays_close():
    head, hidden, targets = _case(False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = _plain(hidden, head, targets)
        got = paratrain.chunked_cross_entropy(hidden, head, targets, chunk=10)
    assert got.dtype == torch.float32 and abs(float((got - want).detach())) <= 1e-2 * float(want.detach())
    grads = torch.autograd.grad(got, [hidden, head.weight])
    assert [g.dtype for g in grads] == [torch.float32, torch.float32]


@pytest.mark.parametrize(
    "kwargs, says",
    [
        ({"reduction": "none"}, "reduction 'none' is not one of mean, sum"),
        ({"chunk": 0}, "chunk must be a whole number of tokens >= 1"),
        ({"targets": torch.zeros(3, dtype=torch.long)}, "targets of shape (3,) do not match hidden states"),
    ],
)
def test_bad_arguments_are_one_line(kwargs, says):
    head, hidden, targets = _case(False)
    args = {"targets": targets, **kwargs}
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")) as err:
        paratrain.chunked_cross_entropy(hidden, head, **args)
    assert "\n" not in str(err.value)
