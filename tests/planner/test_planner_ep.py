"""Expert parallelism in the planner (``planner.expert_parallel``): what an ep rank holds under each strategy, what
it syncs and sends, in closed form; ep in the candidate layouts, ``--ep`` and ``--layout ...,ep=E``.

The runtime's ``Parallel(strategy, ep=E)`` these figures are for: each rank of a group of E data-parallel ranks holds
1/E of every MoE block's experts, tokens go to their experts' ranks and back by all-to-all (none dropped); under ZeRO
the experts are sharded over the dp_shard/E ranks left; tp splits attention and dense layers, not the experts: every
rank of a tp group holds its ep slice of them whole and computes the same tokens' experts. ``Parallel("hybrid", dp=D,
ep=E)`` splits each pipeline stage's experts over E of its D replicas."""

import json
from dataclasses import replace

import pytest

from paratrain.cli.main import main
from paratrain.errors import ConfigError
from paratrain.planner import TRANSFORMERS, Layout, PlanConfig, Training, make_cluster, make_plan, transformer_stats
from paratrain.planner.collectives import all_gather_s, all_reduce_s, all_to_all_s
from paratrain.planner.expert_parallel import dispatch_bytes, ep_comm_s, moe_flops, tp_share_comm_s
from paratrain.planner.expert_parallel import link_of as ep_link
from paratrain.planner.layout import layouts
from paratrain.planner.memory import memory_per_rank, model_states, ranked_split
from paratrain.planner.moe import mlp_activations
from paratrain.planner.tensor_parallel import rank_activations, rank_params
from paratrain.planner.timing import step_time
from paratrain.planner.training import batching
from paratrain.planner.transformer import transformer_params

MIXTRAL = transformer_stats(TRANSFORMERS["mixtral-8x7b"], name="mixtral-8x7b")
COUNTS = transformer_params(TRANSFORMERS["mixtral-8x7b"])
X = COUNTS["experts"]  # the routed experts: 8 x 3 x 4096 x 14336 a block, 32 blocks
DENSE = COUNTS["total"] - X
MIXED = Training(precision="bf16-mixed", optimizer="adamw", micro_batch=1)
CLUSTER = make_cluster("h100", gpus=8, nodes=4, inter_node="ib-ndr-x8")


def test_mixtral_experts_are_most_of_its_parameters():
    assert X == 32 * 8 * 3 * 4096 * 14336 and X / COUNTS["total"] == pytest.approx(0.966, abs=0.001)


@pytest.mark.parametrize(
    "name, zero, params, grads, optim",
    [
        # ddp: the dense parameters whole, 1/ep of the experts, nothing sharded
        ("ddp", 0, DENSE + X / 2, DENSE + X / 2, DENSE + X / 2),
        # zero2: states and gradients 1/N of the dense ones and 1/(N/ep) of the rank's 1/ep of the experts: 1/N of all
        ("zero2", 2, DENSE + X / 2, (DENSE + X) / 8, (DENSE + X) / 8),
        # zero3: everything 1/N, as without ep (ep changes what FSDP gathers, not what a rank keeps)
        ("zero3", 3, (DENSE + X) / 8, (DENSE + X) / 8, (DENSE + X) / 8),
    ],
)
def test_model_states_of_an_ep_rank_in_closed_form(name, zero, params, grads, optim):
    """8 ranks, ep=2: a rank's 4 experts sharded over the 4 ranks holding the same ones, one each."""
    layout = Layout.of(name=name, dp=8, zero=zero, shard=8 if zero else 1, ep=2)
    states = model_states(MIXTRAL, layout, MIXED)
    assert states.parameters == pytest.approx(2 * params)
    assert states.gradients == pytest.approx(2 * grads)
    assert states.optimizer_states == pytest.approx(12 * optim)  # fp32 master copy and Adam's two moments


@pytest.mark.parametrize(("ep", "expert_share"), [(1, 1 / 8), (2, 1 / 32), (8, 1 / 32)])
def test_past_the_experts_fsdp_keeps_a_whole_expert_a_rank_without_ep(ep, expert_share):
    """32 ranks and Mixtral's 8 experts: without ep FSDP cuts the fused expert tensors on their first dimension, the
    experts, so the busiest rank keeps one whole expert, X/8 (the dry run reads the same; tests/cli/test_dry_run.py);
    with ep the runtime cuts a rank's E/ep experts over the 32/ep ranks holding them on each expert's rows where
    those ranks outnumber them, so every rank keeps X/32."""
    layout = Layout.of(name="zero3", dp=32, zero=3, shard=32, ep=ep)
    states = model_states(MIXTRAL, layout, MIXED)
    assert states.parameters == pytest.approx(2 * (DENSE / 32 + X * expert_share))
    assert states.gradients == pytest.approx(2 * (DENSE / 32 + X * expert_share))


