"""zero3 on a model whose blocks live in an ``nn.ModuleDict`` (as torchtitan keeps them): one FSDP unit per block,
against one unit for the whole model and against a unit per linear layer (CPU, gloo, world 2).

    .venv/bin/python benchmarks/zero3_moduledict_units.py                 # 5 interleaved rounds x 4 steps
    .venv/bin/python benchmarks/zero3_moduledict_units.py --quick         # one round of 2 steps: a look
    .venv/bin/python benchmarks/zero3_moduledict_units.py --json out.json

Model: a torchtitan-shaped decoder built here (token embedding, ``layers = nn.ModuleDict({"0": Block, ...})``
walked by ``layers.values()``, RMSNorm, grouped-query attention through an SDPA wrapper module, SwiGLU MLP, an untied
head): 8 blocks, hidden 512, 8 query / 4 key-value heads, MLP 1536, vocabulary 4096, sequence 64; 4 sequences per
rank, AdamW, fp32, one thread per process.

Subjects, each on the same weights, batch and optimizer, one after the other in every round (the order rotating):

* ``blocks``: ``Parallel("zero3")`` with its default units: the blocks found in the ModuleDict, one unit each (the
  embedding and head, 2.1M parameters each, units of their own by size, as before);
* ``one-unit``: the whole model one FSDP unit, as a user forces it (``wrap_classes=(Decoder,)``, the root's own
  class, which never wraps the root, and ``min_params`` above the model's size): every parameter gathered for the
  whole forward and again for the whole backward;
* ``every-linear``: a unit per ``nn.Linear``/``nn.Embedding`` (``wrap_classes``), what zero3's size rule made of
  this model while blocks in a ModuleDict were not found (each linear layer holds over ``min_params``=100K).

Reported: the FSDP units each way (``fully_shard`` calls, the root's included), step time (each round's median on the
slowest rank, then the median over rounds; ``paired``: the median of each round's ratio to ``one-unit`` in the same
round, which a busy machine's drift between rounds cancels out of) and peak memory (the most tensor bytes alive at
once on a rank during one more step, from torch's ``MemTracker``: parameters, gradients, optimizer state,
activations, temporaries), with ratios to ``one-unit``, and each subject's loss after its steps (the same math:
equal).
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

LAYERS, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, SEQ, PER_RANK = 8, 512, 8, 4, 1536, 4096, 64, 4
SUBJECTS = ("blocks", "one-unit", "every-linear")


class RMSNorm(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class ScaledDotProduct(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = HIDDEN // HEADS
        self.wq = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.wk = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(HIDDEN, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.inner_attention = ScaledDotProduct()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        return self.wo(self.inner_attention(q, k, v).reshape(b, s, -1))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(HIDDEN)
        self.attention = Attention()
        self.ffn_norm = RMSNorm(HIDDEN)
        self.w1 = nn.Linear(HIDDEN, FFN, bias=False)
        self.w2 = nn.Linear(FFN, HIDDEN, bias=False)
        self.w3 = nn.Linear(HIDDEN, FFN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = RMSNorm(HIDDEN)
        self.output = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


OPTIONS = {
    "blocks": {},
    "one-unit": {"wrap_classes": (Decoder,), "min_params": 10**12},
    "every-linear": {"wrap_classes": (nn.Linear, nn.Embedding)},
}


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def measure(subject: str, steps: int, warmup: int) -> dict[str, float]:
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.fsdp import FSDPModule

    torch.manual_seed(0)
    model = Decoder()
    par = paratrain.Parallel("zero3", monitor=False, **OPTIONS[subject])
    model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(dist.get_rank())
    ids = torch.randint(0, VOCAB, (PER_RANK, SEQ + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    times, loss = [], torch.zeros(())
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        with par.step(model, opt):
            loss = par.forward_backward(model, x, y, _loss)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    tracker = MemTracker()  # one more step, every tensor's storage tracked (slow, so not timed)
    tracker.track_external(model, opt)
    with tracker, par.step(model, opt):
        par.forward_backward(model, x, y, _loss)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
    return {
        "median_s": statistics.median(times),
        "peak_mib": peak["Total"] / 2**20,
        "units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "loss": float(par.mean(loss)),
    }


def job(rounds: int, steps: int, warmup: int) -> dict[str, list[dict]]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out: dict[str, list[dict]] = {s: [] for s in SUBJECTS}
    for r in range(rounds):
        for subject in SUBJECTS[r % 3 :] + SUBJECTS[: r % 3]:
            out[subject].append(measure(subject, steps, warmup))
    finish_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="one round of 2 steps")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.steps = 1, 2
    ranks = paratrain.launch(job, 2, (a.rounds, a.steps, a.warmup), timeout_s=3600)
    rows = []
    for subject in SUBJECTS:
        per_round = [max(rank[subject][r]["median_s"] for rank in ranks) for r in range(a.rounds)]
        rows.append(
            {
                "subject": subject,
                "units": ranks[0][subject][0]["units"],
                "step_ms": 1e3 * statistics.median(per_round),
                "peak_mib": statistics.median(
                    max(rank[subject][r]["peak_mib"] for rank in ranks) for r in range(a.rounds)
                ),
                "loss": ranks[0][subject][0]["loss"],
                "rounds_ms": [round(1e3 * t, 1) for t in per_round],
            }
        )
    one = next(r for r in rows if r["subject"] == "one-unit")
    for r in rows:  # each round's ratio to one-unit in that round: what a busy machine's drift cancels out of
        r["paired"] = statistics.median(t / o for t, o in zip(r["rounds_ms"], one["rounds_ms"], strict=True))
    params = sum(p.numel() for p in Decoder().parameters())
    print(
        f"model: {LAYERS} blocks in a ModuleDict, hidden {HIDDEN}, {params / 1e6:.1f}M parameters, seq {SEQ}, "
        f"{PER_RANK} samples per rank, AdamW, fp32, zero3 at world 2 (gloo); {a.rounds} rounds x {a.steps} steps"
    )
    print(
        f"{'subject':<14} {'units':>5} {'step ms':>8} {'x one':>6} {'paired':>6} {'peak MiB':>9} {'x one':>6} "
        f"{'loss':>8}  rounds ms"
    )
    for r in rows:
        print(
            f"{r['subject']:<14} {r['units']:>5} {r['step_ms']:>8.1f} {r['step_ms'] / one['step_ms']:>6.3f} "
            f"{r['paired']:>6.3f} "
            f"{r['peak_mib']:>9.1f} {r['peak_mib'] / one['peak_mib']:>6.3f} {r['loss']:>8.5f}  {r['rounds_ms']}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
