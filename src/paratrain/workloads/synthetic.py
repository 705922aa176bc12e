"""The built-in benchmark workloads, on seeded random data: ``mlp``, ``cnn``, ``gpt-tiny`` and ``gpt-moe-tiny``.

They match the models of ``paratrain plan --model mlp|cnn|gpt-tiny``, so a plan and a measurement speak of the
same network. The data is noise: these measure speed, not learning.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .digits import DIGITS_TP_PLAN, digits_cnn
from .gpt import GPT, GPT_CONFIGS
from .workload import Batch, Workload


def mlp() -> nn.Sequential:
    """MLP 784-1024-1024-10 (1.86M parameters), the model of the field notes' scaling measurements."""
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _images(shape: tuple[int, ...], classes: int):
    def make_batch(samples: int, generator: torch.Generator) -> Batch:
        return (
            torch.randn(samples, *shape, generator=generator),
            torch.randint(0, classes, (samples,), generator=generator),
        )

    return make_batch


def mlp_workload() -> Workload:
    return Workload(
        name="mlp",
        model=mlp,
        loss=F.cross_entropy,
        make_batch=_images((784,), 10),
        description="MLP 784-1024-1024-10 (1.86M parameters), SGD, random 784-float inputs",
        tp_plan={"0": "colwise", "2": "rowwise"},
    )


def cnn_workload() -> Workload:
    return Workload(
        name="cnn",
        model=digits_cnn,
        loss=F.cross_entropy,
        make_batch=_images((1, 8, 8), 10),
        description="digits CNN (2 conv + 2 linear, 75k parameters), SGD, random 1x8x8 images",
        tp_plan=DIGITS_TP_PLAN,
    )


def _next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def gpt_tiny_workload(name: str = "gpt-tiny") -> Workload:
    cfg = GPT_CONFIGS[name]

    def make_batch(samples: int, generator: torch.Generator) -> Batch:
        tokens = torch.randint(0, cfg.vocab, (samples, cfg.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    experts = "" if cfg.moe is None else f", {cfg.moe.experts} experts of top {cfg.moe.top_k} per block"
    return Workload(
        name=name,
        model=lambda: GPT(cfg),
        loss=_next_token_loss,
        make_batch=make_batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
        description=f"GPT {cfg.layers} layers x {cfg.hidden} wide{experts}, {cfg.seq_len} tokens, vocab "
        f"{cfg.vocab}, AdamW, random tokens",
    )


def gpt_moe_tiny_workload() -> Workload:
    """``gpt-tiny`` with a mixture of experts in each block (``bench`` reports its all-to-all)."""
    return gpt_tiny_workload("gpt-moe-tiny")
