"""Planner terms measured at world 1: weight passes from two batch sizes, the host's all-cores rates, FSDP's
per-unit machinery, a pipeline's busiest stage, and the collectives' latency apart from point-to-point's."""

from dataclasses import replace

import pytest
from torch import nn

from paratrain.errors import ConfigError
from paratrain.planner import (
    Layout,
    Measured,
    PlanConfig,
    Training,
    all_reduce_s,
    batching,
    calibrated,
    make_cluster,
    make_plan,
    measured_link,
    p2p_s,
    step_time,
)
from paratrain.planner.layout import stage_flops
from paratrain.planner.model_stats import InputSpec, trace_module
from paratrain.planner.timing import fsdp_call_from, fsdp_copy_bytes
from paratrain.workloads.model_names import model_input, resolve_model

FLOPS, WEIGHTS, ADAM = 3e9, 2e8, 3e8  # FLOPs of a batch, bytes the catalogue's passes stream, optimizer bytes


def test_two_batch_sizes_set_the_weight_passes_and_the_flop_rate():
    host = make_cluster("cpu", gpus=2)
    bandwidth = ADAM / 0.01  # one thread
    fixed_s, per_flop = 0.006, 1e-11  # what a forward+backward costs whatever the batch; seconds per FLOP
    c = calibrated(
        host,
        flops_per_step=FLOPS,
        step_time_s=fixed_s + FLOPS * per_flop,
        precision="fp32",
        streamed_bytes=WEIGHTS,
        optimizer_bytes=ADAM,
        optimizer_s=0.01,
        threads=1,
        micro_step=(FLOPS / 8, fixed_s + FLOPS / 8 * per_flop),
    )
    passes = host.device.weight_passes
    assert c.device.weight_passes == pytest.approx(passes * fixed_s / (WEIGHTS / bandwidth))
    per_core = c.device.mfu * c.device.fp32_tflops * 1e12 / host.device.cores
    assert per_core == pytest.approx(1 / per_flop)
    with pytest.raises(ConfigError, match="no batch-independent time"):  # the smaller batch took too long
        calibrated(
            host,
            flops_per_step=FLOPS,
            step_time_s=0.036,
            precision="fp32",
            streamed_bytes=WEIGHTS,
            optimizer_bytes=ADAM,
            optimizer_s=0.01,
            threads=1,
            micro_step=(FLOPS / 8, 0.001),
        )
    with pytest.raises(ConfigError, match="together with the optimizer step"):
        calibrated(
            host,
            flops_per_step=FLOPS,
            step_time_s=0.036,
            precision="fp32",
            streamed_bytes=WEIGHTS,
            micro_step=(FLOPS / 8, 0.01),
        )


def test_an_all_cores_step_sets_the_host_rates_and_core_speedup():
    host = make_cluster("cpu", gpus=2, mfu=0.5)
    one = calibrated(
        host,
        flops_per_step=FLOPS,
        step_time_s=0.05,
        precision="fp32",
        streamed_bytes=WEIGHTS,
        optimizer_bytes=ADAM,
        optimizer_s=0.01,
        threads=1,
    )
    both = calibrated(
        host,
        flops_per_step=FLOPS,
        step_time_s=0.05,
        precision="fp32",
        streamed_bytes=WEIGHTS,
        optimizer_bytes=ADAM,
        optimizer_s=0.01,
        threads=1,
        host_step=(0.035, 0.009),
    )
    assert both.device.memory_gbs == pytest.approx(ADAM / 0.009 / 1e9)  # not cores x one thread's
    host_compute_s = 0.035 - WEIGHTS / (ADAM / 0.009)
    assert both.device.mfu * both.device.fp32_tflops * 1e12 == pytest.approx(FLOPS / host_compute_s)
    assert both.device.core_speedup == pytest.approx((0.05 - WEIGHTS / (ADAM / 0.01)) / host_compute_s)
    assert both.device.core_speedup < host.device.cores and one.device.core_speedup is None
    # one-threaded work: one core's speed while there is a core per rank, then slower
    assert both.device.serial_slowdown(1) == 1.0
    assert both.device.serial_slowdown(4) == pytest.approx(4 / both.device.core_speedup)
    assert one.device.serial_slowdown(4) == pytest.approx(4 / host.device.cores)
    assert make_cluster("h100", gpus=8).device.serial_slowdown(8) == 1.0


def _mlp() -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(64, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 256),
        nn.ReLU(),
        nn.Linear(256, 10),
    )


