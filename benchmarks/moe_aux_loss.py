"""The router's load-balancing loss under data parallelism: how far each rank's own loss is from one process's, and
what ``moe_aux_loss="global"`` costs a step.

1. One process, no distribution: a Mixtral's router loss on a global batch against the mean of the losses of its
   R slices (what R data-parallel ranks compute without the option), for R = 2, 4, 8: the value, and the gradient of
   the routers' weights (relative difference of the norm of the difference).
2. A launched job at world 2 (ddp): the same model trained with ``moe_aux_loss="local"`` and ``"global"`` side by
   side, one step of each per round, interleaved; step time medians and their ratio.

    PYTHONPATH=src python benchmarks/moe_aux_loss.py --json moe-aux-loss.json
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

CONFIG = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 64,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.02,
    "tie_word_embeddings": False,
}
BATCH, SEQ = 16, 64


def mixtral() -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    return MixtralForCausalLM(MixtralConfig(**CONFIG))


def _aux_and_grad(model: torch.nn.Module, ids: torch.Tensor, slices: int) -> tuple[float, torch.Tensor]:
    model.zero_grad()
    total = 0.0
    for part in ids.chunk(slices):
        aux = model(part).aux_loss / slices
        aux.backward()
        total += float(aux)
    routers = [m.weight.grad.flatten() for n, m in model.named_modules() if n.endswith("mlp.gate")]
    return total, torch.cat(routers)


def slices_apart() -> list[dict]:
    model = mixtral()
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    whole, grad = _aux_and_grad(model, ids, 1)
    rows = []
    for ranks in (2, 4, 8):
        mean, local = _aux_and_grad(model, ids, ranks)
        rows.append(
            {
                "ranks": ranks,
                "aux_global": whole,
                "aux_mean_of_ranks": mean,
                "aux_rel_diff": abs(mean - whole) / whole,
                "router_grad_rel_diff": float((local - grad).norm() / grad.norm()),
            }
        )
    return rows


def _timed_job(rounds: int, warmup: int) -> dict:
    import paratrain

    rank_ids = torch.randint(0, CONFIG["vocab_size"], (BATCH // 2, SEQ), generator=torch.Generator().manual_seed(2))
    runs = {}
    for mode in ("local", "global"):
        par = paratrain.Parallel("ddp", monitor=False, moe_aux_loss=mode)
        model = mixtral()
        model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
        runs[mode] = (par, model, opt, [])
    for r in range(warmup + rounds):
        for par, model, opt, times in runs.values():
            start = time.perf_counter()
            with par.step(model, opt):
                par.forward_backward(model, rank_ids, {"labels": rank_ids})
            if r >= warmup:
                times.append(time.perf_counter() - start)
    out = {mode: statistics.median(t) for mode, (_, _, _, t) in runs.items()}
    for par, *_ in runs.values():
        par.close()
    return out


def step_times(rounds: int, warmup: int) -> dict:
    from paratrain.testing import spawn

    per_rank = spawn(_timed_job, 2, (rounds, warmup), timeout_s=900)
    local, glob = (statistics.median(r[m] for r in per_rank) for m in ("local", "global"))
    return {
        "world": 2,
        "rounds": rounds,
        "local_step_ms": 1e3 * local,
        "global_step_ms": 1e3 * glob,
        "global_over_local": glob / local,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "config": CONFIG,
        "batch": BATCH,
        "seq": SEQ,
        "slices": slices_apart(),
        "step": step_times(args.rounds, args.warmup),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
