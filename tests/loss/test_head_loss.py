"""``Parallel(loss_chunk=)`` (:mod:`paratrain.loss.head_loss`) in one process: the loss computed at the head equals
what the model or the ``loss_fn`` computes, loss and gradients, for every kind of call; it is proven once per model
and call, never holds the logits whole, and refuses in one line what it cannot compute."""

from __future__ import annotations

import pytest
import torch
from helpers.loss_workers import batch, build, micro_loss
from helpers.zoo import SEQ, VOCAB
from loss.test_chunked import LargestStorage
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.batch import ModelCall
from paratrain.errors import ConfigError
from paratrain.loss import proof
from paratrain.strategies.registry import create

CASES = [
    ("gpt2", "labels"),
    ("llama", "labels"),
    ("lora", "labels"),
    ("nanogpt_real", "targets"),
    ("gpt2", "loss_fn"),
    ("nanogpt", "loss_fn"),
]


def _trained(model_name: str, call: str, chunk: int | None, precision: str = "fp32"):
    """Two micro-batches accumulated into one step's gradients; their losses and the gradients."""
    par = paratrain.Parallel(
        "single", monitor=False, accumulate=2, precision=precision, model=paratrain.ModelConfig(loss_chunk=chunk)
    )
    model = par.prepare(build(model_name))
    losses = [micro_loss(model, *batch(s, 2, call), call, par) for s in range(2)]
    return losses, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("model_name, call", CASES)
def test_the_loss_and_gradients_equal_the_plain_ones(model_name, call):
    want, want_grads = _trained(model_name, call, None)
    got, got_grads = _trained(model_name, call, 5)
    assert all(abs(float(g - w)) <= 1e-6 * float(w) for g, w in zip(got, want))
    assert got_grads.keys() == want_grads.keys()
    for name, w in want_grads.items():
        assert float((got_grads[name] - w).abs().max()) <= 2e-6 * float(w.abs().max()), name


def test_bf16_mixed_stays_close():
    (want, *_), _ = _trained("llama", "labels", None, "bf16-mixed")
    (got, *_), _ = _trained("llama", "labels", 5, "bf16-mixed")
    assert abs(float(got - want)) <= 2e-2 * float(want)


def _gemma2() -> nn.Module:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    return Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            final_logit_softcapping=3.0,
            max_position_embeddings=SEQ,
            attn_implementation="eager",
        )
    )


def test_a_loss_fn_that_shifts_the_targets_itself():
    x, _ = batch(0, 2, "labels")
    shifted = lambda out, t: F.cross_entropy(out[:, :-1].flatten(0, 1), t[:, 1:].flatten())  # noqa: E731
    losses, grads = [], []
    for chunk in (None, 3):
        par = paratrain.Parallel("single", monitor=False, model=paratrain.ModelConfig(loss_chunk=chunk))
        model = par.prepare(build("nanogpt"))
        losses.append(par.forward_backward(model, x, x, shifted))
        grads.append(model.head.weight.grad)
    assert abs(float(losses[1] - losses[0])) <= 1e-6 * float(losses[0])
    assert float((grads[1] - grads[0]).abs().max()) <= 2e-6 * float(grads[0].abs().max())


@pytest.mark.parametrize("extra", [{}, {"num_items_in_batch": torch.tensor(11)}])
def test_soft_capped_logits_and_a_count_of_items_follow_the_model(extra):
    x, y = batch(0, 2, "labels")
    losses = []
    for chunk in (None, 4):
        par = paratrain.Parallel("single", monitor=False, model=paratrain.ModelConfig(loss_chunk=chunk))
        losses.append(par.forward_backward(par.prepare(_gemma2()), {"input_ids": x, "labels": y, **extra}))
    assert abs(float(losses[1] - losses[0])) <= 1e-6 * float(losses[0])


