"""The GPU suite's cases (tests/gpu/): per world size, the layouts users run, each a CPU suite's worker on
``accelerator`` and compared with that suite's one-process reference on the same global batch.

``layouts(2 | 4, ...)``: ddp, zero3 and hsdp, tp, ep under ddp and zero3, cp, pipelines, asynchronous checkpoints,
CPU offload with clipping, a meta build with ``load_weights``, the monitor. ``one_gpu(...)``: world-1 versions that
still take the CUDA paths: the current device, the multi-tensor and fused optimizers asked for explicitly, CPU offload
with clipping (a group serving host tensors beside NCCL), asynchronous staging, a meta build with ``load_weights`` on
``cuda:0``, bf16 autocast. Every list builds on any accelerator, and all but the CPU-offload and fp16 cases (pinned host
memory, the gradient scaler: CUDA's) also run on gloo (tests/gpu/test_gpu_cases.py runs some in ``make test``).
"""

from __future__ import annotations

import os
from functools import partial

from helpers import cp_workers, ep_workers, tp_workers, zoo_workers
from helpers.dist_workers import train_params
from helpers.gpu_job import Case, equals
from helpers.gpu_workers import (
    async_save_case,
    built_exactly,
    names_the_straggler,
    one_process,
    optimizer_case,
    saved_in_the_background,
)
from helpers.monitor_workers import straggler

STEPS, BATCH = 20, 8
SMALL_UNITS = {"min_params": 100}  # the MLP's blocks are small: make each one a sharding unit
CLIP = 0.05  # below the MLP's gradient norm: every step clips
TOL = 1e-4  # fp32 on cuBLAS against the host's kernels, a few steps
BF16_TOL = 3e-3
FP16_TOL = 1e-2  # fp16 autocast against fp32, three steps of a mixture of experts


def serial(global_batch: int, **kwargs: object) -> dict:
    """``train_params``'s reference: one process on the host, ``global_batch`` samples a step."""
    return train_params("single", 1, STEPS, global_batch, 1, accelerator="cpu", **kwargs)


def cp_state(name: str, mode: str, replicas: int) -> dict:
    return cp_workers.reference(name, mode, replicas)[0]


def _label(layout: dict) -> str:
    return "".join(f" {k}={v}" for k, v in layout.items())


def _mlp(
    name: str,
    strategy: str,
    world: int,
    replicas: int,
    options: dict,
    *,
    per_rank: int = BATCH,
    clip: float | None = None,
    **case: object,
) -> Case:
    """``train_params`` of ``strategy`` against one process on the same global batch (``replicas`` slices)."""
    extra = {"clip_grad_norm": clip} if clip else {}
    return Case(
        name,
        train_params,
        (strategy, 1, STEPS, per_rank, world, options),
        extra,
        equals(serial, per_rank * replicas, tol=TOL, field=None, **extra),
        **case,
    )


def _zoo(model: str, strategy: str, layout: dict, acc: dict, replicas: int, folder: str) -> Case:
    return Case(
        f"{model} {strategy}{_label(layout)}",
        zoo_workers.run_case,
        (model, strategy, {**layout, **acc}, folder),
        verdict=equals(zoo_workers.reference, model, replicas, tol=TOL),
    )


def _tp(strategy: str, layout: dict, acc: dict, folder: str) -> Case:
    """llama under tp (one replica of the batch per tp group: the reference reads the batch whole)."""
    return Case(
        f"llama {strategy}{_label(layout)}",
        tp_workers.run_case,
        ("llama", strategy, {**layout, **acc}, folder),
        verdict=equals(zoo_workers.reference, "llama", 1, tol=TOL),
    )


def _ep(model: str, strategy: str, layout: dict, acc: dict, replicas: int, folder: str, tol: float = TOL) -> Case:
    """Experts are DTensors beside plain parameters: CUDA's default multi-tensor optimizer (and fp16's gradient
    scaler) must never see both in one group."""
    return Case(
        f"{model} {strategy}{_label(layout)}",
        ep_workers.run_case,
        (model, strategy, {**layout, **acc}, folder, ()),
        verdict=equals(ep_workers.reference, model, replicas, tol=tol),
    )


def _async(strategy: str, acc: dict, folder: str) -> Case:
    return Case(f"async save {strategy}", async_save_case, (strategy, acc, folder), verdict=saved_in_the_background)


