"""The context-parallel job: transformers Llama (GQA, rotary), Qwen2 (eager attention), GPT-2 (learned positions,
tied head) and paratrain's GPT under ``cp=`` with ddp, zero3 and tp, each compared by the test with one plain
process on the same global batch.

Every case trains ``STEPS`` optimizer steps on global batches of ``replicas x PER_RANK`` whole sequences (the
script hands the model whole sequences, as without cp), saving after ``STEPS - 1``; a fresh ``Parallel`` loads that
checkpoint and takes the last step again. How a step feeds the model (``mode``):

* ``labels``: the user's own loop, ``out = model(input_ids=x, labels=x)`` and ``par.backward(out.loss)``;
* ``batch``: ``par.forward_backward(model, {"input_ids": x, "attention_mask": m, "labels": y})``, with right padding
  and ignored labels, so the ranks of a cp group count different numbers of tokens;
* ``loss_fn``: ``par.forward_backward(model, x, y, loss_fn)`` with targets aligned to the inputs (some ignored);
* ``own``: ``par.forward_backward(model, x, y)`` on a model that computes its loss itself, nanoGPT's ``model(x, y)``.

A ``packed`` case trains packed documents instead (:func:`helpers.packed.run_packed`).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import sys
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from helpers import nanogpt_shaped, packed, shapes
from helpers.activations import saved_bytes
from helpers.cases import each_case
from paratrain.testing import max_abs_diff

nanogpt_model = sys.modules[nanogpt_shaped.GPT.__module__]  # tests/realcode/nanogpt_model.py
VOCAB, SEQ, STEPS, PER_RANK = 64, 16, 3, 2


def llama(kv_heads: int = 4) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=kv_heads,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(
        Qwen2Config(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="eager",
        )
    )


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=4,
            vocab_size=VOCAB,
            n_positions=SEQ,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    )


def gpt() -> nn.Module:
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, hidden=32, heads=4, seq_len=SEQ, vocab=VOCAB))


class GPTWithLoss(nn.Module):
    """paratrain's GPT computing its own loss, nanoGPT-style: ``model(x, targets) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = gpt()

    def forward(self, idx: torch.Tensor, targets: torch.Tensor, positions: torch.Tensor | None = None) -> tuple:
        logits = self.gpt(idx, positions=positions)
        return logits, lm_loss(logits, targets)


def titan(**config: object) -> Callable[[], nn.Module]:
    """A torchtitan-shaped model (helpers/shapes.py): attention found by its SDPA call, 2-D ``positions``."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        return shapes.Decoder(shapes.ShapeConfig(**config))

    return build


class InlineBlock(nn.Module):
    """A block that calls SDPA in its own forward (no attention module of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 4, 24).transpose(1, 2).chunk(3, dim=-1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2))


class InlineDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(InlineBlock() for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class MaskedAttention(nn.Module):
    """Attention calling SDPA with a mask it built for the sequence it sees: one cp cannot rebuild."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        b, s = idx.shape
        q = self.emb(idx).view(b, s, 2, 4).transpose(1, 2)
        mask = torch.ones(s, s, dtype=torch.bool, device=idx.device).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)


class NoAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)

    def forward(self, idx: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.emb(idx)


class CausalAttention(nn.Module):
    """nanoGPT's slow path made cp-ready (docs/context-parallel.md#hand-written-attention): its matmul, mask and
    softmax as an attention kernel module, q, k, v ``[b, h, s, d]`` -> ``[b, h, s, d]``, causal by itself."""

    is_attention_kernel = True

    def __init__(self, config: nanogpt_model.GPTConfig) -> None:
        super().__init__()
        self.attn_dropout = nn.Dropout(config.dropout)
        causal = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", causal.view(1, 1, config.block_size, config.block_size), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        T = q.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        return self.attn_dropout(F.softmax(att, dim=-1)) @ v


class KernelSelfAttention(nanogpt_model.CausalSelfAttention):
    """nanoGPT's ``CausalSelfAttention`` calling the kernel module where its slow path computed inline."""

    def __init__(self, config: nanogpt_model.GPTConfig) -> None:
        super().__init__(config)
        self.attention = CausalAttention(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attention(q, k, v)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class NanoGPTForCP(nanogpt_model.GPT):
    """nanoGPT's GPT with that attention and the forward's ``positions=`` cp hands each rank its slice's by (its loss
    ignoring -100, as cp counts ignored targets)."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        config = nanogpt_model.GPTConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=32)
        super().__init__(config)
        for block in self.transformer.h:
            slow = KernelSelfAttention(config)
            slow.load_state_dict(block.attn.state_dict())
            block.attn = slow

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None
    ) -> tuple:
        pos = torch.arange(0, idx.size(1), device=idx.device) if positions is None else positions
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, None if targets is None else lm_loss(logits, targets)


MODELS: dict[str, Callable[[], nn.Module]] = {
    "llama": llama,
    "qwen2": qwen2,
    "gpt2": gpt2,
    "gpt": gpt,
    "gpt_loss": GPTWithLoss,
    "titan_llama": shapes.titan_llama,
    "titan_qwen3": shapes.titan_qwen3,
    "titan_dsv3": shapes.titan_dsv3,
    # heads (and key/value heads) that tp=2 x cp=2 divide
    "titan_llama_h8": titan(heads=8, kv_heads=4),
    "titan_qwen3_h8": titan(heads=8, kv_heads=4, qk_norm=True, tied=True),
    "titan_dsv3_h8": titan(heads=8, layers=3, latent=True, experts=4),
    "inline": InlineDecoder,
    "nanogpt_kernel": NanoGPTForCP,
    # fewer key/value heads than cp: the all-gather (cp_method="auto" chooses it)
    "llama_kv1": functools.partial(llama, kv_heads=1),
    "llama_kv2": functools.partial(llama, kv_heads=2),
    "titan_llama_kv1": titan(kv_heads=1),
}


def batch(step: int, size: int, length: int = SEQ) -> dict[str, torch.Tensor]:
    """The global batch of ``step``: token ids, a right-padding mask and labels with the padding and a few more
    tokens ignored (-100), so the slices of a sequence hold different numbers of counted tokens."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (size, length + 1), generator=g)
    mask = torch.ones(size, length, dtype=torch.long)
    for i in range(size):
        mask[i, length - int(torch.randint(0, length // 2, (1,), generator=g)) :] = 0
    labels = ids[:, :-1].masked_fill(mask == 0, -100).masked_fill(torch.rand(size, length, generator=g) < 0.2, -100)
    return {
        "input_ids": ids[:, :-1],
        "attention_mask": mask,
        "labels": labels,
        "targets": ids[:, 1:].masked_fill(labels == -100, -100),
    }


def lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def step_loss(model: nn.Module, b: dict[str, torch.Tensor], mode: str) -> torch.Tensor:
    """The loss ``mode`` back-propagates for batch ``b`` in one process."""
    if mode == "labels":
        return model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
    if mode == "batch":
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"]).loss
    if mode == "own":
        return model(b["input_ids"], b["targets"])[1]
    return lm_loss(model(b["input_ids"]), b["targets"])


def _train(
    par: paratrain.Parallel, model: nn.Module, opt: torch.optim.Optimizer, mode: str, steps: range
) -> list[float]:
    size, rank, losses = par.data_parallel_size, par.data_parallel_rank, []
    for s in steps:
        b = {k: v[rank * PER_RANK : (rank + 1) * PER_RANK].to(par.device) for k, v in batch(s, size * PER_RANK).items()}
        with par.step(model, opt):
            if mode == "labels":
                loss = model(input_ids=b["input_ids"], labels=b["input_ids"]).loss
                par.backward(loss)
            elif mode == "batch":
                loss = par.forward_backward(model, {k: b[k] for k in ("input_ids", "attention_mask", "labels")})
            elif mode == "own":
                loss = par.forward_backward(model, b["input_ids"], b["targets"])
            else:
                loss = par.forward_backward(model, b["input_ids"], b["targets"], lm_loss)
        losses.append(float(par.mean(loss.detach())))
    return losses


def _prepared(name: str, strategy: str, options: dict):
    logging.getLogger("transformers").setLevel(logging.ERROR)
    par = paratrain.Parallel(strategy, monitor=False, **options)
    model = MODELS[name]()
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True))
    return par, model, opt


def run_case(name: str, strategy: str, options: dict, mode: str, folder: str) -> dict:
    par, model, opt = _prepared(name, strategy, options)
    replicas = par.data_parallel_size
    losses = _train(par, model, opt, mode, range(STEPS - 1))
    par.save(folder)
    losses += _train(par, model, opt, mode, range(STEPS - 1, STEPS))
    final = par.full_state_dict(model, rank0_only=False)
    par.close()
    par, model, opt = _prepared(name, strategy, options)
    par.load(folder)
    _train(par, model, opt, mode, range(STEPS - 1, STEPS))
    resumed = par.full_state_dict(model, rank0_only=False)
    par.close()
    return {"state": final, "losses": losses, "replicas": replicas, "resumed": max_abs_diff(final, resumed)}


@functools.cache
def reference(name: str, mode: str, replicas: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One plain process on the same global batches: each replica's slice one forward, the mean of their losses;
    computed once per arguments in a test process (read it, never change it)."""
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
    losses = []
    for s in range(STEPS):
        b = batch(s, replicas * PER_RANK)
        total = 0.0
        for r in range(replicas):
            loss = step_loss(model, {k: v[r * PER_RANK : (r + 1) * PER_RANK] for k, v in b.items()}, mode) / replicas
            loss.backward()
            total += loss.item()
        losses.append(total)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


KERNEL_REFUSALS: dict[str, tuple[Callable[[], nn.Module], dict]] = {
    "allgather kernel": (NanoGPTForCP, {"cp_method": "allgather"}),
    "allgather uneven": (titan(), {"cp_method": "allgather", "length": SEQ - 2}),
    "no attention": (NoAttention, {}),
    "attn_mask": (MaskedAttention, {}),
    "sdpa heads": (titan(kv_heads=1), {"cp_method": "ulysses"}),
    "positions shape": (titan(), {"positions": torch.arange(SEQ)[None, None]}),
}
"""Models whose attention cp finds by its kernel call, called once (what cp refuses shows on the first call)."""


def refusal(case: str) -> dict:
    """A bad input under cp: the one line it raises (each_case reports it)."""
    if case == "uneven sequence":
        _, model, _ = _prepared("llama", "ddp", {"cp": 2})
        model(input_ids=torch.zeros(1, SEQ - 1, dtype=torch.long))
    elif case == "4-D mask":
        _, model, _ = _prepared("llama", "ddp", {"cp": 2})
        model(input_ids=torch.zeros(1, SEQ, dtype=torch.long), attention_mask=torch.ones(1, 1, SEQ, SEQ))
    elif case == "heads":
        par = paratrain.Parallel("ddp", monitor=False, cp=2, cp_method="ulysses")
        par.prepare(llama(kv_heads=1))
    elif case == "tp x cp heads":
        par = paratrain.Parallel("zero3", monitor=False, cp=2, tp=2, cp_method="ulysses")
        par.prepare(shapes.titan_llama())(torch.zeros(1, SEQ, dtype=torch.long))
    elif case in KERNEL_REFUSALS:
        build, kwargs = KERNEL_REFUSALS[case]
        kwargs = dict(kwargs)
        method = kwargs.pop("cp_method", "auto")
        length = kwargs.pop("length", SEQ)
        model = paratrain.Parallel("ddp", monitor=False, cp=2, cp_method=method).prepare(build())
        model(torch.zeros(1, length, dtype=torch.long), **kwargs)
    elif case == "loss_chunk":
        par = paratrain.Parallel("ddp", monitor=False, cp=2, model=paratrain.ModelConfig(loss_chunk=8))
        model = par.prepare(llama())
        par.forward_backward(model, {"input_ids": torch.zeros(1, SEQ, dtype=torch.long)}, loss_fn=lm_loss)
    else:
        name, degree = case.split(" cp=")
        paratrain.Parallel(name, monitor=False, cp=int(degree))
    return {"error": None}


def activation_bytes(length: int) -> int:
    """Bytes autograd saves on this rank for one forward and loss of paratrain's GPT on one sequence of ``length``
    tokens, the sequence split over every rank (cp = the world size)."""
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, seq_len=length, vocab=VOCAB))
    par = paratrain.Parallel("ddp", monitor=False, cp=int(os.environ["WORLD_SIZE"]))
    model = par.prepare(model)
    x = torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))
    split = par.strategy.cp.split
    measured = saved_bytes(model, x, autocast=False, target=split.local(x))
    par.close()
    return measured


def run_cases(cases: list[tuple], tmp: str) -> dict:
    def run(i: int, case: tuple) -> dict:
        if case[0] == "refuse":
            return refusal(case[1])
        if case[0] == "activations":
            return {"bytes": activation_bytes(case[1])}
        if case[0] == "packed":  # a packed row filled up to cp's pieces (2 x cp: the all-gather's head and tail)
            _, name, strategy, options = case
            return packed.run_packed(name, strategy, options, os.path.join(tmp, str(i)), 2 * options["cp"])
        return run_case(*case, os.path.join(tmp, str(i)))

    return each_case(cases, run, key=lambda c: "/".join(str(x) for x in c))