def test_fsdp_gathers_an_ep_ranks_share_of_a_blocks_experts():
    """zero3's buffers: the largest unit gathered twice (16-bit) and its gradient; a Mixtral block is 1.45B
    parameters, 1.41B of them experts, of which an ep=8 rank gathers 1/8."""
    block = COUNTS["block"]
    batch = batching(MIXED, dp=32, pp=1, world_size=32)
    plain = memory_per_rank(MIXTRAL, Layout.of(name="zero3", dp=32, zero=3, shard=32), batch, MIXED, CLUSTER)
    split = memory_per_rank(MIXTRAL, Layout.of(name="zero3", dp=32, zero=3, shard=32, ep=8), batch, MIXED, CLUSTER)
    assert plain.buffers == pytest.approx(3 * 2 * block)
    held = block - X / 32 + X / 32 / 8
    a2a = 2 * dispatch_bytes(MIXTRAL, "param_dtype", 1)  # one block's send and receive buffers
    assert split.buffers == pytest.approx(3 * 2 * held + a2a)
    assert a2a == 2 * 32768 * 2 * 4096 * 2  # s tokens x top 2 x hidden, 16-bit


def test_all_to_all_time_in_closed_form():
    """4 all-to-alls a block per micro-batch (dispatch and combine, forward and backward), 6 with recomputation;
    each sends b·s·k·h elements of the compute dtype, (E-1)/E of them off the rank; a pipeline stage those of its
    blocks."""
    link = CLUSTER.intra
    sent = 2 * 32768 * 2 * 4096 * 2  # micro-batch 2, without tp (beside it: 1/tp of it, each tp rank its share)
    assert dispatch_bytes(MIXTRAL, "autocast", 2) == sent
    one = (8 - 1) * link.latency_us * 1e-6 + 7 / 8 * sent / link.bytes_per_s
    assert all_to_all_s(sent, 8, link) == pytest.approx(one)
    assert ep_comm_s(MIXTRAL, "autocast", 2, 8, link, False) == pytest.approx(32 * 4 * one)
    assert ep_comm_s(MIXTRAL, "autocast", 2, 8, link, True) == pytest.approx(32 * 6 * one)
    assert ep_comm_s(MIXTRAL, "autocast", 2, 8, link, False, stages=4) == pytest.approx(8 * 4 * one)
    assert ep_comm_s(MIXTRAL, "autocast", 2, 1, link, True) == 0.0


def test_ddp_with_ep_syncs_the_dense_gradients_over_dp_and_the_experts_over_their_replicas():
    cluster = make_cluster("h100", gpus=8, nodes=1)
    layout = Layout.of(name="ddp", dp=8, ep=4)
    batch = batching(MIXED, dp=8, pp=1, world_size=8)
    t = step_time(MIXTRAL, layout, batch, MIXED, cluster)
    a2a = ep_comm_s(MIXTRAL, "autocast", 1, 4, cluster.intra, False)
    sync = all_reduce_s(2 * DENSE, 8, cluster.intra) + all_reduce_s(2 * X / 4, 2, cluster.intra)
    assert t.ep_comm_s == pytest.approx(a2a)
    assert t.comm_s == pytest.approx(sync + a2a)


def test_ep_is_planned_for_mixtures_of_experts_only_and_where_it_divides():
    plan = make_plan(
        MIXTRAL, PlanConfig(gpus=8, nodes=4, inter_node="ib-ndr-x8", tp=1, training=Training(micro_batch=1))
    )
    with_ep = [e for e in plan.estimates if e.layout.ep > 1]
    assert {e.name for e in with_ep} == {"ddp+ep", "zero2+ep", "zero3+ep", "hybrid+ep"}
    assert all(e.layout.ep in (2, 4, 8) for e in with_ep)
    gpt2 = make_plan(transformer_stats(TRANSFORMERS["gpt2"], name="gpt2"), PlanConfig(gpus=8))
    assert all(e.layout.ep == 1 for e in gpt2.estimates)
    with pytest.raises(ConfigError, match="--ep splits a mixture of experts' experts: 'gpt2' has none"):
        make_plan(transformer_stats(TRANSFORMERS["gpt2"], name="gpt2"), PlanConfig(gpus=8, ep=2))
    with pytest.raises(ConfigError, match=r"--ep 3: 8 experts do not divide by ep=3; use one of 1, 2, 4, 8"):
        make_plan(MIXTRAL, PlanConfig(gpus=6, ep=3))


