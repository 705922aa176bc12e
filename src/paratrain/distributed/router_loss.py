"""A mixture of experts' load-balancing (auxiliary) loss as one process computes it on the global batch.

transformers' MoE models (Mixtral, Qwen2/3-MoE, OLMoE, GPT-OSS …) add ``router_aux_loss_coef x aux`` to the loss
of ``labels=`` when ``output_router_logits`` is on; ``aux = E x sum_e f_e x P_e`` (Switch Transformer), with ``f_e``
the share of the top-k assignments that went to expert ``e`` and ``P_e`` its mean router probability, both over
every token of every MoE block (``load_balancing_loss_func``). Under data parallelism each rank computes it on its
own slice: its ``f`` is not the global batch's, so neither is the loss nor its gradient.

``moe_aux_loss="global"`` makes it the global batch's, as Megatron-LM's ``global_aux_loss`` does: the per-expert
assignment counts and the token count (no gradient flows through them) are summed over the data-parallel ranks, one
all-reduce of ``E + 1`` numbers per forward, and each rank's loss is ``E x sum_e f_global_e x P_e`` where ``P_e`` is
the rank's probability sum over the global token count times the replicas. The mean over the ranks, which data
parallelism's gradient averaging takes, is then the single-process loss, gradients included, also when padding
(``attention_mask``) leaves the ranks unequal token counts. With accumulation it is each micro-batch's loss over the
ranks' micro-batches of that step, as one process running the same micro-batches computes it.

The model's own computation stays: a forward hook (ahead of any other) recomputes the loss from the
``router_logits`` the model returns and puts it in ``aux_loss``, moving ``loss`` by the coefficient times the
difference, so the model's code, its loss function and its output are left as they are.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..errors import ConfigError

MODES = ("local", "global")
"""``moe_aux_loss=``: the model's own per-rank loss, or the global batch's."""


def router_loss(model: nn.Module) -> str | None:
    """How ``model`` adds a router load-balancing loss to its own (words for a report), None when it adds none."""
    config = getattr(model, "config", None)
    coef = getattr(model, "router_aux_loss_coef", 0.0)
    if getattr(config, "output_router_logits", False) and coef and hasattr(model, "num_experts_per_tok"):
        return f"output_router_logits=True, router_aux_loss_coef={coef}"
    return None


def load_balancing_loss(
    router_logits: tuple[torch.Tensor, ...],
    num_experts: int,
    top_k: int,
    attention_mask: torch.Tensor | None = None,
    group: dist.ProcessGroup | None = None,
    replicas: int = 1,
) -> torch.Tensor:
    """transformers' ``load_balancing_loss_func`` over the ``replicas`` ranks of ``group`` (see the module
    docstring); with ``replicas=1`` and no group, the same number it computes."""
    counts = torch.zeros(num_experts, dtype=torch.float32, device=router_logits[0].device)
    probs = torch.zeros_like(counts)
    tokens = torch.zeros((), dtype=torch.float32, device=counts.device)
    mask = None if attention_mask is None else attention_mask.reshape(-1).to(counts)
    for logits in router_logits:
        weights = F.softmax(logits.to(counts.device), dim=-1)
        chosen = torch.topk(weights, top_k, dim=-1).indices.reshape(-1)
        rows = torch.ones(weights.shape[0], device=counts.device) if mask is None else mask
        counts = counts.scatter_add(0, chosen, rows.repeat_interleave(top_k))
        probs = probs + (weights.float() * rows.unsqueeze(-1)).sum(0)
        tokens = tokens + rows.sum()
    totals = torch.cat([counts, tokens.reshape(1)]).detach()
    if replicas > 1:
        dist.all_reduce(totals, group=group)
    share, everyone = totals[:num_experts] / totals[-1], totals[-1]
    return num_experts * (share * probs * replicas / everyone).sum()


def balance_globally(model: nn.Module, group: dist.ProcessGroup | None, replicas: int) -> None:
    """Make ``model``'s router loss the global batch's over the ``replicas`` data-parallel ranks of ``group``; a
    one-line ``ConfigError`` when ``model`` computes no such loss."""
    if not hasattr(model, "num_experts_per_tok") or not hasattr(model, "router_aux_loss_coef"):
        raise ConfigError(
            f"moe_aux_loss='global' needs a transformers mixture-of-experts model that computes its "
            f"router's load-balancing loss (output_router_logits=True); {type(model).__name__} does not; "
            "drop the option"
        )
    if replicas > 1:
        model.register_forward_hook(_global_hook(group, replicas), with_kwargs=True, prepend=True)


def _global_hook(group: dist.ProcessGroup | None, replicas: int) -> Any:
    def hook(model: nn.Module, args: tuple, kwargs: dict, out: Any) -> Any:
        if isinstance(out, tuple) and getattr(model.config, "output_router_logits", False):
            raise ConfigError(
                "moe_aux_loss='global' reads the router logits from the model's output, which came as a "
                "tuple (return_dict=False); call the model with return_dict=True"
            )
        local = getattr(out, "aux_loss", None)
        logits = getattr(out, "router_logits", None)
        if local is None or not isinstance(logits, tuple) or not logits:
            return out
        mask = kwargs.get("attention_mask", args[1] if len(args) > 1 else None)
        aux = load_balancing_loss(logits, model.num_experts, model.num_experts_per_tok, mask, group, replicas)
        if getattr(out, "loss", None) is not None:
            out["loss"] = out["loss"] + model.router_aux_loss_coef * (aux - local)
        out["aux_loss"] = aux
        return out

    return hook