def _long_llama() -> nn.Module:
    """A vocabulary and a sequence large enough that the logits are the step's largest tensor."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            vocab_size=1000,
            max_position_embeddings=256,
        )
    )


def test_the_logits_never_exist_whole_and_the_proof_runs_once():
    ids = torch.randint(0, 1000, (1, 256), generator=torch.Generator().manual_seed(0))
    logits = 256 * 1000 * 4
    largest = []
    for chunk in (None, 32):
        par = paratrain.Parallel("single", monitor=False, model=paratrain.ModelConfig(loss_chunk=chunk))
        model = par.prepare(_long_llama())
        calls = []
        model.register_forward_pre_hook(lambda *_, calls=calls: calls.append(1))
        par.forward_backward(model, {"input_ids": ids, "labels": ids})  # with chunks: the proof's two runs first
        with LargestStorage() as seen:
            par.forward_backward(model, {"input_ids": ids, "labels": ids})
        largest.append(seen.bytes)
    assert len(calls) == 4
    assert largest[0] >= logits > 4 * largest[1]


def test_a_window_cuts_every_input_alike():
    ids = torch.arange(2 * 100).view(2, 100)
    call = ModelCall.of({"input_ids": ids, "attention_mask": torch.ones(2, 1, 100, 100), "labels": ids}, None, None, {})
    cut = proof.window(call, "labels")
    assert cut.kwargs["input_ids"].shape == (1, proof.WINDOW)
    assert cut.kwargs["attention_mask"].shape == (1, 1, proof.WINDOW, proof.WINDOW)
    assert cut.loss_kwargs["labels"][0, -1] == 99 and cut.loss_kwargs["labels"][0, 0] == 0


class ZLoss(nn.Module):
    """A model whose own loss adds a z-loss: not a plain cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.norm, self.head = nn.Embedding(VOCAB, 16), nn.LayerNorm(16), nn.Linear(16, VOCAB)

    def forward(self, idx, targets=None):
        logits = self.head(self.norm(self.emb(idx)))
        if targets is None:
            return logits, None
        z = torch.logsumexp(logits, -1).square().mean()
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-1) + 1e-2 * z


def _refusal(model: nn.Module, *args, strategy: str = "single", chunk=4) -> str:
    with pytest.raises(ConfigError) as err:
        par = paratrain.Parallel(strategy, monitor=False, model=paratrain.ModelConfig(loss_chunk=chunk))
        par.forward_backward(par.prepare(model), *args)
    assert "\n" not in str(err.value)
    return str(err.value)


@pytest.mark.filterwarnings("ignore:strategy 'dp' on the CPU")
def test_what_cannot_be_computed_at_the_head_is_refused_in_one_line():
    x, y = batch(0, 2, "loss_fn")
    smooth = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten(), label_smoothing=0.1)  # noqa: E731
    assert "it is not a plain token cross-entropy" in _refusal(build("nanogpt"), x, y, smooth)
    assert "it is not a plain token cross-entropy" in _refusal(ZLoss(), *batch(0, 2, "targets"))
    assert "got no targets for GPT2LMHeadModel" in _refusal(build("gpt2"), {"input_ids": x})
    assert "cannot have its loss computed at its head: it calls no nn.Linear" in _refusal(
        nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.Tanh()), x, y[:, 0], F.cross_entropy
    )
    assert "nn.DataParallel runs copies" in _refusal(build("gpt2"), {"input_ids": x, "labels": y}, strategy="dp")
    assert "loss_chunk must be a whole number of tokens >= 1" in _refusal(build("gpt2"), x, chunk=0)


@pytest.mark.parametrize(
    "name, says",
    [
        ("tp", "tp splits the head over the vocabulary"),
        ("pipeline", "the last stage computes the loss inside the schedule"),
    ],
)
def test_strategies_that_own_the_loss_say_why(name, says):
    assert says in create(name).head_loss_refusal()
    assert create("zero3").head_loss_refusal() is None
