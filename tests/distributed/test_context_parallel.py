"""Context parallelism (``cp=``, Ulysses or the all-gather): a sequence split over ranks trains equal to one process
on the same global batch, on transformers Llama (GQA, rotary; fewer key/value heads than cp), Qwen2 (eager
attention), GPT-2 (learned positions, tied head) and paratrain's GPT, under ddp, zero3 and tp; save and resume; packed
documents equal to each document alone; bad input as one line.

One launched job per world size runs every case (tests/helpers/cp_workers.py); the reference is plain PyTorch in
this process: each replica's slice of the global batch one forward on whole sequences, the mean of their losses.
"""

from __future__ import annotations

import pytest
import torch
from helpers import cp_workers as w
from helpers import packed
from helpers.activations import saved_bytes

from paratrain.env import ClusterEnv
from paratrain.errors import ConfigError
from paratrain.options import CPConfig
from paratrain.strategies.composed import preset
from paratrain.testing import max_abs_diff, spawn

TOL = 2e-5
# (model, strategy, options, mode): every model under ddp or zero3, every mode, each mode under both (not every model
# under every mode and strategy: Qwen2, whose eager attention is what differs, takes a batch under ddp; GPT-2 a batch
# under zero2, labels= under zero3 and at cp=4; torchtitan's DeepSeek-V3 trains under zero3 with checkpointing)
WORLD2 = [
    ("llama", "ddp", {"cp": 2}, "labels"),
    ("llama", "zero3", {"cp": 2}, "batch"),
    ("qwen2", "ddp", {"cp": 2}, "batch"),
    ("gpt2", "zero3", {"cp": 2}, "labels"),
    ("gpt", "zero3", {"cp": 2}, "loss_fn"),
    ("llama", "ddp", {"cp": 2}, "loss_fn"),
    ("gpt2", "zero2", {"cp": 2}, "batch"),
    ("gpt_loss", "ddp", {"cp": 2}, "own"),
    ("llama", "ddp", {"cp": 2, "activation_checkpointing": True}, "batch"),
    # torchtitan's shapes: attention found by its SDPA call, 2-D positions, latent attention (v narrower than q, k)
    ("titan_llama", "ddp", {"cp": 2}, "loss_fn"),
    ("titan_qwen3", "zero3", {"cp": 2}, "loss_fn"),
    ("titan_dsv3", "zero3", {"cp": 2, "activation_checkpointing": True}, "loss_fn"),
    ("inline", "ddp", {"cp": 2, "activation_checkpointing": True}, "loss_fn"),  # SDPA in the checkpointed block
    ("nanogpt_kernel", "ddp", {"cp": 2}, "own"),  # nanoGPT's hand-written attention marked is_attention_kernel
    # the all-gather: 1 key/value head at cp=2 (auto chooses it; head-tail pieces, padding in the rows' masks), a
    # kernel module's SDPA call, and a call found by what it does (auto per call: contiguous pieces)
    ("llama_kv1", "ddp", {"cp": 2}, "batch"),
    ("gpt", "zero3", {"cp": 2, "cp_method": "allgather"}, "loss_fn"),
    ("titan_llama_kv1", "ddp", {"cp": 2}, "loss_fn"),
]
WORLD4 = [
    ("llama", "zero3", {"cp": 2}, "batch"),
    ("llama", "zero3", {"cp": 2, "tp": 2}, "labels"),
    ("llama", "ddp", {"cp": 2, "tp": 2}, "batch"),
    ("gpt2", "zero3", {"cp": 4}, "labels"),
    ("gpt", "ddp", {"cp": 4}, "loss_fn"),
    ("gpt", "zero3", {"cp": 2, "tp": 2}, "loss_fn"),
    ("titan_dsv3_h8", "zero3", {"cp": 2, "tp": 2}, "loss_fn"),  # torchtitan's shapes under tp x cp: the one with
    # latent attention and experts (its Llama 3 below, with the all-gather; Qwen3's query/key norms at world 2)
    ("llama_kv2", "zero3", {"cp": 4}, "batch"),  # 2 key/value heads at cp=4: the all-gather
    ("titan_llama", "zero3", {"cp": 2, "tp": 2}, "loss_fn"),  # 1 key/value head a tp rank: the all-gather per call
]
# packed documents (tests/helpers/packed.py), each row filled up to the 2 x cp pieces: Ulysses and the all-gather;
# at world 4 two replicas hold different numbers of real tokens
PACKED = [("llama", "ddp", {"cp": 2}), ("llama", "zero3", {"cp": 2, "cp_method": "allgather"})]
PACKED += [("gpt", "zero3", {"cp": 2})]  # paratrain's GPT: its attention kernel module handed the whole documents
PACKED4 = [("llama", "ddp", {"cp": 2, "cp_method": "allgather"}), ("gpt", "ddp", {"cp": 2, "cp_method": "allgather"})]
REFUSED = {
    "uneven sequence": "cp=2 cuts each sequence into 2 equal slices, but this batch's sequences have 15 tokens",
    "4-D mask": "cp takes a 2-D attention_mask",
    "heads": "1 key/value heads do not divide over the 2 ranks that split them (tp x cp)",
    "no attention": "cp found no attention in NoAttention to split the sequence around (it finds a "
    "scaled_dot_product_attention call or a transformers attention module); call F.scaled_dot_product_attention, "
    "or move hand-written attention (q @ k.transpose(-2, -1), softmax, @ v) into a module of its own whose "
    "forward(q, k, v) maps [b, h, s, d] to [b, h, s, d] and set is_attention_kernel = True on it",
    "attn_mask": "MaskedAttention calls scaled_dot_product_attention with an explicit attn_mask, which cp cannot",
    "sdpa heads": "attention sees 4 query and 1 key/value heads on this rank, which cp=2 cannot split",
    "positions shape": "cp cuts positions= along the sequence as it does the inputs: [seq] or [batch or 1, seq], got",
    "loss_chunk": "loss_chunk does not run here: cp hands the head a slice",
    "zero1 cp=2": "strategy 'zero1' does not take cp",
    "pipeline cp=2": "'pipeline' does not take cp",
    "ddp cp=3": "ddp with cp=3 needs a number of processes (beside tp) that cp divides, got 2",
    "allgather kernel": "cp_method='allgather' hands attention this rank's rows of the mask, and "
    "transformer.h.0.attn.attention (is_attention_kernel) computes attention without a scaled_dot_product_attention",
    "allgather uneven": "cp=2 cuts each sequence into 4 equal slices (two a rank, head and tail, for the all-gather's "
    "balance), but this batch's sequences have 14 tokens; pad them to a multiple of 4",
}
REFUSED4 = {"tp x cp heads": "inner_attention: attention sees 2 query and 1 key/value heads on this rank, which cp=2"}
LONG = 256  # tokens of the sequence whose activations are measured


