"""Checkpoints across processes: bitwise-exact resume (ddp, zero3, hybrid with DDP stages), resharding onto another
world size, export."""
import functools

import pytest
import torch
from helpers.checkpoint_workers import dropout_model, train

from paratrain.checkpoint import export
from paratrain.testing import alive, child_pids, spawn

pytestmark = pytest.mark.launched  # every test here starts processes


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_resume_in_a_fresh_job_is_bitwise_exact(tmp_path, strategy):
    """40 steps in one job equal 20 steps, a save (inside epoch 1), then a fresh job that loads and trains 20."""
    whole = spawn(functools.partial(train, save_at=20), 2, (strategy, 40, str(tmp_path)), timeout_s=180)
    resumed = spawn(functools.partial(train, load=True), 2, (strategy, 40, str(tmp_path)), timeout_s=180)
    for rank in range(2):
        a, b = whole[rank], resumed[rank]
        assert b["resumed_at"] == (20, 1)  # 12 steps per epoch: 8 of epoch 1's 12 batches were trained
        assert b["batches"] == a["batches"][20:]  # each rank reads exactly the batches it had not trained
        assert _equal(a["params"], b["params"]), f"rank {rank}: parameters differ after the resume"
        assert _equal(a["optim"], b["optim"]) and a["lr"] == b["lr"]
    assert not _equal(whole[0]["params"], train("single", 0, str(tmp_path / "none"))["params"])  # it trained
    assert not alive(child_pids())


def test_hybrid_with_ddp_stages_resumes_bitwise(tmp_path):
    """DDP replicas of GPipe stages: the resumed job's first step must round like any other (the stage's metadata
    inference, on its first batch, must not leave DDP's reducer synchronising the first micro-batch early)."""
    options = {"schedule": "gpipe", "microbatches": 2}
    whole = spawn(functools.partial(train, save_at=4, options=options), 4, ("hybrid", 6, str(tmp_path)),
                  timeout_s=180)
    resumed = spawn(functools.partial(train, load=True, options=options), 4, ("hybrid", 6, str(tmp_path)),
                    timeout_s=180)
    for rank, (a, b) in enumerate(zip(whole, resumed)):
        assert b["resumed_at"][0] == 4 and b["batches"] == a["batches"][4:]
        assert _equal(a["params"], b["params"]), f"rank {rank}: parameters differ after the resume"


@pytest.mark.slow
def test_zero3_checkpoint_of_4_ranks_loads_onto_2_and_exports(tmp_path):
    saved = spawn(functools.partial(train, save_at=20), 4, ("zero3", 20, str(tmp_path)), timeout_s=240)
    loaded = spawn(functools.partial(train, load=True), 2, ("zero3", 20, str(tmp_path)), timeout_s=180)
    for rank in range(2):
        assert _equal(saved[0]["params"], loaded[rank]["params"])
        assert _equal(saved[0]["optim"], loaded[rank]["optim"]) and saved[0]["lr"] == loaded[rank]["lr"]
    info = export(tmp_path, tmp_path / "model.pt")
    plain = torch.load(tmp_path / "model.pt", weights_only=True)
    assert info["step"] == 20 and _equal(plain, saved[0]["params"])
    dropout_model().load_state_dict(plain)
