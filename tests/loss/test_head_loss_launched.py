"""``Parallel(loss_chunk=)`` under the data-parallel strategies at world size 2, equal to one plain process on the same
global batch: DDP (also finding unused parameters, and with a static graph), ZeRO-2, FSDP2 with the head inside the
root and as a unit of its own (tied to the embedding or not, also under bf16-mixed), model parallelism;
transformers' ``labels=``, nanoGPT's ``model(x, y)`` and a ``loss_fn`` (tests/helpers/loss_workers.py); and the
strategies that compute the loss themselves (tp, pipelines) refusing it in one line on every rank."""

from __future__ import annotations

import pytest
from helpers.loss_workers import case_key, reference, run_cases
from helpers.ps_workers import run_zoo, zoo_reference
from helpers.zoo_workers import TOL

from paratrain.testing import max_abs_diff, spawn

CASES = [
    ("gpt2", "labels", "ddp", {}),
    ("gpt2", "labels", "zero3", {}),
    ("gpt2", "labels", "zero3", {"min_params": 1}),  # the tied embedding and head: one unit, resharded after use
    ("gpt2", "labels", "model_parallel", {}),
    ("llama", "labels", "zero3", {"min_params": 1}),  # the head a unit of its own
    ("llama", "labels", "zero3", {"activation_checkpointing": True}),
    ("llama", "loss_fn", "ddp", {"static_graph": True}),
    ("lora", "labels", "ddp", {}),
    ("nanogpt_real", "targets", "ddp", {"find_unused_parameters": True}),
    ("nanogpt_real", "targets", "zero3", {"min_params": 1}),
    ("nanogpt", "loss_fn", "zero2", {}),
]
BF16 = {"precision": "bf16-mixed", "min_params": 1}  # FSDP's mixed precision: the head's unit casts what it reads
MIXED = [("llama", "labels", "zero3", BF16), ("llama", "labels", "zero3", {**BF16, "loss_chunk": None})]
REFUSED = [("gpt2", "labels", "tp", {}), ("gpt2", "labels", "pipeline", {})]
SAYS = ["tp splits the head over the vocabulary", "the last stage computes the loss inside the schedule"]


@pytest.fixture(scope="module")
def world2():
    return spawn(run_cases, 2, (CASES + MIXED + REFUSED,), timeout_s=300)[0]


@pytest.mark.launched
@pytest.mark.timeout(360)
@pytest.mark.parametrize("case", CASES, ids=case_key)
def test_chunked_loss_under_a_strategy_equals_one_plain_process(world2, case):
    result = world2[case_key(case)]
    assert "error" not in result, result.get("error")
    assert max_abs_diff(result, reference(case[0], case[1], 2)) <= 1e-6


@pytest.mark.launched
@pytest.mark.timeout(360)
def test_under_fsdp_mixed_precision_it_stays_with_the_plain_loss(world2):
    chunked, plain = (world2[case_key(case)] for case in MIXED)
    assert "error" not in chunked and "error" not in plain
    assert max_abs_diff(chunked, plain) <= 5e-3  # bf16's resolution at the parameters' size (~1)


@pytest.mark.launched
@pytest.mark.timeout(360)
@pytest.mark.parametrize("case, says", list(zip(REFUSED, SAYS)), ids=[c[2] for c in REFUSED])
def test_strategies_that_compute_the_loss_themselves_refuse_it(world2, case, says):
    error = world2[case_key(case)].get("error", "")
    assert error.startswith("loss_chunk does not run here: ") and says in error and "\n" not in error


@pytest.mark.launched
@pytest.mark.timeout(240)
def test_parameter_server_workers_compute_it_too():
    """Two workers and a server (sync): the workers' chunked loss trains the served parameters as the plain one."""
    results = spawn(run_zoo, 3, ("nanogpt", {"servers": 1, "loss_chunk": 3}), timeout_s=180)
    assert max_abs_diff(results[0]["state"], zoo_reference("nanogpt", 2)) <= TOL