def key(case: tuple) -> str:
    return "/".join(str(x) for x in case)


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = WORLD2 + [("refuse", r) for r in REFUSED] + [("packed", *c) for c in PACKED]
    return spawn(w.run_cases, 2, (cases, str(tmp_path_factory.mktemp("cp2"))), timeout_s=300)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = [*WORLD4, ("activations", LONG), *(("refuse", r) for r in REFUSED4), *(("packed", *c) for c in PACKED4)]
    return spawn(w.run_cases, 4, (cases, str(tmp_path_factory.mktemp("cp4"))), timeout_s=300)[0]


def check(result: dict, case: tuple, world: int) -> None:
    name, _, options, mode = case
    assert "error" not in result, result.get("error")
    assert result["replicas"] == world // (options["cp"] * options.get("tp", 1)), "cp ranks are no replicas"
    state, losses = w.reference(name, mode, result["replicas"])
    assert max_abs_diff(result["state"], state) <= TOL
    assert result["losses"] == pytest.approx(losses, abs=1e-5), "the loss every rank reports is the global batch's"
    assert result["resumed"] <= 1e-6, "save -> load -> continue differs from the uninterrupted run"


@pytest.mark.launched
@pytest.mark.parametrize("case", WORLD2, ids=key)
def test_cp_world2_equals_one_process(world2, case):
    check(world2[key(case)], case, 2)


