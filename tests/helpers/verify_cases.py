"""Factories for ``paratrain verify`` tests: a correct setup, and one with each bug verify must name.

Every factory builds what a training script would; the planted bug sits where users put it (the loop, the
model, the seeding), not in a flag.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from paratrain.verify import VerifySpec, paratrain_loop


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _spec(model: nn.Module, **kwargs: object) -> VerifySpec:
    kwargs = {"loss": F.cross_entropy, **kwargs}
    return VerifySpec(
        model=model,
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        loader=DataLoader(_data(), batch_size=8, shuffle=True),
        **kwargs,
    )


def good() -> VerifySpec:
    torch.manual_seed(0)
    return _spec(_model())


def good_accumulating() -> VerifySpec:
    torch.manual_seed(0)
    return _spec(_model(), accumulate=2)


def global_batch() -> VerifySpec:
    """The global batch stated once (Parallel(global_batch=32)): 8 samples x 2 replicas x 2 micro-steps."""
    torch.manual_seed(0)
    return _spec(_model(), options={"global_batch": 32})


def _mnist_like(optimizer: object, n: int = 128, norm: bool = False, **kwargs: object) -> VerifySpec:
    """pytorch/examples' mnist/main.py in small, dropout off: two convolutions, max-pooling, two linear layers.
    ``norm``: a per-channel GroupNorm after the first convolution, which keeps its bias: a bias the norm subtracts
    again has a gradient of exactly zero in exact arithmetic, so in floats it is pure rounding noise."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(n, 1, 12, 12, generator=g), torch.randint(0, 10, (n,), generator=g))
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.GroupNorm(8, 8) if norm else nn.Identity(),
        nn.ReLU(),
        nn.Conv2d(8, 16, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(1),
        nn.Linear(16 * 4 * 4, 32),
        nn.ReLU(),
        nn.Linear(32, 10),
        nn.LogSoftmax(1),
    )
    return VerifySpec(
        model=model, optimizer=optimizer, loss=F.nll_loss, loader=DataLoader(data, batch_size=8, shuffle=True), **kwargs
    )


def adamw() -> VerifySpec:
    """Correct, with AdamW, which divides by the square root of the second moments: where a gradient is rounding
    noise (the GroupNorm'd bias) each step moves by up to lr whatever the noise, so two correct runs part by 1e-4."""
    return _mnist_like(lambda p: torch.optim.AdamW(p, lr=1e-3), norm=True)


def adadelta() -> VerifySpec:
    """Correct, with mnist/main.py's Adadelta (lr 1.0)."""
    return _mnist_like(lambda p: torch.optim.Adadelta(p, lr=1.0))


def scheduled() -> VerifySpec:
    """Correct: mnist/main.py's loop, its StepLR stepped once an epoch inside the user's loop."""

    def train(par, model, optimizer, loader, loss):
        loader = par.prepare_loader(loader)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        for _ in par.epochs(sys.maxsize):
            for x, y in loader:
                with par.step(model, optimizer):
                    par.forward_backward(model, x, y, loss)
            scheduler.step()

    return _mnist_like(lambda p: torch.optim.Adadelta(p, lr=1.0), n=64, train=train)


def unsharded() -> VerifySpec:
    """The loop iterates the loader as built: every rank reads the whole dataset."""

    def train(par, model, optimizer, loader, loss):
        for _ in par.epochs(sys.maxsize):
            for x, y in loader:
                with par.step(model, optimizer):
                    par.forward_backward(model, x, y, loss)

    torch.manual_seed(0)
    return _spec(_model(), train=train)


def no_reshuffle() -> VerifySpec:
    """The loop shards the loader but counts epochs itself, so the sampler never hears of a new epoch."""

    def train(par, model, optimizer, loader, loss):
        loader = par.prepare_loader(loader)
        for _ in range(sys.maxsize):
            for x, y in loader:
                with par.step(model, optimizer):
                    par.forward_backward(model, x, y, loss)

    torch.manual_seed(0)
    return _spec(_model(), train=train)


