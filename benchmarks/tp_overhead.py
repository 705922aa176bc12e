"""``Parallel("tp")`` against hand-written ``parallelize_module`` with the same plan (CPU, gloo, world 2).

    .venv/bin/python benchmarks/tp_overhead.py                     # 5 interleaved rounds
    .venv/bin/python benchmarks/tp_overhead.py --rounds 1 --steps 3   # a quick look

Model: transformers' ``LlamaForCausalLM`` from a small config (untied head, grouped-query attention), AdamW,
fp32, the same batch on both ranks (one replica). Subjects, one after the other in every round (the order
alternating):

* ``paratrain``: ``Parallel("tp")`` with its built-in Llama plan and ``forward_backward`` (the loss on logits
  split over the vocabulary);
* ``hand``: the plan written out with PyTorch's own styles, as torchtitan's ``apply_tp`` and PyTorch's TP tutorial
  write it — vocabulary-parallel embedding (``RowwiseParallel``) and head (``ColwiseParallel``, logits left
  ``Shard(-1)``), sequence-parallel norms, column-split q/k/v and MLP gate/up, row-split o/down projections —
  and the loss under ``loss_parallel()``; the embeddings stay whole until the first layer (transformers' Llama
  takes its rotary positions from their length), as in paratrain's plan.

Step time: the median of each round's median, on the slower rank. Parameter bytes: what each rank holds of the
split layers (local shards) against the whole layers, which must be exactly 1/tp.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, VOCAB, SEQ, BATCH = 256, 4, 8, 4, 704, 4096, 128, 8


def build() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            hidden_size=HIDDEN,
            intermediate_size=FFN,
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            vocab_size=VOCAB,
            max_position_embeddings=SEQ,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
    )


def _loss(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def hand_written(model: torch.nn.Module) -> torch.nn.Module:
    """The Llama plan with PyTorch's styles, on a 1-D mesh over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(
        model,
        mesh,
        {
            # transformers' Llama derives its rotary positions from the embeddings' length: keep them whole there and
            # cut the sequence at the first layer's input
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "model.layers.0": PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),), use_local_output=True
            ),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                    use_local_output=True,
                ),
                "self_attn.q_proj": ColwiseParallel(),
                "self_attn.k_proj": ColwiseParallel(),
                "self_attn.v_proj": ColwiseParallel(),
                "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
                ),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    return model


def split_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the whole tensors) over the parameters the plan split."""
    from torch.distributed.tensor import DTensor, Shard

    held = whole = 0
    for p in model.parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            held += p.to_local().numel() * p.element_size()
            whole += p.numel() * p.element_size()
    return held, whole


def prepared(subject: str) -> tuple[object, torch.nn.Module, torch.optim.Optimizer]:
    model = build()
    if subject == "hand":
        model = hand_written(model)
        return None, model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    par = paratrain.Parallel("tp", monitor=False)
    model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return par, model, opt


def one_step(
    par: object, model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    if par is None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():
            loss = _loss(model(x), y)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach())
    with par.step(model, opt):
        loss = par.forward_backward(model, x, y, _loss)
    return float(loss)


def job(rounds: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    subjects = {s: prepared(s) for s in ("paratrain", "hand")}
    out: dict = {s: {"rounds_ms": [], "split_bytes": split_bytes(subjects[s][1])} for s in subjects}
    for s, (par, model, opt) in subjects.items():
        out[s]["first_loss"] = one_step(par, model, opt, x, y)  # the same math: the same first loss
        for _ in range(warmup - 1):
            one_step(par, model, opt, x, y)
    for r in range(rounds):
        for s in ("paratrain", "hand") if r % 2 == 0 else ("hand", "paratrain"):
            par, model, opt = subjects[s]
            times = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                one_step(par, model, opt, x, y)
                times.append(time.perf_counter() - start)
            out[s]["rounds_ms"].append(1e3 * statistics.median(times))
    for par, _, _ in subjects.values():
        if par is not None:
            par.close()
    finish_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    ranks = paratrain.launch(job, 2, (a.rounds, a.steps, a.warmup), timeout_s=1800)
    rows = {}
    for s in ranks[0]:
        per_round = [max(rank[s]["rounds_ms"][r] for rank in ranks) for r in range(a.rounds)]
        held, whole = ranks[0][s]["split_bytes"]
        rows[s] = {
            "step_ms": statistics.median(per_round),
            "rounds_ms": [round(v, 1) for v in per_round],
            "held_bytes": held,
            "whole_bytes": whole,
            "first_loss": ranks[0][s]["first_loss"],
        }
    print(
        f"Llama {LAYERS} layers x {HIDDEN} (heads {HEADS}, kv {KV_HEADS}, ffn {FFN}, vocab {VOCAB}), batch {BATCH} x "
        f"{SEQ}, fp32, AdamW, tp=2 on 2 CPU processes (gloo); {a.rounds} rounds x {a.steps} steps"
    )
    print(f"{'subject':<10} {'step ms':>8} {'x hand':>7} {'split params held':>18} {'first loss':>11}  rounds (ms)")
    for s, row in rows.items():
        share = row["held_bytes"] / row["whole_bytes"] if row["whole_bytes"] else float("nan")
        print(
            f"{s:<10} {row['step_ms']:>8.1f} {row['step_ms'] / rows['hand']['step_ms']:>7.3f} "
            f"{share:>17.4f}x {row['first_loss']:>11.6f}  {row['rounds_ms']}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
