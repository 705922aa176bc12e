"""The mixture-of-experts zoo job (tests/strategies/test_zoo_moe.py): the zoo's cases (:mod:`helpers.zoo_workers`)
and a check of the router loss itself on padded slices of unequal token counts."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from helpers.cases import each_case
from helpers.zoo_workers import run_case
from paratrain.distributed.router_loss import load_balancing_loss

EXPERTS, TOP_K, LAYERS = 4, 2, 3
MASKED = ("router_loss", "padded", {})
"""The case that checks :func:`load_balancing_loss` alone."""


def padded_batch() -> tuple[list[torch.Tensor], torch.Tensor]:
    """Per layer the router logits of a global batch of 4 sequences of 5 tokens, and its attention mask: rank 0's
    half has 3 padded tokens, rank 1's none, so the ranks count unequal tokens."""
    g = torch.Generator().manual_seed(7)
    logits = [torch.randn(4 * 5, EXPERTS, generator=g) for _ in range(LAYERS)]
    mask = torch.ones(4, 5)
    mask[0, 3:] = 0
    mask[1, 4:] = 0
    return logits, mask


def padded_router_loss() -> dict[str, torch.Tensor]:
    """This rank's slice of :func:`padded_batch` through the global router loss: (the mean over the ranks of the
    loss, the gradient of that mean with respect to the global logits), on rank 0."""
    rank, world = dist.get_rank(), dist.get_world_size()
    logits, mask = padded_batch()
    rows = slice(rank * 10, (rank + 1) * 10)
    mine = [x[rows].clone().requires_grad_(True) for x in logits]
    loss = load_balancing_loss(tuple(mine), EXPERTS, TOP_K, mask[rank * 2 : (rank + 1) * 2], replicas=world)
    loss.backward()
    parts = [torch.cat([loss.detach().reshape(1), *[x.grad.reshape(-1) for x in mine]])]
    gathered = [torch.empty_like(parts[0]) for _ in range(world)]
    dist.all_gather(gathered, parts[0])
    mean = torch.stack([g[0] for g in gathered]).mean()
    grads = [torch.cat([g[1:].reshape(LAYERS, 10, EXPERTS)[i] for g in gathered]) / world for i in range(LAYERS)]
    return {"loss": mean, "grads": torch.stack(grads)}


def run_moe_cases(cases: list[tuple[str, str, dict]], tmp: str) -> dict[str, dict]:
    """Every case in order (:func:`helpers.zoo_workers.run_cases`), :data:`MASKED` and :data:`ACCUMULATED` among
    them."""

    def one(i: int, case: tuple[str, str, dict]) -> dict:
        if case in (MASKED, ACCUMULATED):
            return padded_router_loss() if case == MASKED else accumulated_steps()
        return run_case(*case, os.path.join(tmp, str(i)))

    return each_case(cases, one, key=lambda c: f"{c[0]}/{c[1]}{c[2] or ''}")


ACCUMULATED = ("mixtral_aux", "ddp", {"moe_aux_loss": "global", "accumulate": 2})
"""The case that trains with the global router loss over 2 micro-batches per step."""
MICRO_SAMPLES = 2


def accumulated_steps(steps: int = 2) -> dict[str, torch.Tensor]:
    """:data:`ACCUMULATED`: ``steps`` optimizer steps of 2 micro-batches of :data:`MICRO_SAMPLES` per rank; micro-batch
    m of rank r holds samples ``m x world x MICRO_SAMPLES + r x MICRO_SAMPLES`` on. The full state on every rank."""
    import paratrain
    from helpers.zoo import MOE_ZOO
    from helpers.zoo_workers import step_batch

    spec = MOE_ZOO[ACCUMULATED[0]]
    par = paratrain.Parallel(ACCUMULATED[1], monitor=False, **ACCUMULATED[2])
    model = spec.build()
    model, opt = par.prepare(model, spec.optimizer(model))
    rank, world = dist.get_rank(), dist.get_world_size()
    for s in range(steps):
        x, y = step_batch(spec, s, 2 * world * MICRO_SAMPLES)
        for m in range(2):
            start = (m * world + rank) * MICRO_SAMPLES
            with par.step(model, opt):
                par.forward_backward(
                    model, x[start : start + MICRO_SAMPLES], {"labels": y[start : start + MICRO_SAMPLES]}
                )
    state = par.full_state_dict(model, rank0_only=False)
    par.close()
    return {"state": state}
