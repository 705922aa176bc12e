"""Hugging Face export inside a launched job (tests/checkpoint/test_checkpoint_dist.py): a zoo model trained under a
layout and saved; rank 0 exports the checkpoint with ``--format hf``; the export loaded back with ``load_weights`` under
ddp, zero3 and the layout it was trained in, on the same ranks. And the check of an export against ``from_pretrained``
(tests/checkpoint/test_hf_export.py too)."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.distributed as dist

import paratrain
from helpers.zoo import SPECS
from helpers.zoo_workers import _prepared, _train
from paratrain.checkpoint import export

STEPS = 2
LOADED = ("ddp", "zero3")
"""The layouts the export is loaded back into, besides the one it was trained in."""


def export_round(model_name: str, strategy: str, options: dict, folder: str) -> dict:
    """Train ``STEPS`` steps, save, export (rank 0), load the export into each of :data:`LOADED` and the trained layout
    (``"trained"``); every rank returns the trained full state, each layout's loaded full state and the export's
    folder."""
    spec = SPECS[model_name]
    par, model, opt, _ = _prepared(strategy, options, spec)
    _train(par, spec, model, opt, range(STEPS))
    par.save(folder)
    trained = par.full_state_dict(model, rank0_only=False)
    par.close()
    out = os.path.join(folder, "hf")
    problem = [None]
    if dist.get_rank() == 0:
        try:
            export(folder, out, format="hf", shard_bytes=2**14)  # several shards even for a tiny model
        except paratrain.ParatrainError as err:
            problem = [str(err)]
    dist.broadcast_object_list(problem)  # a failed export fails every rank alike, and the job's next case runs
    if problem[0] is not None:
        raise paratrain.ParatrainError(problem[0])
    loaded = {}
    for name, layout, opts in [(s, s, {}) for s in LOADED] + [("trained", strategy, options)]:
        par = paratrain.Parallel(layout, monitor=False, **opts)
        model = par.prepare(spec.build())
        with torch.no_grad():
            for p in par.unwrap(model).parameters():  # nothing of the initial weights may survive the load
                p.zero_()
        par.load_weights(model, out)
        loaded[name] = par.full_state_dict(model, rank0_only=False)
        par.close()
    return {"trained": trained, "loaded": loaded, "out": out}


def logits(model: torch.nn.Module) -> torch.Tensor:
    x = torch.arange(16).reshape(2, 8) % 64
    with torch.no_grad():
        return model(x).logits


def same_as_pretrained(out: str, build: Callable[[], torch.nn.Module], state: dict[str, torch.Tensor]) -> None:
    """``from_pretrained(out)`` loads every tensor (none missing or unexpected) and computes the logits of the trained
    model (``build()`` holding ``state``)."""
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    reference = build()
    reference.load_state_dict(state)
    assert torch.equal(logits(loaded), logits(reference))
