"""The meta-device x strategy job: every case of one world size in one launched job, on one process group.

Each case builds a zoo model under ``with torch.device("meta"):``, prepares it (each rank materializes what it holds),
takes the full state dict as prepared, then trains ``STEPS`` steps as tests/helpers/zoo_workers.py does. Rank 0 returns
per case both state dicts, the data-parallel size (for the one-process reference) and what ``_audit`` found.
"""

from __future__ import annotations

import torch

import paratrain
from helpers.cases import each_case
from helpers.zoo import ZOO
from helpers.zoo_workers import STEPS, _audit, _train
from paratrain.model import find_ties


def meta_case(model_name: str, strategy: str, options: dict) -> dict:
    spec = ZOO[model_name]
    par = paratrain.Parallel(strategy, monitor=False, **options)
    with torch.device("meta"):
        model = spec.build()
    ties = find_ties(model).groups
    model, opt = par.prepare(model, spec.optimizer(model))
    problems = [_audit(par, model, opt, ties)]
    inner = par.unwrap(model)
    buffers = {n: b.detach().clone() for n, b in inner.named_buffers() if not hasattr(b, "device_mesh")}
    initial = {k: v.clone() for k, v in par.full_state_dict(model, rank0_only=False).items()}
    _train(par, spec, model, opt, range(STEPS))
    final = par.full_state_dict(model, rank0_only=False)
    replicas = par.data_parallel_size
    par.close()
    return {
        "initial": initial,
        "state": final,
        "buffers": buffers,
        "replicas": replicas,
        "problems": [p for p in problems if p],
    }


def run_meta_cases(cases: list[tuple[str, str, dict]]) -> dict[str, dict]:
    """Every case in order; a case that raises is reported with its one-line error instead of stopping the rest."""
    return each_case(cases, lambda _, c: meta_case(*c), key=lambda c: f"{c[0]}/{c[1]}{c[2] or ''}")
