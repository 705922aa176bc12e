"""Checkpoints across processes: bitwise-exact resume (ddp, zero3, hybrid with DDP stages), resharding onto another
world size, export.

The saving runs share one launched job per world size, and the resuming runs another (``helpers.cases.each_call``):
every load happens in a fresh job, as after a crash.
"""

import pytest
import torch
from helpers.cases import each_call
from helpers.checkpoint_workers import dropout_model, train
from helpers.hf_export_workers import export_round, same_as_pretrained
from helpers.zoo import SPECS

from paratrain.checkpoint import export
from paratrain.testing import alive, child_pids, spawn

pytestmark = pytest.mark.launched  # every test here starts processes

HYBRID = {"schedule": "gpipe", "microbatches": 2}
HF_EXPORTS = {
    4: [("llama", "zero3", {"tp": 2}), ("mixtral", "zero3", {"tp": 2})],
    2: [("mixtral", "ddp", {"ep": 2})],
}
"""Per world size, the transformers models trained, saved and exported to Hugging Face in that job."""


def _hf_calls(world: int, folder) -> list[tuple]:
    cases = HF_EXPORTS[world]
    return [(f"hf {m} {s} {o}", export_round, (m, s, o, str(folder / f"hf-{m}-{world}")), {}) for m, s, o in cases]


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saved2(folder) -> list[dict]:
    """40 steps of ddp and of zero3, each saving at step 20 (inside epoch 1)."""
    calls = [(s, train, (s, 40, str(folder / s)), {"save_at": 20}) for s in ("ddp", "zero3")]
    return spawn(each_call, 2, (calls + _hf_calls(2, folder),), timeout_s=180)


@pytest.fixture(scope="module")
def saved4(folder) -> list[dict]:
    """6 steps of hybrid saving at step 4, and 20 steps of zero3 on 4 ranks saving at the end."""
    calls = [
        ("hybrid", train, ("hybrid", 6, str(folder / "hybrid")), {"save_at": 4, "options": HYBRID}),
        ("zero3", train, ("zero3", 20, str(folder / "zero3-4")), {"save_at": 20}),
    ]
    return spawn(each_call, 4, (calls + _hf_calls(4, folder),), timeout_s=240)


@pytest.fixture(scope="module")
def resumed2(folder, saved2, saved4) -> list[dict]:
    """Fresh jobs: ddp and zero3 load their step-20 checkpoints and train to 40; zero3 loads the 4 ranks' save."""
    calls = [(s, train, (s, 40, str(folder / s)), {"load": True}) for s in ("ddp", "zero3")]
    calls.append(("zero3 from 4", train, ("zero3", 20, str(folder / "zero3-4")), {"load": True}))
    return spawn(each_call, 2, (calls,), timeout_s=180)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_resume_in_a_fresh_job_is_bitwise_exact(tmp_path, saved2, resumed2, strategy):
    """40 steps in one job equal 20 steps, a save (inside epoch 1), then a fresh job that loads and trains 20."""
    whole = [results[strategy] for results in saved2]
    resumed = [results[strategy] for results in resumed2]
    for rank in range(2):
        a, b = whole[rank], resumed[rank]
        assert b["resumed_at"] == (20, 1)  # 12 steps per epoch: 8 of epoch 1's 12 batches were trained
        assert b["batches"] == a["batches"][20:]  # each rank reads exactly the batches it had not trained
        assert _equal(a["params"], b["params"]), f"rank {rank}: parameters differ after the resume"
        assert _equal(a["optim"], b["optim"]) and a["lr"] == b["lr"]
    assert not _equal(whole[0]["params"], train("single", 0, str(tmp_path / "none"))["params"])  # it trained
    assert not alive(child_pids())


def test_hybrid_with_ddp_stages_resumes_bitwise(folder, saved4):
    """DDP replicas of GPipe stages: the resumed job's first step must round like any other (the stage's metadata
    inference, on its first batch, must not leave DDP's reducer synchronising the first micro-batch early)."""
    whole = [results["hybrid"] for results in saved4]
    resumed = spawn(
        each_call,
        4,
        ([("hybrid", train, ("hybrid", 6, str(folder / "hybrid")), {"load": True, "options": HYBRID})],),
        timeout_s=180,
    )
    for rank, (a, b) in enumerate(zip(whole, (results["hybrid"] for results in resumed))):
        assert b["resumed_at"][0] == 4 and b["batches"] == a["batches"][4:]
        assert _equal(a["params"], b["params"]), f"rank {rank}: parameters differ after the resume"


def test_zero3_checkpoint_of_4_ranks_loads_onto_2_and_exports(folder, saved4, resumed2):
    tmp_path = folder / "zero3-4"
    saved = [results["zero3"] for results in saved4]
    loaded = [results["zero3 from 4"] for results in resumed2]
    for rank in range(2):
        assert _equal(saved[0]["params"], loaded[rank]["params"])
        assert _equal(saved[0]["optim"], loaded[rank]["optim"]) and saved[0]["lr"] == loaded[rank]["lr"]
    info = export(tmp_path, tmp_path / "model.pt")
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert info["step"] == 20 and _equal(plain, saved[0]["params"])
    dropout_model().load_state_dict(plain)


@pytest.mark.parametrize("world, case", [(w, c) for w, cases in HF_EXPORTS.items() for c in cases])
def test_hf_export_of_a_layout_loads_with_from_pretrained_and_into_any_layout(saved2, saved4, world, case):
    """A transformers Llama and a Mixtral trained under zero3 x tp (world 4) and a Mixtral under ep (world 2), exported
    with --format hf: from_pretrained gives the trained model's logits; load_weights of the export under ddp, zero3 and
    the layout it was trained in gives its tensors on every rank."""
    model, strategy, options = case
    every = [results[f"hf {model} {strategy} {options}"] for results in (saved4 if world == 4 else saved2)]
    assert all("error" not in r for r in every), every[0].get("error")
    trained = every[0]["trained"]
    for rank, result in enumerate(every):
        for layout, state in result["loaded"].items():
            assert _equal(state, trained), f"rank {rank}: the export loaded under {layout} differs"
    same_as_pretrained(every[0]["out"], SPECS[model].build, trained)
