"""Real tokens per second of packed rows against padded rows at the same token budget per step.

The same documents (lengths drawn uniformly from ``--min-len`` to ``--max-len``) are fed two ways to transformers'
``LlamaForCausalLM`` (small trunk, fp32, one process) through ``par.forward_backward`` and an SGD step:

* padded: each document a row of its own, padded to ``--max-len`` (``attention_mask``, -100 labels on the padding);
  ``--budget / --max-len`` rows per step;
* packed: documents packed by transformers' ``DataCollatorWithFlattening`` into one row of at most ``--budget``
  tokens (``position_ids`` restarting per document; attention within each document).

Both variants take ``--budget`` tokens a step; the packed one spends them on real tokens. Rounds interleave one step
of each after a warm-up step each. Reported: medians over the rounds of the step time, wall and this process's CPU
time (steadier on a shared machine), and of real (non-padding) tokens per second of each.

    PYTHONPATH=src .venv/bin/python benchmarks/packed.py [--budget 2048] [--min-len 16] [--max-len 256]
        [--rounds 6] [--threads 2]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

import paratrain


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    )
    return LlamaForCausalLM(cfg)


def _documents(g: torch.Generator, budget: int, lo: int, hi: int, count: int | None = None) -> list[list[int]]:
    """Documents up to ``budget`` tokens in all (or ``count`` of them)."""
    docs, used = [], 0
    while True:
        n = int(torch.randint(lo, hi + 1, (1,), generator=g))
        if (count is not None and len(docs) == count) or (count is None and used + n > budget):
            return docs
        docs.append(torch.randint(0, 4096, (n,), generator=g).tolist())
        used += n


def _padded(docs: list[list[int]], length: int) -> dict[str, torch.Tensor]:
    ids = torch.zeros(len(docs), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, d in enumerate(docs):
        ids[i, : len(d)], mask[i, : len(d)] = torch.tensor(d), 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _packed(docs: list[list[int]]) -> dict[str, torch.Tensor]:
    from transformers import DataCollatorWithFlattening

    return DataCollatorWithFlattening(return_tensors="pt")([{"input_ids": d} for d in docs])


def _step(par: paratrain.Parallel, model, opt, batch: dict[str, torch.Tensor]) -> tuple[float, float]:
    """Wall and CPU seconds of one step."""
    wall, cpu = time.perf_counter(), time.process_time()
    with par.step(model, opt):
        par.forward_backward(model, batch)
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", type=int, default=2048)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("transformers").setLevel(logging.ERROR)
    par = paratrain.Parallel("single", monitor=False)
    runs = {}
    for name in ("padded", "packed"):
        model = _model()
        runs[name] = par.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[tuple[float, float]]] = {"padded": [], "packed": []}
    real: dict[str, list[int]] = {"padded": [], "packed": []}
    for r in range(args.rounds + 1):
        rows = _documents(g, 0, args.min_len, args.max_len, count=args.budget // args.max_len)
        batches = {"padded": (_padded(rows, args.max_len), rows), "packed": (None, None)}
        docs = _documents(g, args.budget, args.min_len, args.max_len)
        batches["packed"] = (_packed(docs), docs)
        for name, (batch, held) in batches.items():
            took = _step(par, *runs[name], batch)
            if r:  # the first round warms up
                times[name].append(took)
                real[name].append(sum(len(d) for d in held))
    print(f"budget {args.budget} tokens/step, documents {args.min_len}..{args.max_len} tokens, {args.rounds} rounds")
    for name in ("padded", "packed"):
        wall, cpu = (statistics.median(t[i] for t in times[name]) for i in (0, 1))
        rates = [(n / w, n / c) for n, (w, c) in zip(real[name], times[name])]
        print(
            f"{name:7s} step {wall * 1e3:7.1f} ms wall {cpu * 1e3:7.1f} ms cpu  real tokens/step "
            f"{statistics.median(real[name]):6.0f}  real tokens/s {statistics.median(r[0] for r in rates):7.0f} wall "
            f"{statistics.median(r[1] for r in rates):7.0f} per cpu-s"
        )
    par.close()


if __name__ == "__main__":
    main()
