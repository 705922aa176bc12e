"""Model shapes found by what their modules do (tests/helpers/shapes.py: blocks in a ModuleDict, attention behind a
wrapper with 2-D positions, experts not named ``experts`` called with tensor counts, latent attention), equal to one
plain process on the same global batch, saved and resumed.

One launched job per world size runs the data-parallel, pipeline and checkpointing layouts here, with the zoo's
``run_case`` and ``reference`` (tests/helpers/zoo_workers.py). The same models run in the jobs of the suites that own
the other layouts: tp=2 and zero3 x tp=2 in tests/distributed/test_tp_auto.py (the latent attention split, a warning
when a plan leaves blocks whole), cp=2 and cp x tp in tests/distributed/test_context_parallel.py (attention found by
its SDPA call, 2-D positions), ep=2 and zero3 x tp x ep in tests/distributed/test_expert_parallel.py (experts found by
their stacked weights and routed calls, float counts handed back as a tensor).
"""

from __future__ import annotations

import pytest
from helpers.zoo import SHAPES
from helpers.zoo_workers import MICRO, TOL, reference, run_cases

from paratrain.testing import max_abs_diff, spawn

WORLD2 = [("ddp", {}), ("zero3", {"activation_checkpointing": True}), ("pipeline", {})]
WORLD4 = [("hybrid", {"data": "fsdp"})]


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    cases = [(m, s, o) for m in SHAPES for s, o in WORLD2]
    return spawn(run_cases, 2, (cases, str(tmp_path_factory.mktemp("shapes2"))), timeout_s=600)[0]


@pytest.fixture(scope="module")
def world4(tmp_path_factory):
    cases = [(m, s, o) for m in SHAPES for s, o in WORLD4]
    return spawn(run_cases, 4, (cases, str(tmp_path_factory.mktemp("shapes4"))), timeout_s=600)[0]


def check(result: dict, expected: dict) -> None:
    assert "error" not in result, result.get("error")
    assert not result["problems"], result["problems"]
    assert max_abs_diff(result["state"], expected) <= TOL
    assert result["resumed"] <= 1e-6, "save -> load -> continue differs from the uninterrupted run"


@pytest.mark.launched
@pytest.mark.parametrize("strategy, options", WORLD2)
@pytest.mark.parametrize("model_name", list(SHAPES))
def test_shapes_world2(world2, model_name, strategy, options):
    result = world2[f"{model_name}/{strategy}{options or ''}"]
    pipelined = strategy == "pipeline"  # one replica: the global batch in MICRO micro-batches
    check(result, reference(model_name, 1 if pipelined else 2, microbatches=MICRO if pipelined else 1))


@pytest.mark.launched
@pytest.mark.parametrize("strategy, options", WORLD4)
@pytest.mark.parametrize("model_name", list(SHAPES))
def test_shapes_world4(world4, model_name, strategy, options):
    hybrid = strategy == "hybrid"  # 2 replicas x 2 stages, each replica's slice in MICRO micro-batches
    expected = reference(model_name, 2, microbatches=MICRO) if hybrid else reference(model_name, 4)
    check(world4[f"{model_name}/{strategy}{options or ''}"], expected)