def test_fsdp_machinery_is_measured_on_one_rank_and_paid_per_unit_and_call():
    stats = trace_module(_mlp, InputSpec.parse("64"), name="mlp")
    training = Training(precision="fp32", optimizer="adam", micro_batch=32, global_batch=64)
    bandwidth, per_call = 10e9, 0.5e-3
    units = sum(1 for _, n in stats.units if n > 0)
    measured = fsdp_copy_bytes(stats.params, 3, training) / bandwidth + units * 3 * per_call
    assert fsdp_call_from(measured, stats, 3, training, bandwidth) == pytest.approx(per_call)
    assert fsdp_call_from(0.0, stats, 3, training, bandwidth) == 0.0  # never below zero
    cluster = make_cluster("cpu", gpus=4)
    timed = replace(cluster, device=replace(cluster.device, fsdp_call_s=per_call))
    batch = batching(training, dp=4, pp=1, world_size=4)
    for layout, calls in (
        (Layout.of(name="zero2", dp=4, zero=2, shard=4), 2),
        (Layout.of(name="zero3", dp=4, zero=3, shard=4), 3),
    ):
        extra = (
            step_time(stats, layout, batch, training, timed).compute_s
            - step_time(stats, layout, batch, training, cluster).compute_s
        )
        assert extra == pytest.approx(units * calls * per_call * cluster.device.serial_slowdown(4))
    ddp = Layout.of(name="ddp", dp=4)
    assert step_time(stats, ddp, batch, training, timed) == step_time(stats, ddp, batch, training, cluster)
    plan = make_plan(
        resolve_model("mlp"),
        PlanConfig(
            gpu="cpu",
            gpus=2,
            training=Training(precision="fp32", optimizer="adam"),
            step_time=0.02,
            optimizer_time=0.004,
            threads=1,
            measured=Measured(fsdp_overhead={"zero2": 0.004, "zero3": 0.006}),
        ),
    )
    assert plan.cluster.device.fsdp_call_s > 0
    with pytest.raises(ConfigError, match="give it for zero2 and/or zero3"):
        make_plan(
            resolve_model("mlp"),
            PlanConfig(
                gpu="cpu", gpus=2, step_time=0.02, optimizer_time=0.004, measured=Measured(fsdp_overhead={"ddp": 0.1})
            ),
        )


def test_a_pipeline_stage_computes_its_own_units_flops():
    stats = trace_module(_mlp, InputSpec.parse("64"), name="mlp")
    assert len(stats.unit_flops) == len(stats.units) and sum(stats.unit_flops) == pytest.approx(stats.flops_per_sample)
    # the first layer computes no input gradient: 2 FLOPs per weight per sample forward, 2 backward (not 4)
    assert stats.unit_flops[0] == pytest.approx(4 * 64 * 256)
    assert stats.unit_flops[2] == pytest.approx(6 * 256 * 256)
    busiest = stage_flops(stats.units, stats.unit_flops, 2)  # [linear 64x256, linear 256x256] | [256x256, 256x10]
    assert busiest == pytest.approx(4 * 64 * 256 + 6 * 256 * 256)
    training = Training(precision="fp32", micro_batch=8, global_batch=64, micro_batches=8)
    cluster = make_cluster("cpu", gpus=2)
    batch = batching(training, dp=1, pp=2, world_size=2)
    even = replace(stats, unit_flops=())
    pp = Layout.of(name="pipeline", pp=2)
    extra = (
        step_time(stats, pp, batch, training, cluster).compute_s
        - step_time(even, pp, batch, training, cluster).compute_s
    )
    rate = cluster.flops_per_s("fp32", 2)
    assert extra == pytest.approx(8 * 8 * (busiest - stats.flops_per_sample / 2) / rate)


def test_a_small_all_reduce_sets_the_collectives_latency_apart_from_point_to_point():
    timings = {
        "all_reduce": (16e6, 0.03),
        "all_reduce_small": (8, 0.0006),
        "p2p": (4e6, 0.0045),
        "p2p_small": (65536, 0.0022),
    }
    link = measured_link(make_cluster("cpu", gpus=4).intra, 4, timings)
    assert link.latency_us == pytest.approx(100)  # 0.6 ms over 2(N-1) = 6 ring steps
    assert all_reduce_s(8, 4, link) == pytest.approx(0.0006, rel=1e-3)
    assert all_reduce_s(16e6, 4, link) == pytest.approx(0.03)
    assert p2p_s(65536, link) == pytest.approx(0.0022) and p2p_s(4e6, link) == pytest.approx(0.0045)


def test_a_gpu_measurement_calibrates_only_the_gpu_it_ran_on():
    from paratrain.planner.gpu_step import check_same_gpu
    from paratrain.planner.hardware import get_device

    check_same_gpu(get_device("h100"), "NVIDIA H100 80GB HBM3")
    check_same_gpu(get_device("rtx-4090"), "NVIDIA GeForce RTX 4090")
    with pytest.raises(ConfigError, match=r"H100 80GB HBM3, but the plan is for --gpu a100-40gb.*--gpu a100"):
        check_same_gpu(get_device("a100-40gb"), "NVIDIA H100 80GB HBM3")


def test_gpu_timing_without_cuda_is_one_line(monkeypatch):
    import torch

    from paratrain.planner.gpu_step import time_gpu_step

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs CUDA"):
        time_gpu_step(lambda: nn.Linear(2, 2), InputSpec(shape=(2,)), batch=2, precision="fp32", optimizer="adamw")


def test_token_inputs_for_timing_are_real_ids_below_the_vocabulary():
    _, spec = model_input("gpt-tiny")
    ids = spec.make(4, "cpu")
    assert ids.shape == (4, 64) and 0 <= int(ids.min()) and int(ids.max()) < 512 and ids.unique().numel() > 1
    _, given = model_input("gpt-tiny", input_spec="long:16")
    assert given.high is None and not given.make(2, "cpu").any()  # the user's own shape: no vocabulary known
