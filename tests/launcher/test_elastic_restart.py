"""Elastic restart: without restarts a rank SIGKILLed mid-training ends the job fast, names the rank and leaves
nothing running; the checkpoint options reach every rank; each attempt's group keys are its own.

A SIGKILLed rank under ``--max-restarts`` that resumes from the latest checkpoint and ends bitwise equal to an
uninterrupted run is proven where the restart meets more than one kind of save: tests/distributed/test_param_server.py
(the digits demo under ``ps``: a worker then the server killed, with blocking and with asynchronous saves, a save in
flight lost) and tests/distributed/test_expert_parallel.py (zero3 x ep=2, every rank writing its shards)."""

import os
import subprocess

import pytest
from helpers.faults import watch_stderr

from paratrain.launcher.torchrun import parse_args, resolve
from paratrain.testing import alive, child_pids

DEMO = ["demo", "-n", "2", "--epochs", "1"]  # 22 optimizer steps of the digits CNN


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
