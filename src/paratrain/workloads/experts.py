"""The mixture-of-experts MLP of :class:`paratrain.workloads.gpt.GPT`, for the shapes ``GPTConfig.moe`` describes.

Like the rest of that module it keeps what changes parameter counts, FLOPs and activation memory, so that the
planner's closed forms (:mod:`paratrain.planner.moe`) can be held to a real module: a router, the routed experts in a
module named ``experts`` as two fused 3-D tensors (``[experts, out, in]``, as transformers holds them: what expert
parallelism splits on its first dimension), optional shared experts and their gate. Each token is computed by
exactly its top k experts (no capacity, no token dropped); there is no load-balancing loss.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..model.expert_compute import count_per_expert, expert_groups, expert_linear, grouped_mm_fits
from ..planner.moe import MoE
from ..planner.transformer import GPTConfig


def activate(z: torch.Tensor, gated: bool) -> torch.Tensor:
    """An MLP's inner activation: SwiGLU on (gate, up) pairs laid out per unit, else GELU."""
    if gated:
        gate, up = z.unflatten(-1, (-1, 2)).unbind(-1)
        return F.silu(gate) * up
    return F.gelu(z)


class Experts(nn.Module):
    """The routed experts of one block: their two matrices fused over the experts (``[experts, out, in]``, dimension
    0 the expert, as transformers' ``experts`` modules hold them: what expert parallelism splits)."""

    takes_host_counts = True
    """Its counts may come as a host list (:data:`paratrain.model.experts.TAKES_HOST_COUNTS`): expert parallelism
    then hands it the list it has read, and the loop of matmuls reads nothing more."""

    def __init__(self, experts: int, hidden: int, ffn: int, gated: bool, bias: bool) -> None:
        super().__init__()
        inner = (2 if gated else 1) * ffn
        self.gated = gated
        self.gate_up = nn.Parameter(torch.empty(experts, inner, hidden))
        self.down = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.gate_up_bias = nn.Parameter(torch.zeros(experts, inner)) if bias else None
        self.down_bias = nn.Parameter(torch.zeros(experts, hidden)) if bias else None
        for weight in (self.gate_up, self.down):  # nn.Linear's default bound, per expert
            nn.init.uniform_(weight, -1 / math.sqrt(weight.shape[-1]), 1 / math.sqrt(weight.shape[-1]))

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        """``rows`` sorted by expert, ``counts[e]`` of them expert e's (on the device, or on the host) → each row
        through its expert: grouped GEMM where the device has it, else one matmul per expert
        (:mod:`paratrain.model.expert_compute`)."""
        groups = expert_groups(rows, counts, grouped_mm_fits(rows, self.gate_up, self.down))
        z = expert_linear(rows, self.gate_up, groups, self.gate_up_bias)
        return expert_linear(activate(z, self.gated), self.down, groups, self.down_bias)


class MixtureOfExperts(nn.Module):
    """Tokens (batch, seq, hidden) → the weighted sum of their top-k experts' outputs (plus the shared experts').

    The router's softmax is taken in fp32 and its top k renormalised; the tokens are sorted by expert, each expert
    runs on its rows, and the outputs are added back in token order. Under autocast the input is cast to 16 bits
    once for the router, the experts and the shared experts alike.
    """

    def __init__(self, cfg: GPTConfig, moe: MoE) -> None:
        super().__init__()
        h = cfg.hidden
        self.top_k, self.gated = moe.top_k, cfg.gated
        self.router = nn.Linear(h, moe.experts, bias=moe.bias)
        self.experts = Experts(moe.experts, h, moe.ffn, cfg.gated, moe.bias)
        shared = (2 if cfg.gated else 1) * moe.shared
        self.shared_fc = nn.Linear(h, shared, bias=cfg.bias) if moe.shared else None
        self.shared_out = nn.Linear(moe.shared, h, bias=cfg.bias) if moe.shared else None
        self.shared_gate = nn.Linear(h, 1, bias=False) if moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        if kind != "meta" and torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        tokens = x.flatten(0, -2)
        weights, chosen = self.router(tokens).float().softmax(-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        slots = chosen.flatten().argsort(stable=True)  # each token's k slots, sorted by expert
        rows = slots // self.top_k
        counts = count_per_expert(chosen, self.router.out_features)  # on the device: read once, if at all
        routed = self.experts(tokens[rows], counts)
        routed = routed * weights.flatten()[slots, None].to(routed.dtype)
        out = routed.new_zeros(tokens.shape[0], routed.shape[-1]).index_add(0, rows, routed)
        if self.shared_fc is not None and self.shared_out is not None:
            shared = self.shared_out(activate(self.shared_fc(tokens), self.gated))
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(self.shared_gate(tokens))
            out = out + shared
        return out.view_as(x)
