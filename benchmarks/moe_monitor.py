"""What counting tokens per expert costs the monitor, and what expert parallelism's all-to-all would cost a step.

1. End to end, world size 2 (gloo, 1 thread per rank): one job holds three ``Parallel("ddp")`` objects on one
   shared group, each with its own copy of the same tiny Mixtral (4 blocks of 8 experts, top 2, width 64, 64
   tokens): monitor off, monitor on with ``experts=False``, and the default monitor (tokens per expert counted;
   ``every=50``, so one window, its all-gather and its all-reduce of the counts, falls in each timed block). Timed
   blocks of N steps take turns, the order rotating every round; rank 0's wall time per step; the median of the
   per-round ratios.
2. The counting alone, one process: forward + backward of the same Mixtral with the counter's hooks and without,
   step by step in turn, in this thread's CPU time, the median of the paired differences in microseconds per step;
   one hook call alone (fastest of 5 runs of 2000); and the window's all-reduce of the counts at world 2 (part 1's
   job times it, median of 21).
3. The all-to-all: ``paratrain bench --workload gpt-moe-tiny --nproc 2 --strategies ddp,zero3`` (its report line),
   run separately; see benchmarks/RESULTS.md §31.

Run (about 2 minutes on 2 cores):
    .venv/bin/python benchmarks/moe_monitor.py [--rounds 7] [--steps 50] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from ddp_overhead import CORES, audited, background_line
from torch import nn

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.monitor import MonitorConfig
from paratrain.monitor.experts import ExpertCounter

BATCH_PER_RANK, SEQ, VOCAB = 8, 64, 512
KINDS = {"off": False, "experts off": MonitorConfig(summary=False, experts=False), "on": MonitorConfig(summary=False)}


def mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    return MixtralForCausalLM(
        MixtralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=VOCAB,
            num_local_experts=8,
            num_experts_per_tok=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
        )
    )


def _batches(steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (BATCH_PER_RANK, SEQ), generator=g) for _ in range(steps)]


def _job(monitor: bool | MonitorConfig) -> tuple[paratrain.Parallel, nn.Module, torch.optim.Optimizer]:
    par = paratrain.Parallel("ddp", monitor=monitor)
    model = mixtral()
    model, optimizer = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    return par, model, optimizer


def _block(
    par: paratrain.Parallel, model: nn.Module, optimizer: torch.optim.Optimizer, batches: list[torch.Tensor]
) -> float:
    """Seconds per step over ``batches``."""
    dist.barrier()
    t0 = time.perf_counter()
    for x in batches:
        with par.step(model, optimizer):
            par.backward(model(x, labels=x).loss)
    return (time.perf_counter() - t0) / len(batches)


def end_to_end_worker(rounds: int, steps: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    jobs = {name: _job(monitor) for name, monitor in KINDS.items()}
    batches = _batches(steps, dist.get_rank())
    for job in jobs.values():
        _block(*job, batches)  # warm-up pass
    names = list(jobs)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % 3 :] + names[: r % 3]:
            times[name].append(_block(*jobs[name], batches))
    counter = jobs["on"][0].monitor.experts
    reduce_s = []
    for _ in range(21):  # the window's all-reduce of every layer's counts, alone
        dist.barrier()
        t0 = time.perf_counter()
        counter.window(None, copies=1)
        reduce_s.append(time.perf_counter() - t0)
    loads = [x.to_dict() for x in jobs["on"][0].monitor.expert_loads]
    for par, *_ in jobs.values():
        par.close()
    finish_group()
    return {"times": times, "window_reduce_us": 1e6 * statistics.median(reduce_s), "last_window": loads}


def bench_end_to_end(rounds: int, steps: int) -> dict:
    got = paratrain.launch(end_to_end_worker, 2, args=(rounds, steps), threads=1, timeout_s=900)[0]
    times = got["times"]
    return {
        "per_round_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "ratio_on_off": statistics.median(a / b for a, b in zip(times["on"], times["off"])),
        "ratio_on_experts_off": statistics.median(a / b for a, b in zip(times["on"], times["experts off"])),
        "window_reduce_us": got["window_reduce_us"],
        "last_window": got["last_window"],
    }


def bench_counting(steps: int) -> dict:
    """Microseconds the hooks add to one forward + backward: steps alternate between the model with the counter's
    hooks and without (the order flipping each pair), each timed in this thread's CPU time; the median of the
    paired differences."""
    torch.set_num_threads(1)
    model = mixtral()
    batches = _batches(steps, 0)

    def step(x: torch.Tensor, counted: bool) -> float:
        counter = ExpertCounter(torch.device("cpu"))
        if counted:
            counter.watch(model)
        t0 = time.thread_time()
        model(x, labels=x).loss.backward()
        spent = time.thread_time() - t0
        counter.close()
        return spent

    step(batches[0], False)  # warm-up
    pairs = []
    for i, x in enumerate(batches):
        order = (False, True) if i % 2 == 0 else (True, False)
        spent = dict(zip(order, (step(x, counted) for counted in order)))
        pairs.append((spent[False], spent[True]))
    return {
        "us_per_step": 1e6 * statistics.median(on - off for off, on in pairs),
        "step_ms": 1e3 * statistics.median(off for off, _ in pairs),
        "steps": steps,
        "pairs_ms": [[1e3 * off, 1e3 * on] for off, on in pairs],
        "hook_us": _hook_us(),
    }


def _hook_us(calls: int = 2000) -> float:
    """One hook call on one layer's routing of this batch (8 x 64 tokens, top 2 of 8), fastest of 5 runs."""
    counts = torch.zeros(9, dtype=torch.int64)
    hook = ExpertCounter._hook(counts, 8)
    tokens = BATCH_PER_RANK * SEQ
    args = (torch.randn(tokens, 64), torch.randint(0, 8, (tokens, 2)), torch.rand(tokens, 2))
    runs = []
    for _ in range(5):
        t0 = time.thread_time()
        for _ in range(calls):
            hook(None, args, {})
        runs.append((time.thread_time() - t0) / calls)
    return 1e6 * min(runs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=50, help="steps per timed block (part 1)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 10 steps: checks that it runs, measures little")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    rounds, steps = (3, 10) if args.quick else (args.rounds, args.steps)
    e2e = audited(lambda: bench_end_to_end(rounds, steps))
    hot = audited(lambda: bench_counting(200 if not args.quick else 10))
    print(
        f"paratrain {paratrain.__version__}, torch {torch.__version__}, {CORES} cores, gloo; tiny Mixtral "
        f"(4 blocks x 8 experts, top 2, width 64), batch {BATCH_PER_RANK}x{SEQ} tokens/rank, world 2, "
        f"rounds={rounds} steps={steps}"
    )
    print("1. End to end, ms per step (rank 0)")
    print(f"   {'round':<8}" + "".join(f"{k:>13}" for k in KINDS))
    per = e2e["per_round_ms"]
    for i, row in enumerate(zip(*(per[k] for k in KINDS)), 1):
        print(f"   {i:<8}" + "".join(f"{v:>13.2f}" for v in row))
    print(f"   {'median':<8}" + "".join(f"{e2e['median_ms'][k]:>13.2f}" for k in KINDS))
    print(
        f"   on / off {e2e['ratio_on_off']:.3f}, on / experts off {e2e['ratio_on_experts_off']:.3f} (medians of "
        f"the per-round ratios); the window's all-reduce of the counts: {e2e['window_reduce_us']:.0f} us, "
        "once per 50 steps"
    )
    print(background_line(e2e))
    print(
        f"2. The counting hooks alone add {hot['us_per_step']:.0f} us to a {hot['step_ms']:.1f} ms forward + "
        f"backward ({hot['us_per_step'] / 1e3 / hot['step_ms']:.2%}; median of {hot['steps']} paired steps, "
        f"thread CPU time); one "
        f"hook call takes {hot['hook_us']:.1f} us, 4 per step: {4 * hot['hook_us']:.0f} us "
        f"({4 * hot['hook_us'] / 1e3 / hot['step_ms']:.2%})"
    )
    print(background_line(hot))
    result = {"end_to_end": e2e, "counting": hot}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
