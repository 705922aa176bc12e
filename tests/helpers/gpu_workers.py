"""Workers only the GPU suite runs (tests/helpers/gpu_cases.py), with the verdicts the test process passes on them.

The suite's other cases are the CPU suites' own workers; these add what those do not choose: the optimizer's
multi-tensor and fused paths asked for by name, and one function running the three saves of an asynchronous
checkpoint's check.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

import paratrain
from helpers.checkpoint_async_workers import slow_writes
from helpers.checkpoint_workers import train
from helpers.dist_workers import build_model, global_batches

STEPS = 20
_SLOW_WRITES: list[float] = []  # this process's DCP writes already start late
OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3),
    "adamw foreach": lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=True),
    "adamw fused": lambda params: torch.optim.AdamW(params, lr=1e-3, fused=True),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "sgd foreach": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, foreach=True),
    "sgd fused": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True),
}
"""By name (a case is pickled to the ranks): CUDA's default is the multi-tensor path; each asked for explicitly."""


def optimizer_case(strategy: str, optimizer: str, options: dict, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of the MLP of tests/helpers/dist_workers.py with the optimizer named, each on a global batch
    of ``global_batch`` samples split over the replicas: the full state."""
    par = paratrain.Parallel(strategy, monitor=False, **options)
    model = build_model()
    model, opt = par.prepare(model, OPTIMIZERS[optimizer](model.parameters()))
    per, r = global_batch // par.data_parallel_size, par.data_parallel_rank
    x, y = global_batches(STEPS, global_batch)
    for s in range(STEPS):
        mine = slice(s * global_batch + r * per, s * global_batch + (r + 1) * per)
        with par.step(model, opt):
            par.forward_backward(model, x[mine].to(par.device), y[mine].to(par.device), nn.functional.cross_entropy)
    out = par.full_state_dict(model, rank0_only=False)
    par.close()
    return out


def one_process(optimizer: str, global_batch: int = 8) -> dict[str, torch.Tensor]:
    """:func:`optimizer_case`'s reference: one plain process on the host."""
    return optimizer_case("single", optimizer, {"accelerator": "cpu"}, global_batch)


def async_save_case(strategy: str, options: dict, folder: str, steps: int = 8, at: int = 3) -> dict:
    """The dropout MLP with Adam trained ``steps`` steps three times: saving at step ``at`` blocking, saving there in
    the background (staged: training goes on while it is written), and resumed from the background save. Every
    write starts half a second late, so the steps after the save run while it is written."""
    if not _SLOW_WRITES:
        slow_writes(0.5)
        _SLOW_WRITES.append(0.5)
    runs = {
        "blocking": train(strategy, steps, f"{folder}/blocking", save_at=at, options=options),
        "async": train(strategy, steps, f"{folder}/async", save_at=at, options=options, async_save=True),
        "resumed": train(strategy, steps, f"{folder}/async", load=True, options=options),
    }
    return {name: {k: run[k] for k in ("params", "optim", "published_on_return")} for name, run in runs.items()}


def saved_in_the_background(result: dict) -> str:
    """Verdict on :func:`async_save_case`: the background save changed nothing, was written after ``save``
    returned, and the job resumed from it ends bitwise where the saving job ended."""
    blocking, background, resumed = result["blocking"], result["async"], result["resumed"]
    if background["published_on_return"]:
        return "the background save was complete when save() returned: it held the loop"
    for label, a, b in (("the background save's run", blocking, background), ("the resumed run", background, resumed)):
        for part in ("params", "optim"):
            differ = [k for k in a[part] if not torch.equal(a[part][k].cpu(), b[part][k].cpu())]
            if differ:
                return f"{label}'s {part} differ: {differ[:4]}"
    return ""


def names_the_straggler(result: dict) -> str:
    """Verdict on ``monitor_workers.straggler``: the monitor names rank 1, and nothing else."""
    found = [(kind, rank) for kind, rank, _, _ in result["warnings"]]
    return "" if found == [("straggler", 1)] else f"the monitor warned {found}, not of the straggler rank 1"


def built_exactly(result: dict) -> str:
    """Verdict on ``ep_workers.built_case``: the meta build and ``load_weights`` each equal the plain build."""
    return "" if result == {"meta": 0.0, "weights": 0.0} else f"differs from the plain build by {result}"
