"""Planner time model: collective formulas, pipeline bubble, overlap, calibration, hardware catalogue."""

import pytest

from paratrain.errors import ConfigError
from paratrain.planner import (
    TRANSFORMERS,
    Layout,
    Link,
    Measured,
    PlanConfig,
    Training,
    all_gather_s,
    all_reduce_s,
    batching,
    broadcast_s,
    bubble_fraction,
    calibrated,
    get_device,
    make_cluster,
    make_plan,
    measured_link,
    p2p_s,
    reduce_scatter_s,
    step_time,
    transformer_stats,
)
from paratrain.planner.layout import block_stage_params
from paratrain.planner.memory import zero1_busiest
from paratrain.planner.timing import StepInputs, comm_terms, ddp_bucket_s, micro_batch_s, optimizer_step_s
from paratrain.workloads.model_names import resolve_model

LINK = Link(name="test", bandwidth_gbs=100, latency_us=0)
STATS = transformer_stats(TRANSFORMERS["gpt2"], name="gpt2")


@pytest.mark.parametrize("n", [2, 4, 8, 64])
def test_ring_collectives_follow_the_bandwidth_formulas(n):
    size = 1e9
    assert all_reduce_s(size, n, LINK) == pytest.approx(2 * (n - 1) / n * size / 100e9)
    assert all_gather_s(size, n, LINK) == pytest.approx((n - 1) / n * size / 100e9)
    assert reduce_scatter_s(size, n, LINK) == all_gather_s(size, n, LINK)
    slow = Link(name="slow", bandwidth_gbs=100, latency_us=10)
    assert all_reduce_s(size, n, slow) == pytest.approx(all_reduce_s(size, n, LINK) + 2 * (n - 1) * 10e-6)
    assert all_reduce_s(size, 1, LINK) == 0.0


def test_gloo_loopback_matches_the_field_notes():
    # FIELD-NOTES: a 7.45 MB gradient takes 5-8 ms to all-reduce at world 2 over gloo on one host.
    gloo = make_cluster("cpu", gpus=2).intra
    assert 5e-3 <= all_reduce_s(7.45e6, 2, gloo) <= 8e-3
    assert p2p_s(7.45e6, gloo) < all_reduce_s(7.45e6, 2, gloo) / 2  # point-to-point runs at 3-4 GB/s


@pytest.mark.parametrize("p, m", [(2, 1), (4, 4), (4, 16), (8, 32)])
def test_pipeline_bubble_is_p_minus_1_over_m_plus_p_minus_1(p, m):
    assert bubble_fraction(p, m) == pytest.approx((p - 1) / (m + p - 1))
    training = Training(micro_batch=1, global_batch=m)
    cluster = make_cluster("h100", gpus=p)
    layout = Layout.of(name="pipeline", pp=p)
    t = step_time(STATS, layout, batching(training, dp=1, pp=p, world_size=p), training, cluster)
    assert t.bubble_s / (t.compute_s + t.bubble_s) == pytest.approx(bubble_fraction(p, m))


def test_compute_time_is_flops_over_sustained_rate_plus_weights_and_ddp_hides_its_all_reduce():
    training = Training(micro_batch=8)
    cluster = make_cluster("h100", gpus=8)
    single = step_time(STATS, Layout.of(name="single"), batching(training, dp=1, pp=1, world_size=1), training, cluster)
    weights = 3 * STATS.params * 2 / 3350e9  # bf16 weights read in forward and backward, gradient written, HBM3
    executed = STATS.flops_per_sample - STATS.attention_flops_per_sample / 2  # a causal kernel skips half the scores
    elementwise = 12 * STATS.mixed["autocast"][0] * 8 / 3350e9  # 12 passes over the saved activations, HBM3
    assert single.compute_s == pytest.approx(executed * 8 / (989e12 * 0.7) + weights + elementwise)
    assert single.optimizer_s == pytest.approx(STATS.params * 80 / 3350e9)  # AdamW streams 80 bytes a parameter
    ddp = step_time(STATS, Layout.of(name="ddp", dp=8), batching(training, dp=8, pp=1, world_size=8), training, cluster)
    assert ddp.comm_s == pytest.approx(all_reduce_s(STATS.params * 2, 8, cluster.intra))
    assert ddp.exposed_comm_s == 0.0  # 0.25 GB over NVLink hides in backward
    slow = make_cluster("h100", gpus=8, interconnect="pcie3-x4", mfu=1.0)
    ddp_slow = step_time(
        STATS, Layout.of(name="ddp", dp=8), batching(training, dp=8, pp=1, world_size=8), training, slow
    )
    buckets = 6 * STATS.params * 2 / 3350e9  # DDP copies gradients into its buckets, divides, copies back
    assert ddp.compute_s == pytest.approx(single.compute_s + buckets)
    hidden = slow.device.overlap * 2 / 3 * (ddp_slow.compute_s - buckets)
    assert ddp_slow.exposed_comm_s == pytest.approx(ddp_slow.comm_s - hidden)


