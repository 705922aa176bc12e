"""Every strategy on the models people train (tests/helpers/zoo.py), equal to one plain process on the same global
batch.

One launched job per world size runs every case (tests/helpers/zoo_workers.py); the tests below read its results. The
reference is plain PyTorch in this process: the global batch split into the replicas' slices, one forward each,
the mean of their losses. Without BatchNorm that is the global-batch step (checked here to 1e-6); with BatchNorm
it is what data parallelism computes — statistics per replica's slice, and the running statistics of rank 0's
slice (DDP broadcasts rank 0's buffers; the other strategies keep each rank's own, and rank 0's are saved).
"""

from __future__ import annotations

import pytest
import torch
from helpers import packed
from helpers.zoo import ZOO
from helpers.zoo_workers import MICRO, TOL, reference, run_case, run_cases

from paratrain.testing import max_abs_diff, spawn

WORLD2 = ("ddp", "zero1", "zero2", "zero3", "model_parallel")
# At real sizes the embedding and head exceed the size rule's threshold and become units of their own; these tiny
# models need a small threshold for that, which is where a tie split across units used to fail.
# Llama's embedding and head are not tied: as units of their own they are what any unit is (zero3 above).
SMALL_UNITS = [("gpt2", "zero3"), ("nanogpt", "zero2"), ("lora", "zero3")]
# Pipelines split nn.Sequential models between layers and transformers between blocks
# (tests/distributed/test_pipeline_models.py covers GPT-2, Llama, BERT, LoRA and our GPT); the zoo's other models,
# BERT's embedding block and a PEFT model cut between its base model's blocks run here too.
PIPELINED = ("cnn", "frozen", "bert", "lora")
HYBRID_DATA = ("ddp", "zero1", "fsdp")  # how hybrid's replicas hold their stages: DDP, ZeRO-1 or FSDP
# Each way on the models where it differs: BatchNorm's buffers (cnn), frozen parameters (frozen, LoRA's base); BERT's
# stage holding its embedding block is the cut, the same under each (fsdp here, ddp and zero1 on GPT-2 and Llama in
# tests/distributed/test_pipeline_models.py).
HYBRID = [(m, d) for m in PIPELINED for d in HYBRID_DATA if m != "bert"] + [("bert", "fsdp")]
SPLIT = {"frozen": {"split": [3]}}  # by size the first stage would hold only the frozen layer: refused, see below
# Packed documents (tests/helpers/packed.py): Llama under ddp and tp, Qwen2 under zero2, Mixtral under ddp,
# paratrain's GPT (positions=, a loss_fn's mean weighed by the real tokens) under ddp and tp (its cp cases:
# tests/distributed/test_context_parallel.py). The weighing is forward_backward's whatever holds the parameters (ddp,
# a ZeRO stage), and Qwen3's attention reads position_ids as Llama's does: one case each proves it.
PACKED = [("llama", "ddp"), ("llama", "tp"), ("qwen2", "zero2")]
PACKED += [("mixtral", "ddp")]  # MoE: experts that get no token of a replica
PACKED += [("gpt", "ddp"), ("gpt", "tp")]
PACKED_PIPELINE = {"microbatches": 2}  # two rows, each a micro-batch, of a new length at every step
PACKED_PIPELINED = ("gpt",)  # Llama's: under hybrid (world 4), a pipeline of 2 replicas
CHECKPOINTED = [
    ("gpt2", "zero3", True),
    ("llama", "ddp", True),
    ("nanogpt", "zero2", 2),
    ("bert", "zero1", True),
    ("lora", "model_parallel", True),
]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = [(m, s, {}) for m in ZOO for s in WORLD2] + [(m, s, {"min_params": 1}) for m, s in SMALL_UNITS]
    cases += [(m, s, {"activation_checkpointing": k}) for m, s, k in CHECKPOINTED]
    cases += [(m, "pipeline", SPLIT.get(m, {})) for m in PIPELINED] + [("frozen", "pipeline", {})]
    cases += [(f"packed_{m}", s, {}) for m, s in PACKED] + [("packed_gpt_own", "ddp", {})]
    cases += [(f"packed_{m}", "pipeline", PACKED_PIPELINE) for m in PACKED_PIPELINED]
    return spawn(run_cases, 2, (cases, str(tmp_path_factory.mktemp("zoo2"))), timeout_s=600)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = [(m, "hsdp", {}) for m in ZOO]
    cases += [(m, "hybrid", {"data": d, **SPLIT.get(m, {})}) for m, d in HYBRID]
    cases += [("packed_llama", "hybrid", {"data": "ddp", **PACKED_PIPELINE})]
    return spawn(run_cases, 4, (cases, str(tmp_path_factory.mktemp("zoo4"))), timeout_s=600)[0]


@pytest.fixture(scope="module")
def references():
    return {m: reference(m, 2) for m in ZOO}


