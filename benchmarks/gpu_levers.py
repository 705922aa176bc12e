"""Large-model levers on one GPU: paratrain against hand-written torch, same model, same step, interleaved.

    python3 benchmarks/gpu_levers.py                          # 124M GPT (GPT-2 shape, vocab 50304), batch 12 x 1024
    python3 benchmarks/gpu_levers.py --json levers.json
    .venv/bin/python benchmarks/gpu_levers.py --device cpu --size tiny --rounds 1 --no-compile   # a smoke run

One process on a one-rank group (NCCL on the GPU), bf16 mixed precision, AdamW (PyTorch's default for-each
implementation), cross-entropy over the logits. Two phases:

* **Memory** (eager): each subject alone — built, prepared, three steps, then freed before the next — and its
  peak is ``max_memory_allocated`` over steps 2-3 less what was allocated before it was built. Subjects: ddp and
  zero3 for paratrain (``forward_backward``: the loss sees the compute-dtype logits) and hand-written torch
  (``DDP`` + autocast; ``fully_shard`` per block then the root with ``MixedPrecisionPolicy(bf16, reduce fp32)``,
  the loss on ``logits.float()`` as torchtitan computes it), and ``zero3-direct``: paratrain with
  ``loss_fn(model(x), y)``, where the model hands back fp32 outputs.
* **Step time**: every subject built at once, then rounds in which the members of each pair take turns, step by
  step (``--steps`` steps each, the order alternating), so that a clock drifting between rounds (the one-rank
  FSDP step is host-bound and varied 50-77 ms between rounds of one first run) moves both alike. A subject's time
  is the median over rounds of its per-round median; ``x hand`` divides the medians, ``paired`` is the median
  over rounds of the per-round ratio to the hand-written twin. Pairs: ddp, zero3 (eager), and with compilation
  ``ddp+compile`` / ``zero3+compile``:
  ``Parallel(compile=True)`` against each block compiled by hand (``block.compile()``) before ``DDP`` /
  ``fully_shard``. ``hand ddp+compile-whole`` is nanoGPT's ``torch.compile(model)`` then ``DDP``, for scale.

The monitor is off (``monitor=False``) on both sides; it is measured apart (benchmarks/monitor_overhead.py).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
import traceback

import torch
import torch.distributed as dist
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.workloads.gpt import GPT, Block, GPTConfig

SIZES = {
    "124m": GPTConfig(layers=12, hidden=768, heads=12, seq_len=1024, vocab=50304),
    "tiny": GPTConfig(layers=2, hidden=64, heads=4, seq_len=64, vocab=512),
}
MEMORY_SUBJECTS = ("ddp/paratrain", "ddp/hand", "zero3/paratrain", "zero3/paratrain-direct", "zero3/hand")
TIME_PAIRS = ("ddp", "zero3", "ddp+compile", "zero3+compile")


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


class Subject:
    """One way of training the model: built and prepared once, then stepped."""

    def __init__(self, key: str, cfg: GPTConfig, device: torch.device) -> None:
        self.key = key
        pair, self.who = key.split("/")
        self.strategy = pair.split("+")[0]
        compiled = "+compile" in pair
        torch.manual_seed(0)
        model = GPT(cfg).to(device)
        self.par = None
        if self.who.startswith("paratrain"):
            self.par = paratrain.Parallel(
                self.strategy, precision="bf16-mixed", monitor=False, model=paratrain.ModelConfig(compile=compiled)
            )
            self.model, self.opt = self.par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
            return
        if self.who == "hand-whole":
            model = torch.compile(model)
        elif compiled:
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                block.compile()
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            for block in [m for m in model.modules() if isinstance(m, Block)]:
                fully_shard(block, mesh=mesh, mp_policy=mp)
            self.model = fully_shard(model, mesh=mesh, mp_policy=mp)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.autocast = self.strategy == "ddp"

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        if self.par is not None:
            with self.par.step(self.model, self.opt):
                if self.who == "paratrain-direct":
                    self.par.backward(_loss(self.model(x), y))
                else:
                    self.par.forward_backward(self.model, x, y, _loss)
            return
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)
        F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()).backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_phase(cfg: GPTConfig, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device) -> dict:
    out = {}
    for key in MEMORY_SUBJECTS:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        _sync(device)
        before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        try:
            s = Subject(key, cfg, device)
            s.step(*batch)
            _sync(device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(2):
                s.step(*batch)
            _sync(device)
            peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else 0
            out[key] = {"peak_gib": peak / 2**30, "before_gib": before / 2**30}
            del s
        except Exception as err:  # one subject failing must not lose the others' figures
            out[key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(limit=6)}
        print(f"memory {key}: {out[key]}", flush=True)
    return out


def time_phase(
    cfg: GPTConfig,
    batch: tuple[torch.Tensor, torch.Tensor],
    device: torch.device,
    pairs: list[str],
    rounds: int,
    steps: int,
    warmup: int,
) -> dict:
    keys = [f"{p}/{w}" for p in pairs for w in ("paratrain", "hand")]
    if "ddp+compile" in pairs:
        keys.append("ddp+compile/hand-whole")
    subjects, out = {}, {}
    for key in keys:
        start = time.perf_counter()
        try:
            s = Subject(key, cfg, device)
            for _ in range(warmup):
                s.step(*batch)
            _sync(device)
            subjects[key] = s
            out[key] = {"warmup_s": time.perf_counter() - start, "rounds_ms": []}
        except Exception as err:
            out[key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc(limit=8)}
        done = out[key].get("error") or f"{out[key]['warmup_s']:.1f} s"
        print(f"built {key}: {done}", flush=True)
    ready = list(subjects)
    for r in range(rounds):  # each pair's members take turns step by step, so a drifting clock hits them alike
        times: dict[str, list[float]] = {k: [] for k in ready}
        for pair in pairs:
            members = [k for k in ready if k.startswith(pair + "/")]
            for i in range(steps):
                for key in members[i % len(members) :] + members[: i % len(members)]:
                    _sync(device)
                    start = time.perf_counter()
                    subjects[key].step(*batch)
                    _sync(device)
                    times[key].append(time.perf_counter() - start)
        for key in ready:
            out[key]["rounds_ms"].append(1e3 * statistics.median(times[key]))
        print(f"round {r + 1}/{rounds}: " + ", ".join(f"{k} {out[k]['rounds_ms'][-1]:.1f}" for k in ready), flush=True)
    for key in ready:
        out[key]["step_ms"] = statistics.median(out[key]["rounds_ms"])
        hand = out.get(key.split("/")[0] + "/hand", {})
        if hand.get("rounds_ms"):
            pairs_ms = zip(out[key]["rounds_ms"], hand["rounds_ms"])
            out[key]["paired_ratio"] = statistics.median(a / b for a, b in pairs_ms)
    return out


def job(size: str, per_rank: int, rounds: int, steps: int, warmup: int, pairs: list[str], memory: bool) -> dict:
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    )
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    torch._dynamo.config.cache_size_limit = 64  # many instances of one block class are compiled; keep them all
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    cfg = SIZES[size]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab, (per_rank, cfg.seq_len + 1), generator=g).to(device)
    batch = (ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": cfg.__dict__,
        "per_rank": per_rank,
    }
    if memory:
        result["memory"] = memory_phase(cfg, batch, device)
    result["time"] = time_phase(cfg, batch, device, pairs, rounds, steps, warmup)
    finish_group()
    return result


def report(res: dict) -> None:
    print(
        f"\n{res['device']}, torch {res['torch']}; GPT {res['config']['layers']} layers x {res['config']['hidden']}, "
        f"vocab {res['config']['vocab']}, batch {res['per_rank']} x {res['config']['seq_len']}, bf16-mixed, AdamW"
    )
    mem = res.get("memory", {})
    if mem:
        print(f"{'peak memory':<26} {'GiB':>7} {'x hand':>7}")
        for key, row in mem.items():
            hand = mem.get(key.split("/")[0] + "/hand", {})
            if "error" in row:
                print(f"{key:<26} error: {row['error'][:120]}")
                continue
            ratio = row["peak_gib"] / hand["peak_gib"] if hand.get("peak_gib") else float("nan")
            print(f"{key:<26} {row['peak_gib']:>7.2f} {ratio:>7.3f}")
    t = res["time"]
    print(f"{'step time':<26} {'ms':>7} {'x hand':>7} {'paired':>7}  warm-up s  rounds (ms)")
    for key, row in t.items():
        if "error" in row:
            print(f"{key:<26} error: {row['error'][:160]}")
            continue
        hand = t.get(key.split("/")[0] + "/hand", {})
        ratio = row["step_ms"] / hand["step_ms"] if hand.get("step_ms") else float("nan")
        print(
            f"{key:<26} {row['step_ms']:>7.1f} {ratio:>7.3f} {row.get('paired_ratio', 1.0):>7.3f}  "
            f"{row['warmup_s']:>8.1f}  "
            f"{[round(v, 1) for v in row['rounds_ms']]}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="124m", choices=sorted(SIZES))
    p.add_argument("--batch", type=int, default=12, help="sequences per step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-compile", action="store_true", help="leave out the compiled pairs")
    p.add_argument("--no-memory", action="store_true", help="leave out the memory phase")
    p.add_argument("--device", choices=("auto", "cpu"), default="auto")
    p.add_argument("--json", help="write every figure here")
    a = p.parse_args()
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    pairs = [x for x in TIME_PAIRS if not (a.no_compile and "compile" in x)]
    res = paratrain.launch(
        job, 1, (a.size, a.batch, a.rounds, a.steps, a.warmup, pairs, not a.no_memory), timeout_s=3000
    )[0]
    report(res)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