def test_model_parallel_stages_take_turns_while_pipeline_stages_overlap():
    training = Training(micro_batch=4, global_batch=32)
    cluster = make_cluster("h100", gpus=8, mfu=0.4)  # a whole step's MFU: no elementwise passes apart
    one = step_time(STATS, Layout.of(name="single"), batching(training, dp=1, pp=1, world_size=1), training, cluster)
    mp = step_time(
        STATS, Layout.of(name="model_parallel", mp=8), batching(training, dp=1, pp=1, world_size=8), training, cluster
    )
    assert mp.compute_s == pytest.approx(one.compute_s)  # 8 GPUs, one computing at a time
    assert mp.comm_s == pytest.approx(8 * 2 * 7 * p2p_s(STATS.boundary_bytes_per_sample * 4, cluster.intra))
    pp = step_time(
        STATS, Layout.of(name="pipeline", pp=8), batching(training, dp=1, pp=8, world_size=8), training, cluster
    )
    flops_s = (STATS.flops_per_sample - STATS.attention_flops_per_sample / 2) * 32 / (989e12 * 0.4)
    # the fullest stage as the runtime cuts a transformer: blocks balanced, the embedding on the first stage, the
    # head and the tied embedding's copy on the last
    fullest = block_stage_params(STATS.units, 8, STATS.pipeline_copy)
    stage_weights_s = 3 * fullest * 2 / 3350e9  # streamed once per micro-batch, 8 of them
    assert pp.compute_s == pytest.approx(flops_s / 8 + 8 * stage_weights_s)
    assert pp.optimizer_s == pytest.approx(one.optimizer_s * fullest / STATS.params)


def test_fsdp_gathers_parameters_twice_and_reduce_scatters_gradients_every_micro_batch():
    training = Training(micro_batch=2, global_batch=64)
    cluster = make_cluster("h100", gpus=8)
    batch = batching(training, dp=8, pp=1, world_size=8)
    assert (batch.micro_batch, batch.micro_batches) == (2, 4)
    t = step_time(STATS, Layout.of(name="zero3", dp=8, zero=3, shard=8), batch, training, cluster)
    per_micro = 2 * all_gather_s(STATS.params * 2, 8, cluster.intra) + reduce_scatter_s(
        STATS.params * 2, 8, cluster.intra
    )
    per_unit_calls = (len(STATS.units) - 1) * 3 * 7 * cluster.intra.latency_us * 1e-6  # a call per unit, each pays
    assert t.comm_s == pytest.approx(4 * (per_micro + per_unit_calls))


def test_calibration_sets_mfu_from_a_measured_step():
    cluster = make_cluster("a100", gpus=1)
    flops = 312e12 * 0.25  # a quarter of peak, sustained for one second
    found = calibrated(cluster, flops_per_step=flops, step_time_s=1.0, precision="bf16-mixed")
    assert found.device.mfu == pytest.approx(0.25)
    with pytest.raises(ConfigError, match="above a100-80gb's peak"):
        calibrated(cluster, flops_per_step=flops, step_time_s=0.1, precision="bf16-mixed")


def test_catalogue_names_aliases_and_overrides():
    assert get_device("H100").name == "h100-80gb" and get_device("a100-40gb").memory_gib == 40
    for name in ("a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l4", "rtx-4090", "cpu"):
        assert get_device(name).memory_gib > 0
    c = make_cluster("a100", gpus=8, interconnect="nvlink", gpu_mem_gb=70, tflops=200, intra_bw_gbs=111)
    assert (c.intra.name, c.intra.bandwidth_gbs) == ("nvlink3 (override)", 111)
    assert (c.device.memory_gib, c.device.bf16_tflops) == (70, 200)
    assert make_cluster("h100", gpus=8, interconnect="nvlink").intra.bandwidth_gbs == 450  # NVLink4: 900 both ways
    with pytest.raises(ConfigError, match="unknown GPU 'v100'; choose one of: a100-40gb, .*, cpu"):
        get_device("v100")
    with pytest.raises(ConfigError, match="l4 has no NVLink"):
        make_cluster("l4", gpus=2, interconnect="nvlink")


