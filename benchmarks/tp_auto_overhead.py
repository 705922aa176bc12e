"""``Parallel("tp", tp_plan="auto")`` against the same splits written by hand with ``parallelize_module`` (CPU, gloo,
world 2).

    .venv/bin/python benchmarks/tp_auto_overhead.py                       # 5 interleaved rounds
    .venv/bin/python benchmarks/tp_auto_overhead.py --rounds 1 --steps 3  # a quick look
    .venv/bin/python benchmarks/tp_auto_overhead.py --ops                 # ops per step, none timed

Model: the Llama of ``benchmarks/tp_overhead.py`` (transformers' ``LlamaForCausalLM`` from a small config,
grouped-query attention, untied head), AdamW, fp32, the same batch on both ranks. Subjects, one after the other in
every round (the order alternating):

* ``auto``: ``Parallel("tp", tp_plan="auto")``: the plan inferred from the blocks and checked on one process
  (vocabulary-split embedding and head, column-split q/k/v and gate/up, row-split o/down, no sequence
  parallelism), every other parameter a replicated DTensor, ``forward_backward`` with the loss on logits split
  over the vocabulary;
* ``hand``: the same splits with PyTorch's own styles, as a user would write them for this model —
  ``RowwiseParallel`` embedding, ``ColwiseParallel``/``RowwiseParallel`` projections, ``ColwiseParallel`` head with
  ``Shard(-1)`` logits — norms left plain tensors, the loss under ``loss_parallel()``;
* ``hand_dt``: ``hand`` with every parameter it leaves whole (the norms) a replicated DTensor that the norms compute
  on through DTensor's dispatcher, as paratrain's ``Replicated`` did before it ran them on local tensors (it keeps
  every parameter a DTensor: clipping and FSDP over ``(dp, tp)`` want one mesh), to tell what that dispatch costs.

Both compute the same math (the first loss is printed for each). Step time: the median of each round's median, on
the slower rank; the ratio is auto / hand. CPU ms: the same for the CPU time of each rank's training thread
(``time.thread_time``: compute and dispatch, not the waits on collectives), which other processes on a busy machine
blur far less than the wall clock. Inference time: what ``prepare`` spends inferring and checking the plan (once per
job). ``--ops`` counts, for one step, the aten ops, those taking a DTensor, and the Python calls: counts that no
load blurs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tp_overhead import BATCH, FFN, HEADS, HIDDEN, KV_HEADS, LAYERS, SEQ, VOCAB, build, one_step, split_bytes

import paratrain
from paratrain.distributed.process_group import finish_group

SUBJECTS = ("auto", "hand", "hand_dt")


def hand_written(model: torch.nn.Module) -> torch.nn.Module:
    """The inferred plan's splits with PyTorch's styles, on a 1-D mesh over every rank."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(
        model,
        mesh,
        {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        },
    )
    for layer in model.model.layers:
        parallelize_module(
            layer,
            mesh,
            {
                **{f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")},
                "self_attn.o_proj": RowwiseParallel(),
                "mlp.gate_proj": ColwiseParallel(),
                "mlp.up_proj": ColwiseParallel(),
                "mlp.down_proj": RowwiseParallel(),
            },
        )
    return model


def prepared(subject: str) -> tuple[object, torch.nn.Module, torch.optim.Optimizer, float]:
    model = build()
    if subject.startswith("hand"):
        model = hand_written(model)
        if subject == "hand_dt":
            from torch.distributed.tensor import DTensor, Replicate, distribute_module

            mesh = next(p.device_mesh for p in model.parameters() if isinstance(p, DTensor))
            for module in model.modules():
                if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
                    distribute_module(
                        module,
                        mesh,
                        None,
                        lambda _, args, m: tuple(
                            DTensor.from_local(a, m, [Replicate()], run_check=False) for a in args
                        ),
                        lambda _, out, m: out.to_local(),
                    )
        return None, model, torch.optim.AdamW(model.parameters(), lr=1e-4), 0.0
    par = paratrain.Parallel("tp", tp_plan="auto", monitor=False)
    start = time.perf_counter()
    model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return par, model, opt, time.perf_counter() - start


def count_ops() -> dict:
    """Per subject, the aten ops of one step (after one untimed) on rank 0, how many of them took a DTensor (each a
    trip through DTensor's dispatcher), and the Python calls of the next step: counts the machine's load does not
    blur."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops, self.dtensor, self.by_op = 0, 0, {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.ops += 1
            if any(isinstance(t, DTensor) for t in tree_leaves((args, kwargs or {}))):
                self.dtensor += 1
                self.by_op[str(func)] = self.by_op.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    out = {}
    for s in SUBJECTS:
        par, model, opt, _ = prepared(s)
        one_step(par, model, opt, ids[:, :-1], ids[:, 1:])
        calls = [0]

        def profile(frame, event, arg, calls=calls) -> None:  # type: ignore[no-untyped-def]
            if event in ("call", "c_call"):
                calls[0] += 1

        with Count() as count:
            one_step(par, model, opt, ids[:, :-1], ids[:, 1:])
        sys.setprofile(profile)  # another step, without the mode's own calls
        try:
            one_step(par, model, opt, ids[:, :-1], ids[:, 1:])
        finally:
            sys.setprofile(None)
        out[s] = {"ops": count.ops, "dtensor_ops": count.dtensor, "by_op": count.by_op, "py_calls": calls[0]}
        if par is not None:
            par.close()
    finish_group()
    return out


def job(rounds: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    subjects = {s: prepared(s) for s in SUBJECTS}
    out: dict = {
        s: {
            "rounds_ms": [],
            "rounds_cpu_ms": [],
            "split_bytes": split_bytes(subjects[s][1]),
            "prepare_s": subjects[s][3],
        }
        for s in subjects
    }
    for s, (par, model, opt, _) in subjects.items():
        out[s]["first_loss"] = one_step(par, model, opt, x, y)  # the same math: the same first loss
        for _ in range(warmup - 1):
            one_step(par, model, opt, x, y)
    for r in range(rounds):
        for s in SUBJECTS if r % 2 == 0 else SUBJECTS[::-1]:
            par, model, opt, _ = subjects[s]
            times, cpu = [], []
            for _ in range(steps):
                dist.barrier()
                start, start_cpu = time.perf_counter(), time.thread_time()
                one_step(par, model, opt, x, y)
                times.append(time.perf_counter() - start)
                cpu.append(time.thread_time() - start_cpu)
            out[s]["rounds_ms"].append(1e3 * statistics.median(times))
            out[s]["rounds_cpu_ms"].append(1e3 * statistics.median(cpu))
    for par, *_ in subjects.values():
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
    p.add_argument("--ops", action="store_true", help="count each subject's ops per step instead of timing")
    a = p.parse_args()
    if a.ops:
        counts = paratrain.launch(count_ops, 2, (), timeout_s=600)[0]
        print(f"{'subject':<8} {'aten ops':>9} {'on DTensors':>12} {'py calls':>9}  DTensor ops beyond hand's, by op")
        for s, c in counts.items():
            more = {
                op: n - counts["hand"]["by_op"].get(op, 0)
                for op, n in c["by_op"].items()
                if n != counts["hand"]["by_op"].get(op, 0)
            }
            print(f"{s:<8} {c['ops']:>9} {c['dtensor_ops']:>12} {c['py_calls']:>9}  {more}")
        return
    ranks = paratrain.launch(job, 2, (a.rounds, a.steps, a.warmup), timeout_s=1800)
    rows = {}
    for s in ranks[0]:
        per_round = [max(rank[s]["rounds_ms"][r] for rank in ranks) for r in range(a.rounds)]
        cpu_round = [max(rank[s]["rounds_cpu_ms"][r] for rank in ranks) for r in range(a.rounds)]
        held, whole = ranks[0][s]["split_bytes"]
        rows[s] = {
            "step_ms": statistics.median(per_round),
            "rounds_ms": [round(v, 1) for v in per_round],
            "cpu_ms": statistics.median(cpu_round),
            "rounds_cpu_ms": [round(v, 1) for v in cpu_round],
            "held_bytes": held,
            "whole_bytes": whole,
            "first_loss": ranks[0][s]["first_loss"],
            "prepare_s": max(rank[s]["prepare_s"] for rank in ranks),
        }
    ratios = [a_ / h for a_, h in zip(rows["auto"]["rounds_ms"], rows["hand"]["rounds_ms"])]
    same = [a_ / h for a_, h in zip(rows["auto"]["rounds_ms"], rows["hand_dt"]["rounds_ms"])]
    print(
        f"Llama {LAYERS} layers x {HIDDEN} (heads {HEADS}, kv {KV_HEADS}, ffn {FFN}, vocab {VOCAB}), batch {BATCH} x "
        f"{SEQ}, fp32, AdamW, tp=2 on 2 CPU processes (gloo); {a.rounds} rounds x {a.steps} steps"
    )
    print(
        f"{'subject':<8} {'step ms':>8} {'x hand':>7} {'cpu ms':>7} {'x hand':>7} {'split params held':>18} "
        f"{'first loss':>11}  rounds (ms)"
    )
    for s, row in rows.items():
        share = row["held_bytes"] / row["whole_bytes"] if row["whole_bytes"] else float("nan")
        print(
            f"{s:<8} {row['step_ms']:>8.1f} {row['step_ms'] / rows['hand']['step_ms']:>7.3f} "
            f"{row['cpu_ms']:>7.1f} {row['cpu_ms'] / rows['hand']['cpu_ms']:>7.3f} "
            f"{share:>17.4f}x {row['first_loss']:>11.6f}  {row['rounds_ms']}"
        )
    print(
        f"per-round auto/hand: {[round(r, 3) for r in ratios]} (median {statistics.median(ratios):.3f}); "
        f"inferring and checking the plan in prepare: {rows['auto']['prepare_s']:.2f} s"
    )
    print(f"per-round auto/hand_dt: {[round(r, 3) for r in same]} (median {statistics.median(same):.3f})")
    cpu = [a_ / h for a_, h in zip(rows["auto"]["rounds_cpu_ms"], rows["hand"]["rounds_cpu_ms"])]
    print(f"per-round cpu auto/hand: {[round(r, 3) for r in cpu]} (median {statistics.median(cpu):.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
