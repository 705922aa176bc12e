"""The chunked-loss job: every case of one world size in one launched job, and its one-process reference.

A case trains a zoo model (or nanoGPT's own, with ``model(x, y)``) for ``STEPS`` SGD steps with ``loss_chunk`` under
a strategy, on global batches of ``replicas x PER_RANK`` samples, each rank taking its slice; rank 0 returns the
final full state. The reference trains the same model in one plain process (logits whole, the model's own loss or
the ``loss_fn``), the global batch cut into the replicas' slices, the mean of their losses.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from helpers.cases import each_case
from helpers.paths import REALCODE
from helpers.zoo import SEQ, VOCAB, ZOO

STEPS, PER_RANK, CHUNK = 2, 2, 5
CALLS = ("labels", "targets", "loss_fn")
"""How a case hands its targets over: transformers' ``labels=``, nanoGPT's ``model(x, y)``, a ``loss_fn``."""


def nanogpt() -> nn.Module:
    """nanoGPT's ``model.py`` (tests/realcode): its own loss with ``ignore_index=-1``, the last position's logits
    alone without targets."""
    sys.path.insert(0, str(REALCODE))
    from nanogpt_model import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=2, n_embd=32, dropout=0.0))


def build(model_name: str) -> nn.Module:
    return nanogpt() if model_name == "nanogpt_real" else ZOO[model_name].build()


def batch(step: int, size: int, call: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and their targets, some ignored (-100, or nanoGPT's -1): for ``labels=`` the ids themselves (the
    model shifts them), else the next tokens."""
    ids = torch.randint(0, VOCAB, (size, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    x, y = ids[:, :-1], (ids[:, :-1] if call == "labels" else ids[:, 1:]).clone()
    y[:, 3] = -1 if call == "targets" else -100
    return x, y


def _lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    return ZOO["gpt2"].loss(out, target)  # the zoo's: F.cross_entropy over the flattened logits


def micro_loss(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, call: str, par: paratrain.Parallel | None = None
) -> torch.Tensor:
    """One micro-batch: through ``par.forward_backward`` when given, else plain (the reference's forward)."""
    if par is None:
        if call == "labels":
            return model(input_ids=x, labels=y).loss
        return model(x, y)[1] if call == "targets" else _lm_loss(model(x), y)
    if call == "labels":
        return par.forward_backward(model, {"input_ids": x, "labels": y})
    return par.forward_backward(model, x, y) if call == "targets" else par.forward_backward(model, x, y, _lm_loss)


def run_case(model_name: str, call: str, strategy: str, options: dict) -> dict[str, torch.Tensor]:
    par = paratrain.Parallel(strategy, monitor=False, **{"loss_chunk": CHUNK, **options})
    model = build(model_name)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    size, rank = par.data_parallel_size, par.data_parallel_rank
    for s in range(STEPS):
        x, y = batch(s, size * PER_RANK, call)
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        with par.step(model, opt):
            micro_loss(model, x[mine].to(par.device), y[mine].to(par.device), call, par)
    state = par.full_state_dict(model, rank0_only=False)
    par.close()
    return state


def run_cases(cases: list[tuple[str, str, str, dict]]) -> dict[str, dict]:
    return each_case(cases, lambda i, c: run_case(*c), key=case_key)


def case_key(case: tuple[str, str, str, dict]) -> str:
    model_name, call, strategy, options = case
    return f"{model_name}/{call}/{strategy}{options or ''}"


def reference(model_name: str, call: str, replicas: int) -> dict[str, torch.Tensor]:
    model = build(model_name)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(STEPS):
        x, y = batch(s, replicas * PER_RANK, call)
        for r in range(replicas):
            mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
            (micro_loss(model, x[mine], y[mine], call) / replicas).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def handed_back(model_name: str, call: str, strategy: str) -> dict[str, tuple[str, float]]:
    """Under bf16-mixed, the model's own loss as a script logs it: from a direct call (then ``par.backward``), and
    from ``forward_backward`` on the next step; each as (dtype, the replicas' mean), every replica taking its slice
    of one batch."""
    par = paratrain.Parallel(strategy, precision="bf16-mixed", monitor=False)
    model = build(model_name)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    size, rank = par.data_parallel_size, par.data_parallel_rank
    x, y = batch(0, 4, call)
    x, y = x[rank * 4 // size : (rank + 1) * 4 // size], y[rank * 4 // size : (rank + 1) * 4 // size]
    with par.step(model, opt):
        direct = micro_loss(model, x, y, call)
        par.backward(direct)
    with par.step(model, opt):
        returned = micro_loss(model, x, y, call, par)
    out = {"direct": direct, "returned": returned}
    out = {how: (str(loss.dtype), float(par.mean(loss.detach()))) for how, loss in out.items()}
    par.close()
    return out


def bf16_true_float_inputs(strategy: str) -> list[float]:
    """bf16-true on a model fed float inputs (not token ids): the replicas' mean loss of two steps, from
    ``forward_backward`` and from a direct call; the inputs must reach the bf16 weights in bf16 under every strategy
    (FSDP's policy casts none under bf16-true)."""
    par = paratrain.Parallel(strategy, precision="bf16-true", monitor=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
    rows = slice(
        par.data_parallel_rank * 4 // par.data_parallel_size, (par.data_parallel_rank + 1) * 4 // par.data_parallel_size
    )
    with par.step(model, opt):
        returned = par.forward_backward(model, x[rows], y[rows], F.mse_loss)
    with par.step(model, opt):
        direct = F.mse_loss(model(x[rows]), y[rows])
        par.backward(direct)
    out = [float(par.mean(loss.detach().float())) for loss in (returned, direct)]
    par.close()
    return out