def test_calibration_splits_a_measured_step_into_flops_and_memory_traffic():
    host = make_cluster("cpu", gpus=2)
    cores = host.device.cores
    flops, weights, adam = 3e9, 2e8, 3e8  # FLOPs of the step, bytes the weights stream, bytes the optimizer streams
    c = calibrated(
        host,
        flops_per_step=flops,
        step_time_s=0.05,
        precision="fp32",
        streamed_bytes=weights,
        optimizer_bytes=adam,
        optimizer_s=0.015,
        threads=1,
    )
    assert c.device.memory_gbs == pytest.approx(adam / 0.015 * cores / 1e9)  # one thread's bandwidth, x cores
    per_core_rate = flops / (0.05 - weights / (adam / 0.015))
    assert c.device.mfu * c.device.fp32_tflops * 1e12 == pytest.approx(per_core_rate * cores)
    with pytest.raises(ConfigError, match="no longer than streaming the weights"):
        calibrated(
            host,
            flops_per_step=flops,
            step_time_s=0.005,
            precision="fp32",
            streamed_bytes=weights,
            optimizer_bytes=adam,
            optimizer_s=0.015,
            threads=1,
        )
    with pytest.raises(ConfigError, match="--optimizer-time calibrates together with --step-time"):
        PlanConfig(gpu="cpu", gpus=2, optimizer_time=0.01)


def test_a_link_measured_at_a_world_size_reproduces_its_timings():
    timings = {
        "all_reduce": (16e6, 0.012),
        "all_gather": (16e6, 0.02),
        "reduce_scatter": (16e6, 0.03),
        "broadcast": (16e6, 0.006),
        "p2p": (4e6, 0.0015),
        "p2p_small": (65536, 0.0003),
    }
    link = measured_link(make_cluster("cpu", gpus=4).intra, 4, timings)
    assert all_reduce_s(16e6, 4, link) == pytest.approx(0.012)
    assert all_gather_s(16e6, 4, link) == pytest.approx(0.02)
    assert reduce_scatter_s(16e6, 4, link) == pytest.approx(0.03)
    assert broadcast_s(16e6, 4, link) == pytest.approx(0.006)
    assert p2p_s(4e6, link) == pytest.approx(0.0015) and p2p_s(65536, link) == pytest.approx(0.0003)
    plan = make_plan(resolve_model("mlp"), PlanConfig(gpu="cpu", gpus=4, measured=Measured(link_timings=timings)))
    assert plan.cluster.intra.name == "loopback-gloo (measured)"


def test_collectives_split_per_wrap_unit_set_what_each_further_call_costs():
    whole = {"all_gather": (16e6, 0.02), "reduce_scatter": (16e6, 0.03)}
    split = {**whole, "all_gather_split": (16e6, 0.032, 5), "reduce_scatter_split": (16e6, 0.05, 5)}
    default = measured_link(make_cluster("cpu", gpus=4).intra, 4, whole)
    link = measured_link(make_cluster("cpu", gpus=4).intra, 4, split)
    assert default.call_us is None and default.call_s(4) == pytest.approx(3 * default.latency_us * 1e-6)
    assert link.call_s(4) == pytest.approx(0.004)  # 12 and 20 ms over 4 further calls, averaged
    assert all_gather_s(16e6, 4, link) == pytest.approx(0.02)  # the whole collective's figures are kept
    configs = [PlanConfig(gpu="cpu", gpus=4, measured=Measured(link_timings=t)) for t in (whole, split)]
    plans = [{e.name: e.time for e in make_plan(resolve_model("mlp"), config).estimates} for config in configs]
    units = 3  # the built-in mlp's wrap units; zero3 makes 3 calls per unit, zero2 2
    for name, calls in (("zero3", 3), ("zero2", 2)):
        extra = plans[1][name].exposed_comm_s - plans[0][name].exposed_comm_s
        assert extra == pytest.approx((units - 1) * calls * (0.004 - default.call_s(4)))
    assert plans[1]["ddp"].step_s == plans[0]["ddp"].step_s  # one all-reduce: no split calls