def check(result: dict, expected: dict[str, torch.Tensor], model_name: str) -> None:
    assert "error" not in result, result.get("error")
    assert not result["problems"], result["problems"]
    assert max_abs_diff(result["state"], expected) <= TOL
    assert result["resumed"] <= 1e-6, "save -> load -> continue differs from the uninterrupted run"
    ZOO[model_name].build().load_state_dict(result["state"])  # the full state dict loads into the plain model


@pytest.mark.launched
@pytest.mark.parametrize("strategy", WORLD2)
@pytest.mark.parametrize("model_name", list(ZOO))
def test_zoo_world2_equals_one_process(world2, references, model_name, strategy):
    check(world2[f"{model_name}/{strategy}"], references[model_name], model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy", SMALL_UNITS)
def test_zoo_with_embedding_and_head_as_units(world2, references, model_name, strategy):
    check(world2[f"{model_name}/{strategy}{{'min_params': 1}}"], references[model_name], model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy, every", CHECKPOINTED)
def test_zoo_with_activation_checkpointing(world2, references, model_name, strategy, every):
    check(world2[f"{model_name}/{strategy}{{'activation_checkpointing': {every}}}"], references[model_name], model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", list(ZOO))
def test_zoo_hsdp_world4_equals_one_process(world4, model_name):
    check(world4[f"{model_name}/hsdp"], reference(model_name, 4), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name", list(PIPELINED))
def test_zoo_pipeline_world2(world2, model_name):
    result = world2[f"{model_name}/pipeline{SPLIT.get(model_name, '')}"]
    # one replica: the global batch is PER_RANK samples, in MICRO micro-batches
    check(result, reference(model_name, 1, microbatches=MICRO), model_name)


@pytest.mark.launched
@pytest.mark.parametrize("model_name, strategy", PACKED)
def test_packed_documents_equal_each_document_alone(world2, model_name, strategy):
    """Replicas with uneven real tokens: attention within each document, the loss over the global batch's."""
    result = world2[f"packed_{model_name}/{strategy}"]
    assert "error" not in result, result.get("error")
    replicas = 1 if strategy == "tp" else 2  # tp's two ranks are one replica
    assert max_abs_diff(result["state"], packed.reference(model_name, replicas)) <= TOL


@pytest.mark.launched
def test_packed_documents_with_a_models_own_mean_loss_are_refused(world2):
    """A model's own ``model(x, y)`` loss is one replica's mean, which nothing can weigh by the global real tokens."""
    error = world2["packed_gpt_own/ddp"].get("error", "")
    assert "a packed batch with OwnLossGPT's own loss from its targets" in error
    assert "give forward_backward a loss_fn over the logits" in error


@pytest.mark.launched
@pytest.mark.parametrize("model_name", PACKED_PIPELINED)
def test_packed_documents_under_a_pipeline_equal_each_document_alone(world2, model_name):
    """Every stage sees the positions; the last stage's micro-batch losses are each divided by the batch's real
    tokens and summed (a loss_fn's micro-batch means weighed by their real tokens)."""
    result = world2[f"packed_{model_name}/pipeline{PACKED_PIPELINE}"]
    assert "error" not in result, result.get("error")
    assert max_abs_diff(result["state"], packed.reference(model_name, 2)) <= TOL  # 2 rows: the documents of 2 groups


@pytest.mark.launched
def test_a_pipeline_stage_of_frozen_layers_is_refused(world2):
    assert "stage 0 (layers 0..0) holds no trainable parameter" in world2["frozen/pipeline"]["error"]


@pytest.mark.launched
@pytest.mark.parametrize("model_name, data", HYBRID)
def test_zoo_hybrid_world4(world4, model_name, data):
    result = world4[f"{model_name}/hybrid{ {'data': data, **SPLIT.get(model_name, {})} }"]
    check(result, reference(model_name, 2, microbatches=MICRO), model_name)  # 2 replicas x 2 stages


@pytest.mark.launched
def test_packed_documents_under_hybrid_equal_each_document_alone(world4):
    """2 replicas x 2 stages: the loss over both replicas' real tokens."""
    result = world4[f"packed_llama/hybrid{ {'data': 'ddp', **PACKED_PIPELINE} }"]
    assert "error" not in result, result.get("error")
    assert max_abs_diff(result["state"], packed.reference("llama", 4)) <= TOL  # 2 replicas x 2 rows


@pytest.mark.filterwarnings("ignore:strategy 'dp' on the CPU")
@pytest.mark.parametrize("strategy", ["single", "dp"])
@pytest.mark.parametrize("model_name", list(ZOO))
def test_zoo_in_one_process(tmp_path, model_name, strategy):
    check(run_case(model_name, strategy, {}, str(tmp_path)), reference(model_name, 1), model_name)


def test_batch_norm_reference_is_per_replica_and_the_rest_is_the_global_batch():
    """The reference's slicing changes nothing but BatchNorm: a model without it equals the one-slice run."""
    for name in ("gpt2", "nanogpt"):
        assert max_abs_diff(reference(name, 2), reference(name, 2, slices=1)) <= TOL
    assert max_abs_diff(reference("cnn", 2), reference("cnn", 2, slices=1)) > 1e-3
