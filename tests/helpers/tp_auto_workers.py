"""Models paratrain has no tensor-parallel plan for, and the one launched job that trains each under ``tp`` with
``tp_plan="auto"`` (tests/distributed/test_tp_auto.py).

``NanoGPT`` is written as nanoGPT's ``model.py`` writes it (fused ``c_attn``, ``c_proj``, MLP ``c_fc``/``c_proj``,
``lm_head`` tied to ``wte``); ``heads_from_input=True`` keeps nanoGPT's own ``C // n_head`` (the head size from the
input's width, which no split of the attention can keep right), ``False`` reshapes by ``n_embd`` instead. Mistral
(sliding window) and Qwen2 (query/key/value biases, tied head) have grouped-query attention; the LoRA models put PEFT
adapters on every linear layer of GPT-2's blocks (``Conv1D``, fused ``c_attn``) and of Qwen2's (separate q/k/v,
SwiGLU), their ``B`` made non-zero so the adapters matter from the first step. The ``titan_*`` models are
tests/helpers/shapes.py's (blocks in a ModuleDict, attention behind a wrapper; Qwen3's query/key norms and tied head;
DeepSeek-V3's latent attention, a dense first block, then mixtures of experts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.nn import functional as F

import paratrain
from helpers.shapes import HIDDEN as SHAPE_HIDDEN
from helpers.shapes import LatentAttention, RMSNorm, ShapeConfig, titan_dsv3
from helpers.tp_workers import step_batch
from helpers.zoo import HIDDEN, SEQ, SHAPES, VOCAB, ZOO, ZooModel, _lm_loss, _sgd, _tokens
from paratrain.distributed.process_group import finish_group


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, heads_from_input: bool) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd, self.heads_from_input = n_head, n_embd, heads_from_input

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        width = C if self.heads_from_input else self.n_embd
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, width // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, width))


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc, self.gelu, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, heads_from_input: bool) -> None:
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(n_embd), CausalSelfAttention(n_embd, n_head, heads_from_input)
        self.ln_2, self.mlp = nn.LayerNorm(n_embd), MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, n_head: int = 2, n_embd: int = HIDDEN, heads_from_input: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(VOCAB, n_embd),
                wpe=nn.Embedding(SEQ, n_embd),
                h=nn.ModuleList(Block(n_embd, n_head, heads_from_input) for _ in range(2)),
                ln_f=nn.LayerNorm(n_embd),
            )
        )
        self.lm_head = nn.Linear(n_embd, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def nano(heads_from_input: bool = False) -> NanoGPT:
    torch.manual_seed(0)
    return NanoGPT(heads_from_input=heads_from_input)


def nano_input_heads() -> NanoGPT:
    """nanoGPT's own reshape (``paratrain tp-plan --model helpers.tp_auto_workers:nano_input_heads``)."""
    return nano(heads_from_input=True)


def _gqa(kind: str, heads: int = 4, kv_heads: int = 2) -> nn.Module:
    """A Mistral- or Qwen2-shaped causal LM: ``heads`` query heads sharing ``kv_heads`` key/value heads."""
    import transformers

    config, model = {"mistral": ("MistralConfig", "MistralForCausalLM"), "qwen": ("Qwen2Config", "Qwen2ForCausalLM")}[
        kind
    ]
    extra = {"sliding_window": 4, "tie_word_embeddings": False} if kind == "mistral" else {"tie_word_embeddings": True}
    torch.manual_seed(0)
    cfg = getattr(transformers, config)(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        bos_token_id=0,
        eos_token_id=0,
        **extra,
    )
    return getattr(transformers, model)(cfg)


class QueryLatentAttention(LatentAttention):
    """DeepSeek-V3's latent attention with its queries from a latent too (``q_lora_rank`` > 0): ``wq_a``, a norm,
    ``wq_b``; the key/value latent as before."""

    def __init__(self, cfg: ShapeConfig) -> None:
        super().__init__(cfg)
        del self.wq
        self.wq_a = nn.Linear(SHAPE_HIDDEN, self.RANK, bias=False)
        self.q_norm = RMSNorm(self.RANK)
        self.wq_b = nn.Linear(self.RANK, cfg.heads * (self.NOPE + self.ROPE), bias=False)

    def wq(self, x: torch.Tensor) -> torch.Tensor:
        return self.wq_b(self.q_norm(self.wq_a(x)))


def titan_dsv3_query_latent() -> nn.Module:
    """tests/helpers/shapes.py's DeepSeek-V3 with :class:`QueryLatentAttention` in every block."""
    model = titan_dsv3()
    torch.manual_seed(1)
    cfg = ShapeConfig(layers=3, latent=True, experts=4)
    for block in model.layers.values():
        block.attention = QueryLatentAttention(cfg)
    return model


def with_lora(base: nn.Module, targets: list[str], conv1d: bool = False) -> nn.Module:
    """``base`` with LoRA adapters (rank 4) on ``targets``, their ``B`` non-zero."""
    import warnings

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, fan_in_fan_out=conv1d)
        )
    for name, p in model.named_parameters():
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    return model


STEPS = 2
"""Optimizer steps a case trains: the first makes the optimizer's state, the second updates the replicated parameters
on their local tensors (what the tests watch)."""