def _built(strategy: str, layout: dict, acc: dict, folder: str) -> Case:
    return Case(
        f"mixtral {strategy}{_label(layout)} meta + load_weights",
        ep_workers.built_case,
        ("mixtral", strategy, {**layout, **acc}, folder),
        verdict=built_exactly,
        steps=False,
    )


def _offload(world: int, acc: dict) -> Case:
    """zero3 with its shards, gradients and optimizer state in host memory, clipping every step: the gradients'
    norm is reduced as a host tensor, so the job's group must serve host tensors beside NCCL."""
    return _mlp(
        "zero3 cpu_offload clip",
        "zero3",
        world,
        world,
        {**acc, **SMALL_UNITS, "cpu_offload": True},
        clip=CLIP,
        home="cpu",
        own_group=True,
    )


def layouts(world: int, accelerator: str, folder: str) -> list[Case]:
    """The launched job's cases at ``world`` (2 or 4) processes, one GPU each."""
    acc = {"accelerator": accelerator}
    at = partial(os.path.join, folder)
    if world == 4:
        return [
            _mlp("hsdp", "hsdp", 4, 4, {**acc, **SMALL_UNITS}),
            _mlp("hybrid ddp x pipeline", "hybrid", 4, 2, acc),
            _tp("zero3", {"tp": 2}, acc, at("tp")),
            _ep("gpt_moe", "ddp", {"ep": 2}, acc, 4, at("ep")),
        ]
    return [
        _mlp("ddp, its own group", "ddp", 2, 2, acc, own_group=True),
        _offload(2, acc),
        _zoo("gpt2", "ddp", {}, acc, 2, at("gpt2")),
        _zoo("llama", "zero3", {}, acc, 2, at("llama")),
        _tp("tp", {}, acc, at("tp")),
        _ep("mixtral", "ddp", {"ep": 2}, acc, 2, at("ep-ddp")),
        _ep("gpt_moe", "zero3", {"ep": 2}, acc, 2, at("ep-zero3")),
        _ep("mixtral", "ddp", {"ep": 2, "precision": "fp16-mixed"}, acc, 2, at("ep-fp16"), tol=FP16_TOL),
        Case(
            "llama ddp cp=2",
            cp_workers.run_case,
            ("llama", "ddp", {"cp": 2, **acc}, "labels", at("cp")),
            verdict=equals(cp_state, "llama", "labels", 1, tol=TOL),
        ),
        Case(  # attention found by its SDPA call (CUDA's flash/cuDNN kernels under the exchange), latent attention
            "titan_dsv3 zero3 cp=2",
            cp_workers.run_case,
            ("titan_dsv3", "zero3", {"cp": 2, **acc}, "loss_fn", at("cp-sdpa")),
            verdict=equals(cp_state, "titan_dsv3", "loss_fn", 1, tol=TOL),
        ),
        _mlp("pipeline 1f1b", "pipeline", 2, 1, {**acc, "schedule": "1f1b", "microbatches": 4}, per_rank=2 * BATCH),
        _async("ddp", acc, at("async-ddp")),
        _async("zero3", acc, at("async-zero3")),
        _built("zero3", {"ep": 2}, acc, at("built")),
        Case("monitor", straggler, (accelerator,), verdict=names_the_straggler, own_group=True),
    ]


def one_gpu(accelerator: str, folder: str) -> list[Case]:
    """The launched job's cases at world 1, on ``cuda:0``: each strategy still starts a group and takes the
    device's own paths."""
    acc = {"accelerator": accelerator}
    optimizers = [("ddp", "adamw foreach"), ("ddp", "sgd fused"), ("zero3", "adamw fused"), ("zero3", "sgd foreach")]
    return [
        *[
            Case(
                f"{s} {o}",
                optimizer_case,
                (s, o, acc),
                verdict=equals(one_process, o.split()[0], tol=TOL, field=None),
                own_group=True,
            )
            for s, o in optimizers
        ],
        _offload(1, acc),
        _async("zero3", acc, os.path.join(folder, "async")),
        _built("zero3", {}, acc, os.path.join(folder, "built")),
        Case(
            "ddp bf16-mixed",
            train_params,
            ("ddp", 1, STEPS, BATCH, 1, acc),
            {"precision": "bf16-mixed"},
            equals(serial, BATCH, tol=BF16_TOL, field=None),
            own_group=True,
        ),
    ]