def test_zero_stages_step_only_their_shard_and_zero1_broadcasts_it():
    training = Training(micro_batch=8, precision="fp32", optimizer="adam")
    cluster = make_cluster("cpu", gpus=4)
    batch = batching(training, dp=4, pp=1, world_size=4)
    ddp = step_time(STATS, Layout.of(name="ddp", dp=4), batch, training, cluster)
    zero1 = step_time(STATS, Layout.of(name="zero1", dp=4, zero=1, shard=4), batch, training, cluster)
    zero2 = step_time(STATS, Layout.of(name="zero2", dp=4, zero=2, shard=4), batch, training, cluster)
    assert ddp.optimizer_s == pytest.approx(4 * zero2.optimizer_s)
    # ZeroRedundancyOptimizer steps whole tensors: the busiest rank's share, which the step waits for
    assert zero1.optimizer_s == pytest.approx(ddp.optimizer_s * zero1_busiest(STATS.tensors, 4) / STATS.params)
    assert zero1.optimizer_s > zero2.optimizer_s
    assert ddp.optimizer_s == pytest.approx(STATS.params * 72 / (cluster.device.memory_gbs * 1e9 / 4))
    assert zero1.comm_s == pytest.approx(ddp.comm_s + broadcast_s(STATS.params * 4, 4, cluster.intra))


TERM_LAYOUTS = {  # layout -> the communication terms it pays (the others are 0)
    Layout.of(name="ddp", dp=16): {"dp_all_reduce"},
    Layout.of(name="zero1", dp=16, zero=1, shard=16): {"dp_all_reduce", "zero1_broadcast"},
    Layout.of(name="hsdp", dp=16, zero=3, shard=8): {"fsdp_gather_scatter", "hsdp_all_reduce"},
    Layout.of(name="hybrid", dp=4, pp=4): {"dp_all_reduce", "pipeline_p2p"},
    Layout.of(name="model_parallel", dp=4, mp=4): {"dp_all_reduce", "model_parallel_p2p"},
    Layout.of(name="zero3", dp=8, zero=3, shard=8, tp=2): {"fsdp_gather_scatter", "tp"},
    Layout.of(name="zero3", dp=4, zero=3, shard=4, tp=2, cp=2): {"fsdp_gather_scatter", "tp", "cp"},
    Layout.of(name="ddp", dp=16, ep=8): {"dp_all_reduce", "ep"},
}


@pytest.mark.parametrize("layout", TERM_LAYOUTS, ids=lambda lay: lay.describe())
def test_step_time_is_the_sum_of_its_terms(layout):
    """Each cost term is one function (``timing.comm_terms`` and the compute terms); ``step_time`` adds them up, and
    each layout pays exactly the collectives it runs."""
    stats = transformer_stats(TRANSFORMERS["mixtral-8x7b" if layout.ep > 1 else "llama3-8b"], name="model")
    training = Training(precision="bf16-mixed", micro_batch=1, global_batch=64)
    cluster = make_cluster("h100", gpus=8, nodes=2)
    batch = batching(training, dp=layout.dp, pp=layout.pp, world_size=16)
    s = StepInputs(stats=stats, layout=layout, batch=batch, training=training, cluster=cluster)
    micro, comms = micro_batch_s(s), comm_terms(s, micro_batch_s(s))
    t = step_time(stats, layout, batch, training, cluster)
    assert {name for name, c in comms.items() if c.total_s > 0} == TERM_LAYOUTS[layout]
    assert t.compute_s == pytest.approx(batch.micro_batches * micro + ddp_bucket_s(s))
    assert t.bubble_s == pytest.approx((layout.pp - 1) * micro)
    assert t.optimizer_s == optimizer_step_s(s)
    assert t.comm_s == pytest.approx(sum(c.times * c.seconds for c in comms.values()))
    assert t.exposed_comm_s == pytest.approx(sum(c.exposed_s for c in comms.values()))
    assert t.step_s == pytest.approx(t.compute_s + t.bubble_s + t.optimizer_s + t.exposed_comm_s)
    assert (t.tp_comm_s, t.ep_comm_s, t.cp_comm_s) == (comms["tp"].total_s, comms["ep"].total_s, comms["cp"].total_s)
