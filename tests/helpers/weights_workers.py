"""The pretrained-weights x strategy job: every case of one world size in one launched job. Each case builds a zoo
model (on the meta device, or normally), prepares it, reads a weights file into it with ``par.load_weights`` and
returns the full state dict (rank 0) and how many bytes each rank read."""

from __future__ import annotations

import torch
import torch.distributed as dist

import paratrain
from helpers.cases import each_case
from helpers.zoo import ZOO


def weights_case(model_name: str, strategy: str, options: dict, path: str, meta: bool) -> dict:
    spec = ZOO[model_name.split(":")[0]]  # "gpt2:export": the zoo's gpt2, read from another kind of file
    par = paratrain.Parallel(strategy, monitor=False, **({"init_fn": "empty"} if meta else {}), **options)
    if meta:
        with torch.device("meta"):
            model = spec.build()
    else:
        model = spec.build()
    model = par.prepare(model)
    read = par.load_weights(model, path)
    state = {k: v.clone() for k, v in par.full_state_dict(model, rank0_only=False).items()}
    buffers = {n: b.detach().clone() for n, b in par.unwrap(model).named_buffers() if not hasattr(b, "device_mesh")}
    every: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, read["bytes_read"])
    par.close()
    return {"state": state, "bytes": every, "buffers": buffers}


def run_weights_cases(cases: list[tuple[str, str, dict, str, bool]]) -> dict[str, dict]:
    return each_case(
        cases, lambda _, c: weights_case(*c), key=lambda c: f"{c[0]}/{c[1]}{c[2] or ''}/{'meta' if c[4] else 'built'}"
    )
