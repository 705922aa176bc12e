"""The pipeline schedules side by side: a GPT deep enough for two stages per rank on up to 4 ranks (8 blocks), for
``paratrain bench --schedules``, which times every schedule in one job, in turns (interleaved rounds).

    PYTHONPATH=.:src paratrain bench --workload benchmarks.zero_bubble:workload --nproc 2 --strategies pipeline \\
        --schedules 1f1b,interleaved-1f1b,interleaved-zb,zbv,dualpipev --batch 32 --rounds 5 --no-comm-probe

Each row is the same model on the same batches (``--batch`` samples a step, cut into the strategy's 4 micro-batches);
only the order of the stages' forwards, input gradients and weight gradients differs.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from paratrain.planner.transformer import GPTConfig
from paratrain.workloads.gpt import GPT
from paratrain.workloads.workload import Workload

CONFIG = GPTConfig(layers=8, hidden=128, heads=4, seq_len=64, vocab=512)


def workload() -> Workload:
    """``CONFIG`` on random tokens, next-token loss, AdamW."""

    def make_batch(samples: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, CONFIG.vocab, (samples, CONFIG.seq_len + 1), generator=generator)
        return tokens[:, :-1], tokens[:, 1:]

    return Workload(
        name="gpt-8-blocks",
        model=lambda: GPT(CONFIG),
        loss=lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten()),
        make_batch=make_batch,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4),
        description=f"GPT {CONFIG.layers} layers x {CONFIG.hidden} wide, {CONFIG.seq_len} tokens, vocab "
        f"{CONFIG.vocab}, AdamW, random tokens",
    )