_PER_PARAMETER = functools.partial(_sgd, foreach=None)
"""SGD on CPU's default path, one parameter at a time: the one where replicated parameters step on their local
tensors (paratrain.distributed.tensor_parallel.local_step), which these tests watch; the zoo's is CUDA's."""


def _spec(name: str, build: Any) -> ZooModel:
    return ZooModel(name, build, _tokens, _lm_loss, _PER_PARAMETER)


MODELS: dict[str, ZooModel] = {
    "nano": _spec("nano", nano),
    "nano_input_heads": _spec("nano_input_heads", nano_input_heads),
    **{name: dataclasses.replace(ZOO[name], optimizer=_PER_PARAMETER) for name in ("gpt2", "llama", "bert")},
    **{name: dataclasses.replace(spec, optimizer=_PER_PARAMETER) for name, spec in SHAPES.items()},
    "titan_dsv3_query_latent": _spec("titan_dsv3_query_latent", titan_dsv3_query_latent),
    "mistral": _spec("mistral", lambda: _gqa("mistral")),
    "qwen": _spec("qwen", lambda: _gqa("qwen")),
    "nano4": _spec("nano4", lambda: (torch.manual_seed(0), NanoGPT(n_head=4))[1]),  # tp=4 splits whole heads
    "qwen8": _spec("qwen8", lambda: _gqa("qwen", heads=8, kv_heads=4)),
    "lora_gpt2": _spec("lora_gpt2", lambda: with_lora(ZOO["gpt2"].build(), ["c_attn", "c_proj", "c_fc"], True)),
    "lora_qwen": _spec(
        "lora_qwen",
        lambda: with_lora(_gqa("qwen"), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    ),
}


def train(spec: ZooModel, model: nn.Module, opt: torch.optim.Optimizer, par: Any = None) -> None:
    """``STEPS`` steps on the full batch: under ``par`` (each replica its slice, read by every rank of its tp
    group), or plainly."""
    for s in range(STEPS):
        x, y = step_batch(spec, s)
        if par is not None and par.data_parallel_size > 1:
            per, rank = len(x) // par.data_parallel_size, par.data_parallel_rank
            x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        if par is None:
            spec.loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            continue
        with par.step(model, opt):
            par.forward_backward(model, x, y, spec.loss)


def _watch_norms(model: nn.Module) -> dict[str, list]:
    """Records, at every call of the model's norms, whether their forward sees plain local weights (the replicated
    style's fast path) instead of DTensors."""
    seen: dict[str, list] = {"local": [], "modules": [m for m in model.modules() if "Norm" in type(m).__name__]}
    for module in seen["modules"]:
        module.register_forward_pre_hook(
            lambda m, args: seen["local"].append(not any(isinstance(p, DTensor) for p in m.parameters(recurse=False)))
        )
    return seen


def _watch_optimizer(opt: torch.optim.Optimizer) -> list[bool]:
    """Records, at every optimizer step, whether it updates some parameters as plain local tensors (the replicated
    ones, paratrain.distributed.tensor_parallel.local_step) instead of DTensors."""
    local: list[bool] = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: local.append(
            any(not isinstance(p, DTensor) for g in o.param_groups for p in g["params"])
        )
    )
    return local


def _holds_dtensors(opt: torch.optim.Optimizer) -> bool:
    """Between steps the optimizer holds DTensors only: parameters and their state (what checkpoints read)."""
    return all(isinstance(p, DTensor) for g in opt.param_groups for p in g["params"]) and all(
        isinstance(v, DTensor)
        for state in opt.state.values()
        for v in state.values()
        if isinstance(v, torch.Tensor) and v.dim()
    )


def run_auto(cases: list[tuple], strategy: str = "tp", options: dict | None = None) -> dict[str, Any]:
    """Each case (model, ``tp_plan``) under ``Parallel(strategy, **options)``, or (model, ``tp_plan``, (strategy,
    options)) under its own layout, keyed ``model/strategy`` then: the final full state, what this rank printed
    and the paratrain warnings it raised while preparing; a paratrain error as its one line."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, plan, *layout in cases:
        spec = MODELS[name]
        how, kwargs = layout[0] if layout else (strategy, options or {})
        key = f"{name}/{how}" if layout else name
        printed = io.StringIO()
        try:
            par = paratrain.Parallel(how, monitor=False, **kwargs, **({} if plan is None else {"tp_plan": plan}))
            model = spec.build()
            with contextlib.redirect_stdout(printed), warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                model, opt = par.prepare(model, spec.optimizer(model))
            norms, local_steps = _watch_norms(model), _watch_optimizer(opt)
            train(spec, model, opt, par)
            out[key] = {
                "state": par.full_state_dict(model, rank0_only=False),
                "printed": printed.getvalue(),
                "warned": [str(w.message) for w in caught if "tp_plan='auto'" in str(w.message)],
                "norms": {
                    "local": all(norms["local"]) and bool(norms["local"]),
                    "dtensors": all(
                        isinstance(p, DTensor) and isinstance(p.grad, (DTensor, type(None)))
                        for m in norms["modules"]
                        for p in m.parameters()
                    ),
                },
                "optimizer": {"local_steps": local_steps, "dtensors": _holds_dtensors(opt)},
            }
            par.close()
        except paratrain.ParatrainError as err:
            out[key] = {"error": str(err), "printed": printed.getvalue()}
    finish_group()
    return out
