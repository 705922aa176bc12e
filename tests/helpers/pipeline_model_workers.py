"""Workers for test_pipeline_models.py: real models (transformers' GPT-2, Llama and BERT, GPT-2 with PEFT LoRA adapters,
our tied GPT, nanoGPT's GPT with its own loss) cut into pipeline stages, many cases per launched job, and the same
training in one plain process for reference."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.model import find_ties

VOCAB, SEQ, HIDDEN, GLOBAL_BATCH, STEPS, LR, CLASSES = 65, 8, 32, 16, 3, 0.1, 3
OWN_LOSS = {"nanogpt"}
"""Families trained on the loss their forward computes (``model(x, y) -> (logits, loss)``), not on :func:`loss_fn`."""


def build(family: str, layers: int = 4) -> nn.Module:
    """A tiny model from a config (nothing downloaded), the same on every rank."""
    torch.manual_seed(0)
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        return GPT2LMHeadModel(
            GPT2Config(
                n_embd=HIDDEN,
                n_layer=layers,
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
    if family == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(
            LlamaConfig(
                hidden_size=HIDDEN,
                intermediate_size=64,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=0,
            )
        )
    if family == "bert":  # an embedding block doing more than a lookup; a classifier on the pooled output
        from transformers import BertConfig, BertForSequenceClassification

        return BertForSequenceClassification(
            BertConfig(
                hidden_size=HIDDEN,
                intermediate_size=64,
                num_hidden_layers=layers,
                num_attention_heads=4,
                vocab_size=VOCAB,
                max_position_embeddings=SEQ,
                num_labels=CLASSES,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    if family == "lora":  # adapters inside every block's attention and MLP, the base model frozen
        import warnings

        from peft import LoraConfig, get_peft_model

        base = build("gpt2", layers)
        torch.manual_seed(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fan_in_fan_out with Conv1D
            model = get_peft_model(
                base,
                LoraConfig(
                    r=4,
                    lora_alpha=8,
                    target_modules=["c_attn", "c_proj", "c_fc"],
                    lora_dropout=0.0,
                    fan_in_fan_out=True,
                ),
            )
        for name, p in model.named_parameters():  # B starts at zero; make the adapters matter from step one
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        return model
    if family == "nanogpt":  # reads its input's shape (``b, t = idx.size()``); keeps the last position without targets
        from helpers.nanogpt_shaped import GPT as NanoGPT
        from helpers.nanogpt_shaped import GPTConfig as NanoConfig

        return NanoGPT(NanoConfig(block_size=SEQ, vocab_size=VOCAB, n_layer=layers, n_head=4, n_embd=HIDDEN))
    if family == "seq":  # an nn.Sequential, cut between its layers as before
        return nn.Sequential(
            nn.Embedding(VOCAB, HIDDEN),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.Tanh(),
            nn.Linear(HIDDEN, VOCAB),
        )
    from paratrain.workloads.gpt import GPT, GPTConfig

    return GPT(GPTConfig(layers=layers, hidden=HIDDEN, heads=4, seq_len=SEQ, vocab=VOCAB))


def loss_fn(out: object, y: torch.Tensor) -> torch.Tensor:
    """Written for the plain model's output: a ModelOutput's ``logits``, or our GPT's tensor; a sequence classifier's
    (BERT's) target is each sample's first next token, modulo the classes."""
    logits = out.logits if hasattr(out, "logits") else out
    if logits.dim() == 2:
        return F.cross_entropy(logits, y[:, 0] % CLASSES)
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def family_loss(family: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The loss ``family`` trains on, from a forward of ``model`` (the plain model, or a pipeline's forward)."""
    if family in OWN_LOSS:
        return model(x, y)[1]
    return loss_fn(model(x), y)


def batches(steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, VOCAB, (steps * GLOBAL_BATCH, SEQ), generator=g)
    return x, torch.roll(x, -1, dims=1)


@functools.cache
def serial(family: str, accumulate: int = 1, clip: float | None = None, steps: int = STEPS, bf16: bool = False) -> dict:
    """The same training in one plain PyTorch process (under bf16 autocast with ``bf16``): the reference every case
    is compared with, computed once per arguments in a test process (read it, never change it)."""
    model = build(family)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, foreach=True)
    x, y = batches(steps)
    micro = GLOBAL_BATCH // accumulate
    norms = []
    for s in range(steps):
        for a in range(accumulate):
            lo = s * GLOBAL_BATCH + a * micro
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = family_loss(family, model, x[lo : lo + micro], y[lo : lo + micro])
            (loss / accumulate).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        output = model(batches(1)[0][:4])
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms, "output": output}


def _train(
    par: paratrain.Parallel,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    first: int,
    last: int,
    loss: Callable | None = loss_fn,
) -> None:
    """Optimizer steps ``first`` … ``last``-1; each replica reads its slice of each micro-batch (``loss`` None: the
    model's own)."""
    x, y = batches(last)
    replicas, r = par.data_parallel_size, par.data_parallel_rank
    micro = GLOBAL_BATCH // par.accumulate
    share = micro // replicas
    for s in range(first, last):
        for a in range(par.accumulate):
            lo = s * GLOBAL_BATCH + a * micro + r * share
            with par.step(model, opt):
                if loss is None:
                    par.forward_backward(model, x[lo : lo + share], y[lo : lo + share])
                else:
                    par.forward_backward(model, x[lo : lo + share], y[lo : lo + share], loss)


