"""Planner memory model: ZeRO's accounting exactly, the two peaks, pipeline in-flight micro-batches, buffers,
checkpointing."""

import pytest

from paratrain.errors import ConfigError
from paratrain.planner import (
    TRANSFORMERS,
    Layout,
    Training,
    batching,
    make_cluster,
    memory_per_rank,
    transformer_stats,
)
from paratrain.planner.layout import layouts, stage_params
from paratrain.planner.memory import activation_figures, model_states

STATS = transformer_stats(TRANSFORMERS["gpt2-medium"], name="gpt2-medium")
PSI = STATS.params


def _memory(layout, training=None, cluster=None):
    training = training or Training(precision="bf16-mixed", optimizer="adamw", micro_batch=1)
    cluster = cluster or make_cluster("h100", gpus=layout.world_size)
    batch = batching(training, dp=layout.dp, pp=layout.pp, world_size=layout.world_size)
    return memory_per_rank(STATS, layout, batch, training, cluster)


def _states(layout, training=None, paper=False):
    return model_states(
        STATS, layout, training or Training(precision="bf16-mixed", optimizer="adamw", micro_batch=1), paper=paper
    )


@pytest.mark.parametrize("n", [2, 8, 64])
def test_model_states_match_the_zero_paper_for_mixed_precision_adam(n):
    """The paper's figures (``paper=True``: ZeRO-1 as an even split of the optimizer states)."""
    expected = {  # Rajbhandari et al. 2020, figure 1: bytes per GPU for Ψ parameters on N GPUs
        Layout.of(name="ddp", dp=n): 16 * PSI,
        Layout.of(name="zero1", dp=n, zero=1, shard=n): 4 * PSI + 12 * PSI / n,
        Layout.of(name="zero2", dp=n, zero=2, shard=n): 2 * PSI + 14 * PSI / n,
        Layout.of(name="zero3", dp=n, zero=3, shard=n): 16 * PSI / n,
    }
    for layout, states in expected.items():
        assert _states(layout, paper=True).total == pytest.approx(states, rel=1e-12), layout.name
        if layout.zero != 1:
            assert _states(layout).total == _states(layout, paper=True).total, layout.name


def test_zero1_optimizer_states_are_the_busiest_rank_of_zero_redundancy_optimizer():
    """The planner's own ZeRO-1 figure (``paper=False``): ``ZeroRedundancyOptimizer`` hands whole tensors, largest
    first, to the least-loaded rank, so the busiest keeps at least the embedding's states, and never more than
    Ψ/N plus the largest tensor's."""
    from paratrain.planner.memory import zero1_busiest

    assert zero1_busiest((5, 4, 3, 3, 1), 2) == 8  # 5→r0, 4→r1, 3→r1 (7), 3→r0 (8), 1→r1 (8)
    assert zero1_busiest((10, 1, 1), 4) == 10 and zero1_busiest((3, 3, 3, 3), 4) == 3
    largest = max(STATS.tensors)
    assert sum(STATS.tensors) == PSI and largest == 50257 * 1024  # the token embedding
    adam = 12  # fp32 master copy and two moments, bytes per parameter
    for n in (2, 8, 64):
        got = _states(Layout.of(name="zero1", dp=n, zero=1, shard=n)).optimizer_states
        assert max(largest, PSI / n) * adam <= got <= (PSI / n + largest) * adam, n
    assert _states(Layout.of(name="zero1", dp=64, zero=1, shard=64)).optimizer_states == largest * adam
    assert _states(Layout.of(name="zero1", dp=2, zero=1, shard=2)).optimizer_states == pytest.approx(
        adam * PSI / 2, rel=0.01
    )  # two ranks: nearly even


@pytest.mark.parametrize(
    "precision, optimizer, per_param",
    [
        ("fp32", "adamw", 16),
        ("fp32", "sgd", 8),
        ("fp32", "sgd-momentum", 12),
        ("bf16-mixed", "sgd", 8),
    ],
)
def test_bytes_per_parameter_by_precision_and_optimizer(precision, optimizer, per_param):
    training = Training(precision=precision, optimizer=optimizer, micro_batch=1)
    assert _states(Layout.of(name="single"), training).total == per_param * PSI


def test_the_peak_is_backward_with_large_activations_else_the_optimizer_step():
    big = _memory(Layout.of(name="single"), Training(precision="fp32", micro_batch=8))
    assert big.phase == "backward" and big.gradients == 0  # zero_grad(set_to_none=True) freed them
    assert big.transient == 2 * STATS.output_bytes_per_sample * 8  # the loss's two fp32 logit-sized gradients
    states = _states(Layout.of(name="single"), Training(precision="fp32", micro_batch=8))
    small = memory_per_rank(
        STATS.__class__(**{**STATS.__dict__, "activation_bytes_per_sample": 0.0, "output_bytes_per_sample": 0.0}),
        Layout.of(name="single"),
        batching(Training(precision="fp32", micro_batch=8), dp=1, pp=1, world_size=1),
        Training(precision="fp32", micro_batch=8),
        make_cluster("h100"),
    )
    assert small.phase == "optimizer step" and small.activations == 0
    assert small.model_states == states.total and small.transient == 4 * PSI  # Adam's sqrt(v) temporaries
    accumulating = _memory(Layout.of(name="single"), Training(precision="fp32", micro_batch=8, global_batch=32))
    assert accumulating.gradients == states.gradients  # earlier micro-batches' gradients are alive
    ddp = _memory(Layout.of(name="ddp", dp=8), Training(precision="fp32", micro_batch=8))
    assert ddp.gradients == states.gradients  # DDP's buckets


