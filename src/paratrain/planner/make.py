"""One call from a model and a plan's options (``PlanConfig``) to a Plan: model stats, cluster, training setup,
calibration, recommendation. The model comes resolved: what a name means is the caller's to say."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from ..errors import ConfigError
from .collectives import measured_link
from .config import Measured, PlanConfig
from .estimates import estimate
from .gpu_step import GpuStep, check_same_gpu, time_gpu_step
from .hardware import Cluster, calibrated
from .layout import Layout
from .model_stats import ModelStats, RunnableModel
from .packing import packed
from .recommend import Plan, recommend
from .tensor_parallel import collectives_per_micro_batch
from .timing import executed_flops_per_sample, fsdp_call_from, optimizer_step_bytes, weight_bytes
from .training import Training


def make_plan(model: ModelStats | RunnableModel, config: PlanConfig | None = None) -> Plan:
    """The plan for ``model`` under ``config`` (its ``model_spec`` is what ``model`` was built from: the planner
    never builds by name).

    ``model``: its stats, found already (``--params``' closed forms), or a model the planner may build: its stats
    are then its closed-form ones or a meta-device trace (``RunnableModel.find_stats``).

    ``config.step_time`` (seconds of one forward+backward+step of one micro-batch on one device) calibrates the
    device's MFU; with ``optimizer_time`` (the optimizer step timed apart) ``step_time`` is the forward+backward
    alone and the optimizer's time also calibrates the memory bandwidth. ``threads``: on a CPU host, the cores
    the measured step used. ``measure`` runs the model here and, when the device is this CPU, calibrates from
    that (a forward+backward on torch's threads). ``config.measured`` holds figures timed elsewhere (see
    :class:`~.config.Measured`).
    """
    config = config or PlanConfig()
    cluster, setup, measured = config.cluster(), config.training, config.measured or Measured()
    if measured.link_timings:
        cluster = replace(cluster, intra=measured_link(cluster.intra, config.gpus, measured.link_timings))
    on_gpu = config.measure and not cluster.device.shared_by_ranks and torch.cuda.is_available()
    stats = _stats(model, config, measure_batch=setup.micro_batch if config.measure and not on_gpu else None)
    gpu = _time_on_gpu(model, cluster, setup) if on_gpu else None
    cluster = _calibrated(cluster, stats, setup, config, measured, gpu)
    plan = recommend(
        stats,
        cluster,
        setup,
        tp=config.tp,
        exact=config.exact,
        ps_servers=config.ps_servers,
        ep=config.ep,
        cp=config.cp,
        strategy=config.exact_strategy,
    )
    if gpu is None:
        return plan
    return replace(
        plan,
        notes=(
            *plan.notes,
            (
                f"measured on this machine's {gpu.gpu} at batch {gpu.batch}: forward+backward "
                f"{gpu.forward_backward_s * 1e3:.1f} ms, optimizer step {gpu.optimizer_s * 1e3:.1f} ms, peak "
                f"{gpu.peak_bytes / 2**30:.2f} GiB allocated (the plan's single rank, overhead excluded: "
                f"{_single_allocated(plan) / 2**30:.2f} GiB)"
            ),
        ),
    )


def _stats(model: ModelStats | RunnableModel, config: PlanConfig, measure_batch: int | None) -> ModelStats:
    """``model``'s stats (found when not given: measured at ``measure_batch`` samples, else closed forms or a trace)
    for rows packed with documents of ``Training.document_tokens`` tokens: a trace counts its attention calls so, the
    closed forms' attention is scaled after (:mod:`.packing`)."""
    documents = config.training.document_tokens
    if isinstance(model, ModelStats):
        return packed(model, documents)
    runnable = replace(model, call=replace(model.call, document_tokens=documents))
    return packed(runnable.find_stats(measure_batch, config.tp, config.cp), documents)


def _calibrated(
    cluster: Cluster, stats: ModelStats, setup: Training, config: PlanConfig, measured: Measured, gpu: GpuStep | None
) -> Cluster:
    """``cluster`` with its device's rates set from the step times measured (given, timed on this GPU, or traced on
    this CPU), and FSDP's and TP's per-call overheads from ``measured``."""
    step_time, optimizer_time, threads = config.step_time, config.optimizer_time, config.threads
    if gpu is not None and step_time is None:
        step_time, optimizer_time = gpu.forward_backward_s, gpu.optimizer_s
    with_optimizer = step_time is not None
    if step_time is None and stats.measured_step_s is not None and cluster.device.shared_by_ranks:
        step_time, threads = stats.measured_step_s, stats.measured_threads
    micro, host = measured.micro_step_time, measured.host_step_time
    if step_time is not None:
        executed = executed_flops_per_sample(stats, setup)  # what step_time prices: the calibration inverts it
        cluster = calibrated(
            cluster,
            flops_per_step=executed * setup.micro_batch,
            step_time_s=step_time,
            precision=setup.precision,
            streamed_bytes=weight_bytes(stats.params, setup, cluster),
            optimizer_bytes=optimizer_step_bytes(stats.params, setup) if with_optimizer else 0.0,
            optimizer_s=optimizer_time,
            threads=threads,
            micro_step=None if micro is None else (executed * micro[0], micro[1]),
            host_step=host,
        )
    elif micro is not None or host is not None:
        raise ConfigError(
            "a smaller or an all-cores forward+backward calibrates together with --step-time and --optimizer-time"
        )
    if measured.tp_step_time is not None:
        cluster = replace(
            cluster,
            device=replace(cluster.device, tp_call_s=tp_call_from(measured.tp_step_time, stats, setup, cluster)),
        )
    if measured.fsdp_overhead:
        if optimizer_time is None:
            raise ConfigError("FSDP's overhead calibrates together with --step-time and --optimizer-time")
        bandwidth = optimizer_step_bytes(stats.params, setup) / optimizer_time  # the measuring thread's
        cluster = replace(
            cluster,
            device=replace(cluster.device, fsdp_call_s=fsdp_call_s(measured.fsdp_overhead, stats, setup, bandwidth)),
        )
    return cluster


def _time_on_gpu(model: ModelStats | RunnableModel, cluster: Cluster, setup: Training) -> GpuStep:
    """A few real steps of ``model`` on this machine's GPU, which must be the one planned for."""
    if isinstance(model, ModelStats):
        raise ConfigError("--measure runs a model: give --model (a built-in or module:factory), not --params")
    check_same_gpu(cluster.device, torch.cuda.get_device_name())
    return time_gpu_step(
        model.factory, model.call, batch=setup.micro_batch, precision=setup.precision, optimizer=setup.optimizer
    )


def _single_allocated(plan: Plan) -> float:
    """What the plan gives one rank stepping after one micro-batch, as the GPU's timed steps did (the plan's single
    row accumulates the whole global batch)."""
    t = plan.training
    one = estimate(plan.stats, Layout.of(name="single"), replace(t, global_batch=t.micro_batch), plan.cluster)
    return one.memory.allocated


def fsdp_call_s(overhead: Mapping[str, float], stats: ModelStats, setup: Training, bandwidth: float) -> float:
    """``Device.fsdp_call_s`` from FSDP's one-rank overheads (``Measured.fsdp_overhead``), averaged;
    ``bandwidth``: the measuring thread's."""
    stages = {"zero2": 2, "fsdp": 3, "zero3": 3}
    unknown = sorted(set(overhead) - set(stages))
    if unknown:
        raise ConfigError(f"FSDP overhead for {', '.join(unknown)}: give it for zero2 and/or zero3")
    per_call = [fsdp_call_from(s, stats, stages[name], setup, bandwidth) for name, s in overhead.items()]
    return sum(per_call) / len(per_call)


def tp_call_from(step_s: float, stats: ModelStats, training: Training, cluster: Cluster) -> float:
    """``Device.tp_call_s`` from a tensor-parallel step over a node's ranks timed without communication (a fake
    group: its collectives return at once): what it took beyond the plan's compute and optimizer step for one such
    rank, over its collective calls. Never below 0."""
    if stats.tp is None:
        raise ConfigError("a TP step time calibrates tensor parallelism: plan a transformer")
    e = estimate(stats, Layout.of(name="tp", tp=cluster.ranks_per_node), training, cluster)
    calls = e.batch.micro_batches * collectives_per_micro_batch(stats, training.checkpointing)
    return max(0.0, (step_s - (e.time.step_s - e.time.exposed_comm_s)) / calls)
