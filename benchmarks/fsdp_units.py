"""zero3's default units against hand-written FSDP2 with one unit per transformer block (CPU, gloo, world 2).

    .venv/bin/python benchmarks/fsdp_units.py                  # 5 interleaved rounds
    .venv/bin/python benchmarks/fsdp_units.py --rounds 1 --steps 3   # a quick look
    .venv/bin/python benchmarks/fsdp_units.py --precision bf16-mixed --vocab 32768   # lean bf16 outputs

Subjects, each on the same model, batch and AdamW, one after the other in every round (the order rotating):

* ``paratrain``: ``Parallel("zero3")`` with its default units (the repeated blocks; a tied embedding and head as
  one group);
* ``hand-fsdp2``: ``fully_shard`` on every block, then on the root, written out as the PyTorch FSDP tutorial and
  torchtitan do (the tied embedding and head stay with the root);
* ``every-linear``: zero3 with every ``nn.Linear``/``nn.Embedding`` as a unit (``wrap_classes``), what the
  size-based default amounted to on large models.

With ``--precision bf16-mixed`` the subjects are ``paratrain`` (``forward_backward``: the loss sees bf16 logits
under autocast), ``paratrain-direct`` (``loss_fn(model(x), y)`` + ``par.backward``: the model hands fp32 outputs,
as every output was before) and ``hand-fsdp2`` (``MixedPrecisionPolicy(bf16, reduce fp32)``, the loss on
``logits.float()`` as torchtitan computes it); a large ``--vocab`` makes the logits the largest activation.

Models: our nanoGPT-style GPT and transformers' GPT-2 at the same small size (tied heads). Step time: the median of
each round's median, on the slowest rank. Peak memory: the most tensor bytes alive at once on a rank during one
more step (parameters, gradients, optimizer state, activations, temporaries), from torch's ``MemTracker``, which
follows every storage; the allocator's caching and fragmentation are left out, as ``max_memory_allocated`` leaves
them out on a GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group

LAYERS, HIDDEN, HEADS, SEQ, PER_RANK = 4, 192, 4, 64, 8
SUBJECTS = {
    "fp32": ("paratrain", "hand-fsdp2", "every-linear"),
    "bf16-mixed": ("paratrain", "paratrain-direct", "hand-fsdp2"),
}


def build(kind: str, vocab: int) -> tuple[nn.Module, type[nn.Module]]:
    torch.manual_seed(0)
    if kind == "gpt":
        from paratrain.workloads.gpt import GPT, Block, GPTConfig

        return GPT(GPTConfig(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ, vocab=vocab)), Block
    import logging

    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    logging.getLogger("transformers").setLevel(logging.ERROR)
    cfg = GPT2Config(
        n_layer=LAYERS,
        n_embd=HIDDEN,
        n_head=HEADS,
        n_positions=SEQ,
        vocab_size=vocab,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(cfg), GPT2Block


def _loss(out: object, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def _hand_loss(out: object, y: torch.Tensor) -> torch.Tensor:
    logits = out.logits if hasattr(out, "logits") else out
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def prepared(subject: str, kind: str, precision: str, vocab: int) -> tuple[object, nn.Module, torch.optim.Optimizer]:
    """(the ``Parallel`` or None for hand-written FSDP2, model, optimizer) for one subject."""
    model, block = build(kind, vocab)
    if subject == "hand-fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        mp = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if precision == "bf16-mixed"
            else MixedPrecisionPolicy()
        )
        for m in [m for m in model.modules() if isinstance(m, block)]:
            fully_shard(m, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        return None, model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    options = {"wrap_classes": (nn.Linear, nn.Embedding)} if subject == "every-linear" else {}
    par = paratrain.Parallel("zero3", monitor=False, precision=precision, **options)
    model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    return par, model, opt


def measure(subject: str, kind: str, steps: int, warmup: int, precision: str, vocab: int) -> dict[str, float]:
    par, model, opt = prepared(subject, kind, precision, vocab)
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, vocab, (PER_RANK, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        _one_step(par, subject, model, opt, x, y)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()  # one more step, every tensor's storage tracked (slow, so not timed)
    tracker.track_external(model, opt)
    with tracker:
        _one_step(par, subject, model, opt, x, y)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {"median_s": statistics.median(times), "peak_mib": peak["Total"] / 2**20}


def _one_step(
    par: object, subject: str, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> None:
    if par is None:
        _hand_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    elif subject == "paratrain-direct":
        with par.step(model, opt):
            par.backward(_loss(model(x), y))
    else:
        with par.step(model, opt):
            par.forward_backward(model, x, y, _loss)


def job(kinds: list[str], rounds: int, steps: int, warmup: int, precision: str, vocab: int) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    subjects = SUBJECTS[precision]
    out: dict[str, list[dict]] = {f"{k}/{s}": [] for k in kinds for s in subjects}
    for r in range(rounds):
        for kind in kinds:
            order = subjects[r % 3 :] + subjects[: r % 3]
            for subject in order:
                out[f"{kind}/{subject}"].append(measure(subject, kind, steps, warmup, precision, vocab))
    finish_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--models", default="gpt,gpt2")
    p.add_argument("--precision", default="fp32", choices=sorted(SUBJECTS))
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    kinds = a.models.split(",")
    ranks = paratrain.launch(job, 2, (kinds, a.rounds, a.steps, a.warmup, a.precision, a.vocab), timeout_s=1800)
    rows = []
    for key in ranks[0]:
        per_round = [max(rank[key][r]["median_s"] for rank in ranks) for r in range(a.rounds)]
        peak = statistics.median(max(rank[key][r]["peak_mib"] for rank in ranks) for r in range(a.rounds))
        rows.append(
            {
                "case": key,
                "step_ms": 1e3 * statistics.median(per_round),
                "peak_mib": peak,
                "rounds_ms": [round(1e3 * t, 1) for t in per_round],
            }
        )
    by = {r["case"]: r for r in rows}
    print(
        f"model: {LAYERS} blocks, hidden {HIDDEN}, seq {SEQ}, vocab {a.vocab}, tied head; {PER_RANK} samples per "
        f"rank, AdamW, {a.precision}, world 2; {a.rounds} rounds x {a.steps} steps"
    )
    print(f"{'case':<24} {'step ms':>8} {'x hand':>7} {'peak MiB':>9} {'x hand':>7}  rounds (ms)")
    for r in rows:
        hand = by[r["case"].split("/")[0] + "/hand-fsdp2"]
        print(
            f"{r['case']:<24} {r['step_ms']:>8.1f} {r['step_ms'] / hand['step_ms']:>7.3f} {r['peak_mib']:>9.1f} "
            f"{r['peak_mib'] / hand['peak_mib']:>7.3f}  {r['rounds_ms']}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
