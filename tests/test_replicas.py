"""The ranks as replicas after ``prepare`` (:mod:`paratrain.replicas`): each data-parallel replica draws from a
random stream of its own with or without ``seed=`` (the ranks of a tensor-parallel group share theirs), identical
first batches on two replicas are a warning, and so are different ones on the ranks of a tp group or pipeline, and a
global batch gives its accumulation once ``auto`` has chosen.

One ``paratrain run -n 2`` job runs every case (tests/scripts/replica_draws.py). Rank 0's initial weights on every
rank and the one-line errors of work one rank does alone are in tests/test_real_code.py.
"""

from __future__ import annotations

import json

import pytest
from helpers.cli import run_cli
from helpers.paths import SCRIPTS

pytestmark = pytest.mark.launched  # every test here starts processes


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("draws") / "out.json"
    done = run_cli("run", "-n", "2", str(SCRIPTS / "replica_draws.py"), str(out), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), done.stderr


def _warned(stderr: str, case: str, about: str = "fed the model identical first batches") -> bool:
    """Whether rank 0 warned ``about`` (identical first batches) while ``case`` ran."""
    part = stderr.split(f"case {case}")[1].split("case ")[0]
    return about in part


@pytest.mark.parametrize("case", ["ddp same", "ddp own", "auto own"])
def test_data_parallel_replicas_draw_apart_without_a_seed(job, case):
    ranks = job[0][case]["ranks"]
    assert ranks[0]["replica"] != ranks[1]["replica"]
    assert ranks[0]["mine"] != ranks[1]["mine"]


@pytest.mark.parametrize("case", ["tp same", "pipeline rank"])
def test_the_ranks_of_one_tp_group_or_pipeline_draw_alike(job, case):
    ranks = job[0][case]["ranks"]
    assert ranks[0]["replica"] == ranks[1]["replica"] == 0
    assert ranks[0]["mine"] == ranks[1]["mine"]


def test_identical_first_batches_on_two_replicas_warn_once(job):
    results, stderr = job
    assert _warned(stderr, "ddp same")
    assert not _warned(stderr, "ddp own")
    assert not _warned(stderr, "tp same")  # one replica: its two ranks read one batch by design
    assert not _warned(stderr, "ddp evaluate")  # an evaluation before the first step is no training batch
    assert stderr.count("fed the model identical first batches") == 1


def test_different_inputs_inside_a_tp_group_or_a_pipeline_warn_naming_the_seed(job):
    """A tp group's ranks (a pipeline's stages) must read one batch, in training and in generation after it: seeded
    with ``par.rank`` they do not."""
    _, stderr = job
    apart = "got different inputs at"
    assert _warned(stderr, "tp rank", f"ranks 0 and 1 of a tp group {apart} the first step")
    assert "seed per data-parallel replica (par.data_parallel_rank), not par.rank" in stderr
    assert _warned(stderr, "pipeline rank", f"ranks 0 and 1 of a pp group {apart} the first step")
    assert _warned(stderr, "tp generate", f"ranks 0 and 1 of a tp group {apart} their first forward outside par.step")
    assert not any(_warned(stderr, c, apart) for c in ("tp same", "ddp own", "ddp same", "auto own", "zero3-cp same"))
    assert stderr.count(apart) == 3


@pytest.mark.parametrize("case, accumulate", [("ddp own", 2), ("tp same", 4), ("auto own", 2)])
def test_the_global_batch_gives_the_accumulation_of_the_layout(job, case, accumulate):
    assert all(r["accumulate"] == accumulate for r in job[0][case]["ranks"])