def undivided() -> VerifySpec:
    """Accumulation over 2 micro-batches with a plain ``loss.backward()``: gradients come out twice too big."""

    def train(par, model, optimizer, loader, loss):
        loader = par.prepare_loader(loader)
        for _ in par.epochs(sys.maxsize):
            for x, y in loader:
                with par.step(model, optimizer):
                    loss(model(x), y).backward()

    torch.manual_seed(0)
    return _spec(_model(), accumulate=2, train=train)


def batchnorm() -> VerifySpec:
    """A plain BatchNorm: each rank normalises with its own micro-batch's statistics."""
    torch.manual_seed(0)
    return _spec(nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)))


def batchnorm_accumulating() -> VerifySpec:
    """BatchNorm with accumulation: each micro-batch is normalised alone, one process normalises the global batch."""
    torch.manual_seed(0)
    return _spec(nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 4)), accumulate=2)


def dropout() -> VerifySpec:
    """Dropout left on: after prepare each rank draws its own masks, so no parallel run equals one process."""
    torch.manual_seed(0)
    return _spec(nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.2), nn.Linear(32, 4)))


def rank_seeded() -> VerifySpec:
    """Seeded with the rank before the model is built: every rank starts from other weights."""
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")))
    return _spec(_model())


def _gpt2_spec(**kwargs: object) -> VerifySpec:
    from helpers.zoo import ZOO, _lm_loss, _tokens

    x, y = _tokens(32, torch.Generator().manual_seed(1))
    return VerifySpec(
        model=ZOO["gpt2"].build(),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        loss=_lm_loss,
        loader=DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True),
        **kwargs,
    )


def gpt2() -> VerifySpec:
    """transformers' GPT-2 with its tied head (tests/helpers/zoo.py)."""
    return _gpt2_spec()


def gpt2_bf16() -> VerifySpec:
    """GPT-2 under bf16 autocast, accumulating 2 micro-batches (a model tensor parallelism splits)."""
    return _gpt2_spec(accumulate=2, options={"precision": "bf16-mixed"})


def split_tie() -> VerifySpec:
    """GPT-2 whose head gets a weight of its own after prepare in the parallel run only — what FSDP2 on torch 2.11
    did to tied weights: the head is no longer the embedding and no optimizer trains it."""

    def train(par, model, optimizer, loader, loss):
        if par.world_size > 1:
            head = par.unwrap(model).lm_head
            head.weight = nn.Parameter(head.weight.detach().clone())
        paratrain_loop(par, model, optimizer, loader, loss)

    return _gpt2_spec(train=train)


NANOGPT_CLIP = 0.05
"""Below the gradient norm of nanogpt()'s first steps: the clip changes every update, so a run without it differs."""


NANOGPT_MLP_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def _nanogpt(**options: object) -> VerifySpec:
    """nanoGPT's model as its train.py trains it: the loss computed inside ``forward(idx, targets)``, AdamW over
    ``configure_optimizers``' decay and no-decay groups, the gradient norm clipped and the seed given to Parallel."""
    from realcode.nanogpt_model import GPT, GPTConfig

    torch.manual_seed(1337)
    model = GPT(GPTConfig(block_size=16, vocab_size=48, n_layer=2, n_head=2, n_embd=32))
    ids = torch.randint(0, 48, (32, 17), generator=torch.Generator().manual_seed(1))
    return VerifySpec(
        model=model,
        loss=None,
        optimizer_from_model=lambda m: m.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu"),
        loader=DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=4, shuffle=True),
        options={"clip_grad_norm": NANOGPT_CLIP, "seed": 1337, **options},
    )


def nanogpt() -> VerifySpec:
    return _nanogpt()


def nanogpt_mlp_plan() -> VerifySpec:
    """nanoGPT with a tensor-parallel plan of its own (a strategy option: the parallel run alone gets it)."""
    return _nanogpt(tp_plan=NANOGPT_MLP_PLAN)


