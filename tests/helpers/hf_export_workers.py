"""Hugging Face export inside a launched job (tests/checkpoint/test_hf_export.py): a zoo model trained under a layout
and saved; rank 0 exports the checkpoint with ``--format hf``; the export loaded back with ``load_weights`` under ddp
and zero3 on the same ranks."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import paratrain
from helpers.zoo import SPECS
from helpers.zoo_workers import STEPS, _prepared, _train
from paratrain.checkpoint import export

LOADED = ("ddp", "zero3")
"""The layouts the export is loaded back into."""


def export_round(model_name: str, strategy: str, options: dict, folder: str) -> dict:
    """Train ``STEPS`` steps, save, export (rank 0), load the export into each of :data:`LOADED`; every rank returns
    the trained full state, each layout's loaded full state and the export's folder."""
    spec = SPECS[model_name]
    par, model, opt, _ = _prepared(strategy, options, spec)
    _train(par, spec, model, opt, range(STEPS))
    par.save(folder)
    trained = par.full_state_dict(model, rank0_only=False)
    par.close()
    out = os.path.join(folder, "hf")
    if dist.get_rank() == 0:
        export(folder, out, format="hf", shard_bytes=2**14)  # several shards even for a tiny model
    dist.barrier()
    loaded = {}
    for layout in LOADED:
        par = paratrain.Parallel(layout, monitor=False)
        model = par.prepare(spec.build())
        with torch.no_grad():
            for p in par.unwrap(model).parameters():  # nothing of the initial weights may survive the load
                p.zero_()
        par.load_weights(model, out)
        loaded[layout] = par.full_state_dict(model, rank0_only=False)
        par.close()
    return {"trained": trained, "loaded": loaded, "out": out}
