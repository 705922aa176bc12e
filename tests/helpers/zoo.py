"""The model zoo: the kinds of models users bring, built from tiny configs (nothing is downloaded).

transformers' GPT-2 (tied head), Llama (grouped-query attention, rotary embeddings, untied), BERT for sequence
classification (a ``ModelOutput``), a PEFT LoRA adapter over GPT-2 (frozen base, optimizer over the adapters
only), our own nanoGPT-style GPT (tied head, decay / no-decay parameter groups), a CNN with BatchNorm and an MLP
with frozen layers. Each entry builds the same initial model on every call and says how to make a batch, a loss
and an optimizer, so a test can train it once in one plain process and once under a strategy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

VOCAB, SEQ, HIDDEN = 65, 8, 32


@dataclass(frozen=True)
class ZooModel:
    name: str
    build: Callable[[], nn.Module]
    """A fresh model with the same initial weights on every call."""
    inputs: Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    """(x, target) for a batch of n samples."""
    loss: Callable[[object, torch.Tensor], torch.Tensor]
    """loss(model(x), target)."""
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    batch_norm: bool = False
    """Statistics are per forward pass, so a replica's slice normalises differently from the global batch."""
    labels: bool = False
    """The model computes its loss itself from ``labels=`` (transformers' causal-LM loss, with the router's
    load-balancing loss where the config asks for it); ``loss`` then reads it from the output."""

    def forward(self, model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> object:
        """The model's output on ``x``, with ``labels=target`` where the model computes its own loss."""
        return model(x, labels=target) if self.labels else model(x)


def _quiet_transformers() -> None:
    logging.getLogger("transformers").setLevel(logging.ERROR)


def _tokens(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (n, SEQ + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _lm_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def _sgd(model: nn.Module, foreach: bool | None = True) -> torch.optim.Optimizer:
    """SGD on CUDA's default multi-tensor path (``foreach``; CPU's default is ``None``: one parameter at a time),
    so that every layout is trained here as it is on GPUs."""
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9, foreach=foreach)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    _quiet_transformers()
    torch.manual_seed(0)
    cfg = GPT2Config(
        n_layer=2,
        n_embd=HIDDEN,
        n_head=2,
        vocab_size=VOCAB,
        n_positions=SEQ,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg)


def llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    _quiet_transformers()
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
    )
    return LlamaForCausalLM(cfg)


def bert() -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    _quiet_transformers()
    torch.manual_seed(0)
    cfg = BertConfig(
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(cfg)


def _classes(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, VOCAB, (n, SEQ), generator=g), torch.randint(0, 3, (n,), generator=g)


def _bert_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits, target)


def lora() -> nn.Module:
    import warnings

    from peft import LoraConfig, get_peft_model

    base = gpt2()
    torch.manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "fan_in_fan_out is set to False but the target module is Conv1D"
        model = get_peft_model(
            base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True)
        )
    for name, p in model.named_parameters():  # LoRA's B starts at zero; make the adapters matter from step one
        if "lora_B" in name:
            nn.init.normal_(p, std=0.02)
    return model


def nanogpt() -> nn.Module:
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(layers=2, hidden=HIDDEN, heads=2, seq_len=SEQ, vocab=VOCAB))


def _decay_groups(model: nn.Module) -> torch.optim.Optimizer:
    """nanoGPT's two groups: weight decay on matrices, none on biases and norms.

    ``eps=1e-5``: the attention's key bias has a true gradient of zero (softmax ignores a constant added to every
    key), so its gradient is rounding noise of ~1e-9 that differs with the summation order; with the default
    ``eps=1e-8`` AdamW turns that noise into full +-lr steps, and even one process differs by 4e-3 from itself run
    on two slices of the batch. A larger eps makes the comparison about the strategy, not about that noise.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-5,
    )


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    )


def _images(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 1, 8, 8, generator=g), torch.randint(0, 10, (n,), generator=g)


def frozen() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))
    model[0].requires_grad_(False)
    return model


def _vectors(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(n, 16, generator=g), torch.randint(0, 4, (n,), generator=g)


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel("gpt2", gpt2, _tokens, _lm_loss, _sgd),
        ZooModel("llama", llama, _tokens, _lm_loss, _sgd),
        ZooModel("bert", bert, _classes, _bert_loss, _sgd),
        ZooModel("lora", lora, _tokens, _lm_loss, _sgd),
        ZooModel("nanogpt", nanogpt, _tokens, _lm_loss, _decay_groups),
        ZooModel("cnn", cnn, _images, lambda out, y: F.cross_entropy(out, y), _sgd, batch_norm=True),
        ZooModel("frozen", frozen, _vectors, lambda out, y: F.cross_entropy(out, y), _sgd),
    )
}


def _same_tokens(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids as both input and ``labels=`` (the model shifts them itself)."""
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    return ids, ids


def _own_loss(out: object, target: torch.Tensor) -> torch.Tensor:
    return out.loss


def _moe(name: str, build: Callable[[], nn.Module], labels: bool = False) -> ZooModel:
    return ZooModel(
        name, build, _same_tokens if labels else _tokens, _own_loss if labels else _lm_loss, _sgd, labels=labels
    )


def _moe_zoo() -> dict[str, ZooModel]:
    from helpers import moe_models as m

    return {
        z.name: z
        for z in (
            _moe("mixtral", m.tiny_mixtral, labels=True),
            _moe("qwen3_moe", m.tiny_qwen3_moe),
            _moe("qwen2_moe", m.tiny_qwen2_moe, labels=True),
            _moe("gpt_oss", m.tiny_gpt_oss),
            _moe("olmoe", m.tiny_olmoe),
            _moe("gpt_experts", m.tiny_gpt_experts),
            _moe("mixtral_aux", lambda: m.tiny_mixtral(aux_loss=0.1), labels=True),
        )
    }


MOE_ZOO: dict[str, ZooModel] = _moe_zoo()
"""Mixtures of experts (tests/helpers/moe_models.py): transformers Mixtral, Qwen3-MoE (a dense first block),
Qwen2-MoE (a shared expert), GPT-OSS (expert biases, attention sinks), OLMoE, our GPT with experts; ``mixtral_aux``
adds the router's load-balancing loss to ``labels=``'s loss."""


def _shapes() -> dict[str, ZooModel]:
    from helpers import shapes

    return {
        n: ZooModel(n, getattr(shapes, n), _tokens, _lm_loss, _sgd)
        for n in ("titan_llama", "titan_qwen3", "titan_dsv3")
    }


SHAPES: dict[str, ZooModel] = _shapes()
"""Shapes found by what their modules do (tests/helpers/shapes.py): blocks in a ModuleDict, attention behind a
wrapper with 2-D positions, experts not named ``experts`` called with tensor counts, latent attention."""
SPECS: dict[str, ZooModel] = {**ZOO, **MOE_ZOO, **SHAPES}
"""Every model of the zoo by name: the dense, the mixtures of experts and the shapes."""