def gpt2_labels() -> VerifySpec:
    """transformers' GPT-2 computing its own loss from ``labels=`` (the token ids; it shifts them itself)."""
    from helpers.zoo import SEQ, VOCAB, ZOO

    ids = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(1))
    return VerifySpec(
        model=ZOO["gpt2"].build(),
        loss=None,
        target_keyword="labels",
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        loader=DataLoader(TensorDataset(ids, ids), batch_size=4, shuffle=True),
    )


def clipped_in_parallel_only() -> VerifySpec:
    """An option that reaches one run only: the gradient norm is clipped in the launched processes (RANK is set
    there), not in the reference — what verify would compare if it dropped the spec's options there."""
    torch.manual_seed(0)
    return _spec(_model(), options={"clip_grad_norm": 0.05} if "RANK" in os.environ else {})


def tp_in_options() -> VerifySpec:
    """A tensor-parallel degree in the spec, which a command's --tp may contradict."""
    torch.manual_seed(0)
    return _spec(_model(), options={"tp": 2})


def no_loss() -> VerifySpec:
    """loss=None for a model whose forward takes no targets: it cannot compute a loss of its own."""
    torch.manual_seed(0)
    return _spec(_model(), loss=None)


def not_a_spec() -> dict:
    return {}


def mixtral_aux(moe_aux_loss: str = "local") -> VerifySpec:
    """A tiny Mixtral whose loss from ``labels=`` includes its router's load-balancing loss, each rank's own unless
    ``moe_aux_loss="global"``."""
    from helpers.moe_models import tiny_mixtral
    from helpers.zoo import SEQ, VOCAB

    ids = torch.randint(0, VOCAB, (32, SEQ), generator=torch.Generator().manual_seed(1))
    return VerifySpec(
        model=tiny_mixtral(aux_loss=0.1),
        loss=None,
        target_keyword="labels",
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
        loader=DataLoader(TensorDataset(ids, ids), batch_size=4, shuffle=True),
        options={} if moe_aux_loss == "local" else {"moe_aux_loss": moe_aux_loss},
    )


def mixtral_aux_global() -> VerifySpec:
    return mixtral_aux("global")


# ---------------------------------------------------------------------------------------------------------------
# A GPT-2 script's shape: a loader class of its own (random offsets into one token tensor, no DataLoader), micro-steps
# in `range(par.accumulate)`, the gradient norm clipped at 1.0. The correct loop, and each bug users plant in it.
OWN_VOCAB, OWN_BLOCK, OWN_BATCH = 32, 8, 4


class TokenLoader:
    """Draws ``batch`` windows of ``block`` tokens at random offsets (``torch.randint``) into one token tensor, as
    GPT-2 training scripts do; ``seed`` makes each replica's draws its own."""

    def __init__(self, tokens: torch.Tensor, seed: int) -> None:
        self.tokens = tokens
        self.generator = torch.Generator().manual_seed(seed)

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        offsets = torch.randint(len(self.tokens) - OWN_BLOCK - 1, (OWN_BATCH,), generator=self.generator)
        x = torch.stack([self.tokens[i : i + OWN_BLOCK] for i in offsets.tolist()])
        y = torch.stack([self.tokens[i + 1 : i + OWN_BLOCK + 1] for i in offsets.tolist()])
        return x, y


def _token_model() -> nn.Module:
    """A tiny language model: embedding, an MLP, the head (cheap; the loader is what is being checked)."""
    width = 32
    return nn.Sequential(
        nn.Embedding(OWN_VOCAB, 16),
        nn.Linear(16, width),
        nn.Tanh(),
        nn.Linear(width, width),
        nn.Tanh(),
        nn.Linear(width, OWN_VOCAB),
    )


