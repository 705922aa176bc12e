"""Our GPT with experts under ``Parallel("zero3", ep=2)``, for the restart test with expert parallelism
(tests/distributed/test_expert_parallel.py).

Usage: paratrain run -n 2 [--checkpoint-dir D --checkpoint-every N --max-restarts 1] ep_restart_job.py [STEP RANK]
With STEP and RANK, rank RANK SIGKILLs itself after optimizer step STEP (of 12) on the job's first attempt. Rank 0
prints ``final parameters sha256 <digest>`` of the consolidated state at the end; ``main`` returns it (on rank 0).
"""

import os
import signal
import sys

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.digest import state_digest
from paratrain.planner.moe import MoE
from paratrain.planner.transformer import GPTConfig
from paratrain.workloads.gpt import GPT


def main(fail_step: int | None, fail_rank: int | None) -> str:
    par = paratrain.Parallel("zero3", ep=2, seed=0, monitor=False)
    torch.manual_seed(0)
    model = GPT(
        GPTConfig(
            layers=2,
            hidden=32,
            heads=2,
            seq_len=8,
            vocab=65,
            gated=True,
            bias=False,
            tied=False,
            learned_positions=False,
            moe=MoE(experts=4, top_k=2, ffn=16),
        )
    )
    ids = torch.randint(0, 65, (96, 9), generator=torch.Generator().manual_seed(1))
    loader = DataLoader(TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=8, shuffle=True)
    model, optimizer, loader = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), loader)
    for _ in par.epochs(2):
        for x, y in loader:
            with par.step(model, optimizer):
                par.forward_backward(
                    model,
                    x.to(par.device),
                    y.to(par.device),
                    lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()),
                )
            if (
                par.optimizer_steps == fail_step
                and par.rank == fail_rank
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
            ):
                print(f"fault injection: SIGKILL rank {par.rank} after step {fail_step}", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
    state = par.full_state_dict(model)
    digest = state_digest(state) if par.is_main else ""
    par.print(f"final parameters sha256 {digest}")
    par.close()
    return digest


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3])) if len(sys.argv) > 2 else main(None, None)