def test_activations_scale_with_micro_batch_and_shrink_with_checkpointing():
    copies = 2 * STATS.matmul_params  # autocast's bf16 weight copies, saved for backward
    four = _memory(Layout.of(name="single"), Training(micro_batch=4)).activations
    assert four == pytest.approx(4 * STATS.mixed["autocast"][0] + copies)
    sixteen = _memory(Layout.of(name="single"), Training(micro_batch=16)).activations
    assert sixteen == pytest.approx(4 * (four - copies) + copies)
    fp32 = _memory(Layout.of(name="single"), Training(micro_batch=4, precision="fp32")).activations
    assert fp32 == pytest.approx(4 * STATS.activation_bytes_per_sample)
    assert 1.6 < STATS.activation_bytes_per_sample / STATS.mixed["autocast"][0] < 2  # autocast keeps x in fp32
    saved, checkpointed, _ = activation_figures(STATS, Training(), Layout.of(name="single"))
    assert checkpointed < saved / 3  # each block's input and one block; the loss's fp32 log-probabilities stay


def test_pipeline_holds_m_micro_batches_under_gpipe_and_at_most_p_under_1f1b():
    p, m = 4, 16
    layout = Layout.of(name="pipeline", pp=p)
    per_micro = STATS.activation_bytes_per_sample / p  # one micro-batch of one sample on a quarter of the layers
    for schedule, in_flight in (("gpipe", m), ("1f1b", p)):
        training = Training(micro_batch=1, global_batch=m, schedule=schedule, precision="fp32")
        assert _memory(layout, training).activations == pytest.approx(in_flight * per_micro), schedule
    few = Training(micro_batch=1, global_batch=2, schedule="1f1b", precision="fp32")  # m < p: only m in flight
    assert _memory(layout, few).activations == pytest.approx(2 * per_micro)


def test_pipeline_stage_holds_the_fullest_contiguous_run_of_units():
    units = (("a", 5), ("b", 1), ("c", 1), ("d", 1), ("e", 5))
    assert stage_params(units, 1) == 13
    assert stage_params(units, 2) == 7  # a+b+c | d+e  (or a+b | c+d+e)
    assert stage_params(units, 3) == 5  # a | b+c+d | e
    assert stage_params(units, 5) == 5


def test_buffers_ddp_two_buckets_fsdp_the_largest_unit_gathered():
    ddp = _memory(Layout.of(name="ddp", dp=8))
    assert ddp.buffers == 2 * 25 * 2**20
    fsdp = _memory(Layout.of(name="zero3", dp=8, zero=3, shard=8))
    unit = STATS.largest_unit[1]
    assert fsdp.buffers == 2 * unit * 2 + unit * 2  # current + prefetched bf16 unit, its bf16 gradient
    assert ddp.overhead == fsdp.overhead == 0.75 * 2**30


def test_layouts_follow_the_cluster_and_the_strategies_meshes():
    cluster = make_cluster("h100", gpus=8, nodes=4)
    found = layouts(cluster, n_units=26)
    names = list(dict.fromkeys(lay.name for lay in found))
    # 32 stages > 26 units
    assert names == ["single", "ddp", "zero1", "zero2", "zero3", "hsdp", "hybrid", "model_parallel"]
    hybrids = [(lay.dp, lay.pp, lay.zero, lay.label) for lay in found if lay.name == "hybrid"]
    assert hybrids == [
        (dp, pp, zero, label)
        for dp, pp in ((16, 2), (8, 4), (4, 8), (2, 16))
        for zero, label in ((0, "hybrid"), (1, "hybrid+zero1"))
    ]  # replicated by DDP, or ZeRO-1
    assert [(lay.dp, lay.mp) for lay in found if lay.name == "model_parallel"] == [(16, 2), (8, 4), (4, 8)]
    assert "pipeline" in [lay.name for lay in layouts(cluster, n_units=32)]
    assert [lay.name for lay in layouts(make_cluster("h100", gpus=1), 26)] == ["single"]
    assert "model_parallel" not in [lay.name for lay in layouts(make_cluster("cpu", gpus=2), 26)]


def test_hsdp_shards_within_a_node_and_model_parallel_splits_layers_over_a_processs_gpus():
    hsdp = Layout.of(name="hsdp", dp=32, zero=3, shard=8)
    assert hsdp.replicas == 4
    assert _states(hsdp).total == pytest.approx(16 * PSI / 8)
    mp_layout = Layout.of(name="model_parallel", mp=4)
    assert _states(mp_layout).total == 16 * stage_params(STATS.units, 4)
    mp = _memory(mp_layout, Training(micro_batch=1, precision="fp32"))
    assert mp.activations == pytest.approx(STATS.activation_bytes_per_sample / 4)
    assert activation_figures(STATS, Training(), hsdp) == STATS.mixed["param_dtype"]  # FSDP: bf16 parameters


def test_bad_training_options_are_config_errors():
    with pytest.raises(ConfigError, match="--batch must be >= 1, got -2"):
        Training(micro_batch=-2)
    with pytest.raises(ConfigError, match="unknown optimizer 'lamb'; choose one of: sgd, sgd-momentum, adam, adamw"):
        Training(optimizer="lamb")
    with pytest.raises(ConfigError, match="unknown precision"):
        Training(precision="fp8")