def test_an_exact_layout_with_ep_compares_its_data_parallel_flavours():
    plan = make_plan(
        MIXTRAL,
        PlanConfig(gpus=8, nodes=4, inter_node="ib-ndr-x8", layout="dp=32,ep=8", training=Training(micro_batch=1)),
    )
    assert [e.name for e in plan.estimates[1:]] == ["ddp+ep", "zero2+ep", "zero3+ep"]
    assert all(e.layout.dims.ep == 8 for e in plan.estimates[1:])
    with pytest.raises(ConfigError, match=r"ep=8 must divide the 4 data-parallel ranks"):
        PlanConfig(gpus=8, layout="dp=4,tp=2,ep=8")
    with pytest.raises(ConfigError, match="--layout says ep=4 but --ep 8; give the degree once"):
        PlanConfig(gpus=8, layout="dp=8,ep=4", ep=8)


def test_an_ep_layout_is_recommended_when_it_is_faster_and_says_why():
    """Qwen3-30B-A3B on 16 H100s: with ep=8 each rank holds, gathers, streams and steps 1/8 of the 128 experts
    and shards its 16 over the 2 ranks holding the same ones, for a share of the step in all-to-alls: faster than
    zero3 alone by more than the plan's tie."""
    stats = transformer_stats(TRANSFORMERS["qwen3-30b-a3b"], name="qwen3")
    plan = make_plan(stats, PlanConfig(gpus=8, nodes=2, inter_node="ib-ndr-x8", tp=1, training=Training(micro_batch=1)))
    by_name = {e.name: e for e in plan.estimates}
    assert plan.choice.layout.ep == 8 and plan.choice.samples_per_s > 1.2 * by_name["zero3"].samples_per_s
    assert f"1/8 of the experts, for {1e3 * plan.choice.time.ep_comm_s:.3g} ms of all-to-alls" in plan.reason
    assert 0 < plan.choice.time.ep_comm_s < 0.2 * plan.choice.time.step_s


