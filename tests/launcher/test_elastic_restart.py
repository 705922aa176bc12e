"""Elastic restart end to end: a rank SIGKILLed mid-training, torchrun restarts the job, it resumes from the
latest checkpoint and ends bitwise equal to an uninterrupted run; without restarts it fails fast, names the rank
and leaves nothing running."""

import os
import random
import re
import subprocess

import pytest
from helpers.cli import run_cli
from helpers.faults import watch_stderr

from paratrain.launcher.torchrun import parse_args, resolve
from paratrain.testing import alive, child_pids

DEMO = ["demo", "-n", "2", "--epochs", "1"]  # 22 optimizer steps of the digits CNN


def _digest(out: str) -> str:
    found = re.search(r"final parameters sha256 ([0-9a-f]{64})", out)
    assert found, out
    return found.group(1)


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.parametrize("how", ["blocking", "async"])
def test_a_killed_rank_restarts_and_the_result_is_bitwise_equal(paratrain_cmd, tmp_path, how):
    """With asynchronous saves the kill may come while the last save is written: that save alone is lost (the
    job resumes from the one before) and the result is the same, bit for bit."""
    step, rank = random.randint(1, 21), random.randint(0, 1)
    clean = run_cli(*DEMO, timeout=180)
    assert clean.returncode == 0, clean.stderr
    killed = run_cli(
        *DEMO,
        "--checkpoint-dir",
        str(tmp_path),
        "--checkpoint-every",
        "4",
        *(["--checkpoint-async"] if how == "async" else []),
        "--max-restarts",
        "1",
        "--fail-at-step",
        str(step),
        "--fail-rank",
        str(rank),
        timeout=240,
    )
    why = f"killed rank {rank} after step {step}\n{killed.stderr[-3000:]}"
    assert killed.returncode == 0, why
    assert f"fault injection: SIGKILL rank {rank} after step {step}" in killed.stderr, why
    last = (step - 1) // 4 * 4  # a save due after step k is written before step k + 1 begins
    resumed = re.search(r"resumed from .*/step-(\d{8})", killed.stdout)
    if how == "blocking" or last == 0:
        assert (int(resumed.group(1)) if resumed else 0) == last, why
    else:  # published once written: the save of `last` may still have been in flight
        assert resumed is None or int(resumed.group(1)) in (last, last - 4), why
    assert _digest(killed.stdout) == _digest(clean.stdout), why


@pytest.mark.launched
def test_without_restarts_a_killed_rank_ends_the_job_within_seconds(paratrain_cmd, tmp_path):
    proc = subprocess.Popen(
        [*paratrain_cmd, *DEMO, "--fail-at-step", "3", "--fail-rank", "1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    job = watch_stderr(proc, lambda line: "fault injection" in line, 180, on_mark=lambda: child_pids(proc.pid))
    stderr, workers = job.stderr, job.at_mark
    assert job.rc == 1 and job.marked_at is not None, stderr
    assert job.ended - job.marked_at < 10, f"the job took {job.ended - job.marked_at:.1f} s to end"
    assert "paratrain: rank 1 failed" in stderr and "killed by SIGKILL" in stderr, stderr
    assert len(workers) == 2 and not alive(workers)  # type: ignore[arg-type]


def test_run_hands_checkpoint_options_to_every_rank(monkeypatch, tmp_path):
    for key in (
        "PARATRAIN_CHECKPOINT_DIR",
        "PARATRAIN_CHECKPOINT_EVERY",
        "PARATRAIN_RESUME",
        "PARATRAIN_CHECKPOINT_ASYNC",
    ):
        monkeypatch.setenv(key, "")  # recorded, so what resolve() sets is undone after the test
        monkeypatch.delenv(key)
    script = str(tmp_path / "train.py")
    open(script, "w").close()
    resolve(
        parse_args(
            ["-n", "2", "--checkpoint-dir", "ck", "--checkpoint-every", "50", "--checkpoint-async", "--resume", script]
        )
    )
    assert os.environ["PARATRAIN_CHECKPOINT_DIR"] == os.path.abspath("ck")
    assert os.environ["PARATRAIN_CHECKPOINT_EVERY"] == "50" and os.environ["PARATRAIN_RESUME"] == "1"
    from paratrain.checkpoint import CheckpointConfig

    config = CheckpointConfig.of(None)
    assert (config.dir, config.every, config.should_resume(), config.async_save) == (
        os.path.abspath("ck"),
        50,
        True,
        True,
    )


def test_each_restart_attempt_starts_its_group_on_keys_of_its_own(monkeypatch):
    """torch 2.11 hands restarted workers the launcher's store with the dead attempt's keys in it (its gloo ranks then
    dial dead addresses): paratrain's group keys live under the attempt's prefix, whatever torch does."""
    from datetime import timedelta

    import torch.distributed as dist

    from paratrain.distributed.process_group import attempt_store

    shared = dist.HashStore()  # the launcher's store, the same object for every attempt
    monkeypatch.setattr(dist, "rendezvous", lambda url, **kw: iter([(shared, 0, 1)]))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    attempt_store(timedelta(seconds=5)).set("rank_1", "address of a rank that died")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert not attempt_store(timedelta(seconds=5)).check(["rank_1"])