def _case(
    family: str, strategy: str, options: dict, accumulate: int, clip: float | None, resume: bool | str, ckpt: str
) -> dict:
    par = paratrain.Parallel(strategy, accumulate=accumulate, clip_grad_norm=clip, monitor=False, **options)
    plain = build(family)
    model, opt = par.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9, foreach=True))
    held = {id(p) for p in model.parameters()}
    in_opt = [id(p) for g in opt.param_groups for p in g["params"]]
    norms = []
    seen: set[str] = set()  # the logits the loss got: type and placements (vocabulary-split under tp)

    def watched(out: object, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        seen.add(f"{type(logits).__name__}{tuple(getattr(logits, 'placements', ()))}")
        return loss_fn(out, y)

    loss = None if family in OWN_LOSS else loss_fn
    if resume:  # two steps, save, one more; then a fresh job loads and takes the third step again
        if isinstance(resume, str):  # the first two steps under another strategy (ddp), the last under this one
            par.close()
            par = paratrain.Parallel(resume, accumulate=accumulate, clip_grad_norm=clip, monitor=False)
            plain = build(family)
            model, opt = par.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9, foreach=True))
        _train(par, model, opt, 0, 2, loss)
        folder = par.save(ckpt)
        _train(par, model, opt, 2, STEPS, loss)
        uninterrupted = par.full_state_dict(model, rank0_only=False)
        par.close()
        par = paratrain.Parallel(strategy, accumulate=accumulate, clip_grad_norm=clip, monitor=False, **options)
        plain = build(family)
        model, opt = par.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9, foreach=True))
        par.load(folder)
        _train(par, model, opt, 2, STEPS, loss)
    else:
        uninterrupted = None
        for s in range(STEPS):
            _train(par, model, opt, s, s + 1, loss and watched)
            norms.append(par.last_grad_norm)
    state = par.full_state_dict(model, rank0_only=False)
    stepped = sum(1 for s in getattr(opt, "optim", opt).state.values() if s)  # ZeRO-1: its partition's
    two_line = _two_line(par, model, family) if not resume else None
    broken = find_ties(build(family)).broken(model)
    model.eval()  # reaches the stages' copies of the model's root too
    evaluating = not any(m.training for _, part in model.parts for m in part.modules())
    output = model(batches(1)[0][:4])  # forward only: the plain model's kind of output, on every rank
    par.close()
    return {
        "state": state,
        "uninterrupted": uninterrupted,
        "norms": norms,
        "broken": broken,
        "output": output,
        "optimizer_once": sorted(in_opt) == sorted(held) and len(set(in_opt)) == len(in_opt),
        "evaluating": evaluating,
        "seen": sorted(seen),
        "stepped": stepped,
        "two_line": two_line,
        "trainable": sum(1 for p in model.parameters() if p.requires_grad),
    }


def _two_line(par: paratrain.Parallel, model: nn.Module, family: str) -> str:
    """What the two-line form (``loss = loss_fn(model(x), y); par.backward(loss)``) does under a pipeline: the
    one-line error naming ``forward_backward``, or ``"ran"``."""
    x, y = batches(1)
    try:
        par.backward(family_loss(family, model, x[:4], y[:4]))
    except paratrain.ConfigError as err:
        return str(err)
    return "ran"


def run_cases(cases: list[tuple]) -> dict[str, dict]:
    """Every case one after another on one process group (each ``Parallel`` uses it and leaves it)."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # a compiled case: no worker pool outliving the job
    dist.init_process_group("gloo")
    out = {}
    with tempfile.TemporaryDirectory() as scratch:
        shared = [scratch]
        dist.broadcast_object_list(shared, src=0)  # one checkpoint folder for every rank
        for i, (name, family, strategy, options, accumulate, clip, resume) in enumerate(cases):
            out[name] = _case(family, strategy, options, accumulate, clip, resume, f"{shared[0]}/{i}")
        finish_group()
    return out


def lean_precision(family: str, strategy: str) -> dict:
    """``family`` trained under bf16-mixed by ``strategy``: the dtype and autocast state each loss call saw, the
    parameters after ``STEPS`` steps and the dtype of the loss handed back; inside a job's group
    (``helpers.cases.each_call``)."""
    par = paratrain.Parallel(strategy, precision="bf16-mixed", monitor=False)
    plain = build(family)
    model, opt = par.prepare(plain, torch.optim.SGD(plain.parameters(), lr=LR, momentum=0.9, foreach=True))
    seen = []

    def watched(out: object, y: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        seen.append((logits.dtype, torch.is_autocast_enabled("cpu")))
        return loss_fn(out, y)

    x, y = batches(STEPS)
    for s in range(STEPS):
        with par.step(model, opt):
            loss = par.forward_backward(
                model,
                x[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH],
                y[s * GLOBAL_BATCH : (s + 1) * GLOBAL_BATCH],
                watched,
            )
    state = par.full_state_dict(model, rank0_only=False)
    par.close()
    return {"seen": sorted(set(seen), key=str), "state": state, "loss": str(loss.dtype)}