def _lm_mean(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _lm_sum(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum")


def _own_loop(bug: str | None, accumulate: int):
    """The script's loop: each replica seeds its draws with its data-parallel rank (``same_offsets``: it does not);
    ``par.backward`` divides by the accumulation count (``undivided``: a bare backward; ``double``: the script's
    own ``/ grad_accum_steps`` kept beside it)."""
    grad_accum_steps = accumulate

    def train(par, model, optimizer, loader, loss):
        tokens = torch.randint(0, OWN_VOCAB, (4096,), generator=torch.Generator().manual_seed(7))
        data = TokenLoader(tokens, seed=1234 + (0 if bug == "same_offsets" else par.data_parallel_rank))
        while True:
            for _micro_step in range(par.accumulate):
                x, y = data.next_batch()
                with par.step(model, optimizer):
                    value = loss(model(x.to(par.device)), y.to(par.device))
                    if bug == "double":
                        value = value / grad_accum_steps
                    if bug == "undivided":
                        value.backward()
                    else:
                        par.backward(value)

    return train


def _options(clip: bool, precision: str) -> dict[str, object]:
    """The script's Parallel keywords: its clip, and its precision unless fp32."""
    return {**({"clip_grad_norm": 1.0} if clip else {}), **({} if precision == "fp32" else {"precision": precision})}


def _own(bug: str | None = None, accumulate: int = 2, clip: bool = True, precision: str = "fp32") -> VerifySpec:
    torch.manual_seed(100 + int(os.environ.get("RANK", "0")) if bug == "rank_seeded" else 0)
    return VerifySpec(
        model=_token_model(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        loss=_lm_sum if bug == "summed" else _lm_mean,
        loader=None,  # the loop has a loader of its own
        accumulate=accumulate,
        train=_own_loop(bug, accumulate),
        options=_options(clip, precision),
    )


OWN_CASES = {  # factory -> (bug, accumulate, clip)
    "own_loader": (None, 2, True),
    "own_loader_a4": (None, 4, True),
    "own_loader_a1": (None, 1, True),
    "own_undivided": ("undivided", 2, True),
    "own_undivided_a4": ("undivided", 4, True),
    "own_undivided_unclipped": ("undivided", 2, False),
    "own_double": ("double", 4, True),
    "own_double_a2": ("double", 2, True),
    "own_summed": ("summed", 2, True),
    "own_summed_a1": ("summed", 1, True),
    "own_summed_a4_unclipped": ("summed", 4, False),
    "own_same_offsets": ("same_offsets", 2, True),
    "own_rank_seeded": ("rank_seeded", 2, True),
}
for _name, (_bug, _accumulate, _clip) in OWN_CASES.items():
    globals()[_name] = functools.partial(_own, _bug, _accumulate, _clip)
    globals()[f"{_name}_bf16"] = functools.partial(_own, _bug, _accumulate, _clip, "bf16-mixed")


def good_bf16(accumulate: int = 2) -> VerifySpec:
    """Correct, under bf16 autocast (the precision of GPT-2 scripts): each rank's micro-batches round otherwise than
    one process's global batch, by far more than fp32's rounding."""
    torch.manual_seed(0)
    return _spec(_model(), accumulate=accumulate, options={"precision": "bf16-mixed"})


def good_bf16_a1() -> VerifySpec:
    return good_bf16(1)


def good_bf16_true() -> VerifySpec:
    """Correct, with bf16 parameters: par.forward_backward hands back a bf16 loss."""
    torch.manual_seed(0)
    return _spec(_model(), accumulate=2, options={"precision": "bf16-true"})


def own_unsharded(precision: str = "fp32") -> VerifySpec:
    """The same shape reading a DataLoader the loop never shards: micro-steps in ``range(par.accumulate)``."""

    def batches(loader):
        while True:
            yield from loader

    def train(par, model, optimizer, loader, loss):
        data = batches(loader)
        while True:
            for _micro_step in range(par.accumulate):
                x, y = next(data)
                with par.step(model, optimizer):
                    par.backward(loss(model(x), y))

    torch.manual_seed(0)
    return _spec(_model(), accumulate=2, train=train, options=_options(True, precision))


def own_unsharded_bf16() -> VerifySpec:
    return own_unsharded("bf16-mixed")