@pytest.mark.launched
@pytest.mark.parametrize(
    "world, case", [pytest.param(n, c, id=f"world{n}/{key(c)}") for n, cs in ((2, PACKED), (4, PACKED4)) for c in cs]
)
def test_cp_packed_documents_equal_each_document_alone(request, world, case):
    """A packed row (position_ids restarting at each document) trains as one process that runs each document alone,
    the loss over the global batch's real tokens (the cp ranks of a replica read the same documents)."""
    result = request.getfixturevalue(f"world{world}")[key(("packed", *case))]
    assert "error" not in result, result.get("error")
    assert max_abs_diff(result["state"], packed.reference(case[0], world // case[2]["cp"])) <= TOL


@pytest.mark.launched
@pytest.mark.parametrize("case", WORLD4, ids=key)
def test_cp_world4_equals_one_process(world4, case):
    check(world4[key(case)], case, 4)


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(360)
def test_cp_under_hsdp_world8_equals_one_process(tmp_path):
    """hsdp x cp=2 over 8 ranks: 2 replicas of shard groups of 2, each rank's cp partner beside it."""
    case = ("llama", "hsdp", {"cp": 2, "shard_size": 2}, "batch")
    check(spawn(w.run_cases, 8, ([case], str(tmp_path)), timeout_s=330)[0][key(case)], case, 8)


@pytest.mark.launched
@pytest.mark.parametrize("case", list(REFUSED))
def test_cp_bad_input_is_one_line(world2, case):
    error = world2[key(("refuse", case))]["error"]
    assert error is not None and REFUSED[case] in error and "\n" not in error


@pytest.mark.launched
@pytest.mark.parametrize("case", list(REFUSED4))
def test_cp_bad_input_under_tp_is_one_line(world4, case):
    error = world4[key(("refuse", case))]["error"]
    assert error is not None and REFUSED4[case] in error and "\n" not in error


@pytest.mark.launched
def test_cp4_keeps_a_quarter_of_the_activations(world4):
    """A sequence that does not fit one rank's activation budget trains across 4: autograd saves about 1/4 per rank
    (what attention's exchange adds, whole sequences for a quarter of the heads, is the same size as a slice)."""
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2, hidden=64, heads=4, seq_len=LONG, vocab=w.VOCAB))
    x = torch.randint(0, w.VOCAB, (1, LONG), generator=torch.Generator().manual_seed(0))
    whole = saved_bytes(model, x, autocast=False)
    ratio = world4[key(("activations", LONG))]["bytes"] / whole
    assert 0.2 < ratio < 0.3, ratio


def env(world: int) -> ClusterEnv:
    return ClusterEnv(rank=0, local_rank=0, world_size=world, local_world_size=world)


@pytest.mark.parametrize(
    "strategy, options, world, shape",
    [
        ("ddp", {"cp": 2}, 4, {"dp": 2, "cp": 2}),
        ("zero3", {"cp": 2, "tp": 2}, 8, {"dp": 2, "cp": 2, "tp": 2}),
        ("zero2", {"cp": 4}, 4, {"dp": 1, "cp": 4}),
        ("hsdp", {"cp": 2, "shard_size": 2}, 8, {"replicate": 2, "shard": 2, "cp": 2}),
    ],
)
def test_cp_is_a_mesh_dimension_beside_the_data_ranks(strategy, options, world, shape):
    dims = preset(strategy)(**options).dims(env(world))
    assert dims.mesh_shape() == shape
    assert dims.dp == world // (options["cp"] * options.get("tp", 1))  # cp ranks are no data-parallel replicas


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_cp_degree_must_be_a_positive_integer(value):
    with pytest.raises(ConfigError, match="cp must be an integer >= 1"):
        CPConfig(degree=value)


def test_cp_one_is_off():
    assert CPConfig.pop({"cp": 1}) is None and preset("ddp")(cp=1).describe() == "ddp(bucket_cap_mb=25)"
    assert preset("zero3")(cp=2).describe().endswith("cp=2)")


def test_dry_run_shards_over_dp_times_cp():
    """On the fake process group: zero3 x cp=2 over 8 ranks holds what zero3 over 8 holds (the parameters are sharded
    over dp x cp), and a cp that does not divide the world is the launch's one line."""
    from paratrain.dry_run.probe import dry_run

    with_cp = dry_run(w.llama, world=8, strategy="zero3", options={"cp": 2})
    without = dry_run(w.llama, world=8, strategy="zero3")
    assert with_cp.error is None and "cp=2" in with_cp.layout
    assert [r.total for r in with_cp.ranks] == [r.total for r in without.ranks]
    assert "cp=3 needs a number of processes" in dry_run(w.llama, world=8, strategy="ddp", options={"cp": 3}).error