def test_the_cli_plans_ep_and_says_the_active_parameters(capsys):
    assert (
        main(["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--layout", "dp=8,ep=8", "--batch", "1", "--json"])
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert plan["model"]["moe"] == {
        "experts": 128,
        "top_k": 8,
        "layers": 48,
        "active_params": transformer_params(TRANSFORMERS["qwen3-30b-a3b"])["active"],
        "expert_params": transformer_params(TRANSFORMERS["qwen3-30b-a3b"])["experts"],
    }
    assert {s["layout"]["ep"] for s in plan["strategies"][1:]} == {8}
    assert all(s["time"]["ep_comm_s"] > 0 for s in plan["strategies"][1:])
    assert (
        main(["plan", "--model", "mixtral-8x7b", "--gpus", "8", "--nodes", "4", "--seq-len", "4096", "--batch", "1"])
        == 0
    )
    out = capsys.readouterr().out
    assert "46.7B parameters, 12.9B active per token" in out and "zero3+ep" in out


def test_hybrid_and_tp_with_ep_are_listed_where_ep_divides_their_data_parallel_ranks():
    """``Parallel("hybrid", dp=D, ep=E)`` (DDP replicas only, no tp) and ``Parallel("ddp"|"zero2"|"zero3", tp=T,
    ep=E)``, ep dividing the dp ranks; never ``pipeline`` (no replicas) nor hybrid's zero1."""
    found = layouts(make_cluster("h100", gpus=8), n_units=34, tp_degrees=(2,), ep_degrees=(2,))
    with_ep = {(lay.label, lay.describe()) for lay in found if lay.ep > 1}
    assert {
        ("hybrid+ep", "dp=4 pp=2 ep=2"),
        ("hybrid+ep", "dp=2 pp=4 ep=2"),
        ("ddp+tp+ep", "dp=4 tp=2 ep=2"),
        ("zero2+tp+ep", "dp=4 shard=4 tp=2 ep=2"),
        ("zero3+tp+ep", "dp=4 shard=4 tp=2 ep=2"),
    } <= with_ep
    assert not any(
        lay.ep > 1 and (lay.name == "pipeline" or (lay.pp > 1 and (lay.zero or lay.tp > 1))) for lay in found
    )
    assert all(lay.dims.dp % lay.ep == 0 for lay in found)


def test_expert_bytes_of_a_hybrid_ep_rank_in_closed_form():
    """Mixtral as hybrid dp=4 pp=2 ep=2: a stage holds 16 of the 32 blocks, so X/2 of the experts, of which an ep
    rank keeps 1/2, whole (DDP shards nothing); its dense part is the stage's, as without ep."""
    layout = Layout.of(name="hybrid", dp=4, pp=2, ep=2)
    dense, experts = ranked_split(MIXTRAL, layout)
    assert experts == X / 4
    assert dense == ranked_split(MIXTRAL, Layout.of(name="hybrid", dp=4, pp=2))[0]
    states = model_states(MIXTRAL, layout, MIXED)
    assert states.parameters == pytest.approx(2 * (dense + X / 4))
    assert states.optimizer_states == pytest.approx(12 * (dense + X / 4))


@pytest.mark.parametrize("name, zero, kept", [("ddp", 0, X / 2), ("zero2", 2, X / 2), ("zero3", 3, X / 4)])
def test_expert_bytes_of_a_tp_ep_rank_in_closed_form(name, zero, kept):
    """zero3, tp=2, ep=2 on 8 ranks (dp=4): tp does not split the experts, so a rank holds X/ep = X/2 of them,
    sharded under ZeRO over the dp/ep = 2 ranks holding the same ones (parameters under zero3, gradients and
    states from zero2)."""
    layout = Layout.of(name=name, dp=4, zero=zero, shard=4 if zero else 1, tp=2, ep=2)
    dense, experts = ranked_split(MIXTRAL, layout)
    assert experts == X / 2 and dense == rank_params(MIXTRAL, 2) - X
    states = model_states(MIXTRAL, layout, MIXED)
    assert states.parameters == pytest.approx(2 * ((dense / 4 if zero == 3 else dense) + kept))
    assert states.gradients == pytest.approx(2 * ((dense / 4 if zero >= 2 else dense) + (X / 4 if zero >= 2 else kept)))


def test_a_hybrid_ep_stage_waits_for_its_blocks_all_to_alls_in_every_slot():
    cluster = make_cluster("h100", gpus=8)
    layout = Layout.of(name="hybrid", dp=4, pp=2, ep=2)
    training = replace(MIXED, micro_batch=1, micro_batches=4)
    batch = batching(training, dp=4, pp=2, world_size=8)
    assert batch.micro_batches == 4
    t = step_time(MIXTRAL, layout, batch, training, cluster)
    per_slot = ep_comm_s(MIXTRAL, "autocast", batch.micro_batch, 2, cluster.link_for(2, 2), False, stages=2)
    assert per_slot > 0 and t.ep_comm_s == pytest.approx((4 + 1) * per_slot)  # m + p - 1 slots


def test_tp_ep_sends_each_tp_ranks_share_over_the_dp_link_and_divides_the_routed_experts_by_tp():
    """zero3 tp=8 ep=2 on 2 nodes of 8: the ep pair is one rank of each node (8 apart), so its all-to-alls cross the
    inter-node link, shared by the node's 8 pairs; each tp rank sends its 1/8 share of its micro-batch's tokens. The
    MoE MLPs' FLOPs (routed experts R, routers W) are not divided by tp alone: against the same model without them
    counted, a ddp tp=8 step computes (R + W)(1 - 1/8) more a sample; beside ep the tp ranks divide the routed
    experts' tokens, and only the routers' W(1 - 1/8) remain."""
    cluster = make_cluster("h100", gpus=8, nodes=2, inter_node="ib-ndr-x8")
    layout = Layout.of(name="zero3", dp=2, zero=3, shard=2, tp=8, ep=2)
    link = ep_link(cluster, layout)
    assert link == cluster.link_for(2, 8) and link.name == f"{cluster.inter.name} / 8"
    batch = batching(MIXED, dp=2, pp=1, world_size=16)
    t = step_time(MIXTRAL, layout, batch, MIXED, cluster)
    share = ep_comm_s(MIXTRAL, "param_dtype", batch.micro_batch, 2, link, False, tp=8)
    assert share < ep_comm_s(MIXTRAL, "param_dtype", batch.micro_batch, 2, link, False)
    # and over the tp link: per MoE block the outputs and the rows' gradients gathered, the experts' gradients summed
    tp_link, rows = cluster.link_for(8, 1), batch.micro_batch * 32768 * 4096 * 2
    gathers = 2 * MIXTRAL.moe.layers * all_gather_s(rows, 8, tp_link)
    summed = all_reduce_s(X / 2 * 2, 8, tp_link)
    assert tp_share_comm_s(MIXTRAL, "param_dtype", batch.micro_batch, 8, 2, tp_link, False) == pytest.approx(
        gathers + summed
    )
    assert tp_share_comm_s(MIXTRAL, "param_dtype", batch.micro_batch, 8, 1, tp_link, False) == 0.0
    assert t.ep_comm_s == pytest.approx(batch.micro_batches * (share + gathers + summed))
    assert dispatch_bytes(MIXTRAL, "param_dtype", 1, tp=8) * 8 == dispatch_bytes(MIXTRAL, "param_dtype", 1)
    whole, router = moe_flops(MIXTRAL), 6 * 32768 * 32 * 8 * 4096
    assert whole == 6 * 32768 * X * 2 / 8 + router  # 2 of 8 experts, and the routers (no shared experts)
    assert moe_flops(MIXTRAL, 8) == 6 * 32768 * X * 2 / 8 / 8 + router
    blind = replace(MIXTRAL, moe=replace(MIXTRAL.moe, top_k=0, whole=0))
    rate = cluster.flops_per_s("bf16-mixed", cluster.ranks_per_node)
    for plain, kept in ((Layout.of(name="ddp", dp=2, tp=8), whole), (layout, router)):
        extra = (
            step_time(MIXTRAL, plain, batch, MIXED, cluster).compute_s
            - step_time(blind, plain, batch, MIXED, cluster).compute_s
        )
        assert extra == pytest.approx(batch.micro_batches * batch.micro_batch * kept * (1 - 1 / 8) / rate)


@pytest.mark.parametrize(
    "text, message",
    [
        ("hybrid,ep=2", r"hybrid is a pipeline replicated over dp; give its stages too \(hybrid,pp=2,ep=2\)"),
        ("hybrid,pp=2,tp=2,ep=2", "a pipeline's experts are planned split over its dp replicas without tp"),
        ("dp=2,pp=2,ep=4", "ep=4 must divide the 2 data-parallel ranks"),
    ],
)
def test_a_hybrid_ep_layout_is_named_on_the_cli_or_refused_in_one_line(text, message):
    plan = make_plan(MIXTRAL, PlanConfig(gpus=8, layout="hybrid,pp=2,ep=2", training=Training(micro_batch=1)))
    assert [(e.name, e.layout.describe()) for e in plan.estimates[1:]] == [("hybrid+ep", "dp=4 pp=2 ep=2")]
    with pytest.raises(ConfigError, match=message) as refused:
        make_plan(MIXTRAL, PlanConfig(gpus=8, layout=text))
    assert "\n" not in str(refused.value)


def test_a_tp_rank_keeps_the_moe_blocks_activations_whole():
    """tp runs each MoE block whole over the gathered sequence: what its MLP saves is not divided by tp, the rest of
    the split figure is (against the same stats without that figure)."""
    whole = MIXTRAL.moe.mlp_activations["autocast"]
    assert whole == 32 * 32768 * mlp_activations(TRANSFORMERS["mixtral-8x7b"].moe, 4096, True, act=2)
    figures = MIXTRAL.mixed["autocast"]
    blind = replace(MIXTRAL, moe=replace(MIXTRAL.moe, mlp_activations={}))
    for sp in (True, False):
        split, plain = (rank_activations(s, figures, "autocast", 4, sp) for s in (MIXTRAL, blind))
        assert split[0] - plain[0] == pytest.approx(whole * (1 - 1 / 4))
        assert split[1] - plain[1] == pytest.approx(whole / 32 * (1 - 1 / 4))
