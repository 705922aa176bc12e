"""Ranks that may leave (launcher/leaving.py, launcher/agent.py): the contract's pieces, then three launched jobs.

A: ``--max-restarts 2``, leavers 1 and 2: rank 0 dies in attempt 0 and the whole job restarts as before; in
attempt 1 rank 1 is SIGKILLed and restarted alone (``PARATRAIN_REJOIN=1``) and finishes, rank 2 then raises with no
restart left and is gone; rank 0 reads ``back`` and ``gone`` from the notice store; the job exits 0. B: no restarts,
leaver 1 SIGKILLed: the job goes on and exits 0. C: a rank that did not allow leaving is SIGKILLed: the job stops as any
failure does, and the leaver stopped with it is not reported as leaving. D: SIGTERM or SIGKILL of the launcher ends a
replacement too. Each launch has a hard timeout and every process's pid is checked after.
"""

import os
import signal
import subprocess
import time
from datetime import timedelta

import pytest
from helpers.cli import PARATRAIN, run_cli
from helpers.faults import check, kill_alive, pids_in, wait_for
from helpers.paths import ROOT, SCRIPTS

from paratrain.errors import ConfigError
from paratrain.launcher import leaving
from paratrain.launcher.agent import Leaves, LeavingAgent, leaving_agent
from paratrain.testing import alive

JOB = str(SCRIPTS / "leaving_job.py")
HARD_TIMEOUT_S = 90


@pytest.fixture(autouse=True)
def _no_rank_survives(tmp_path):
    """Even when a test fails, no process it started outlives it."""
    yield
    kill_alive(_pids(tmp_path))


def _pids(out) -> list[int]:
    return pids_in(out, "pid-*")


def _launch(out, *flags: str, job: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return run_cli("run", *flags, JOB, str(out), "--work", "3", *job, timeout=HARD_TIMEOUT_S, cwd=ROOT)


def test_allow_leaving_does_nothing_outside_paratrain_run(monkeypatch):
    monkeypatch.delenv(leaving.LEAVE_DIR_VAR, raising=False)
    monkeypatch.delenv(leaving.NOTICE_STORE_VAR, raising=False)
    assert leaving.allow_leaving(0) is False
    assert leaving.notice_store(timedelta(seconds=1)) is None
    assert leaving.rejoin_count() == 0


def test_allow_leaving_marks_this_process_of_its_rank(monkeypatch, tmp_path):
    monkeypatch.setenv(leaving.LEAVE_DIR_VAR, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv(leaving.REJOIN_VAR, "2")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert leaving.allow_leaving(3) is True
    assert os.listdir(tmp_path) == ["rank_3.3"]  # the third process of rank 3: its second replacement
    assert leaving.rejoin_count() == 2
    assert leaving.notice_key(3, 3) == "paratrain/leave/attempt_1/rank_3/3"
    with pytest.raises(ConfigError, match="rank 3"):
        leaving.allow_leaving(1)


def test_the_closing_line_says_who_left_and_who_came_back():
    leaves = Leaves("unused")
    assert leaves.summary() is None
    for rank, back in [(1, True), (2, False), (3, True), (3, False), (4, True), (4, True)]:
        leaves.record(rank, back)
    assert leaves.summary() == (
        "rank 1 left and came back; rank 2 left for good; rank 3 left for good after coming "
        "back once; rank 4 left and came back 2 times"
    )


def test_torchrun_builds_the_leaving_agent_only_inside_the_block(monkeypatch):
    from torch.distributed.elastic.agent.server.local_elastic_agent import (
        LocalElasticAgent,
    )
    from torch.distributed.launcher import api

    monkeypatch.delenv(leaving.LEAVE_DIR_VAR, raising=False)
    with leaving_agent() as leaves:
        assert leaves is not None and api.LocalElasticAgent.func is LeavingAgent  # type: ignore[attr-defined]
        assert os.environ[leaving.LEAVE_DIR_VAR] == leaves.folder and os.path.isdir(leaves.folder)
    assert api.LocalElasticAgent is LocalElasticAgent
    assert leaving.LEAVE_DIR_VAR not in os.environ and not os.path.exists(leaves.folder)


@pytest.mark.launched
def test_a_leaver_comes_back_once_then_one_leaves_for_good(tmp_path):
    res = _launch(
        tmp_path,
        "-n",
        "3",
        "--max-restarts",
        "2",  # attempt 0: rank 0 (no leaver) dies, the job restarts
        job=(
            "--leave",
            "1,2",
            "--die",
            "0@0.3,1@0.5#1",
            "--fail",
            "2@1.5#1",
            "--fail-after",
            "1",
            "--notice",
            "1:1,2:1",
        ),
    )
    why = res.stderr
    pids = _pids(tmp_path)
    assert res.returncode == 0, why
    assert why.count("paratrain: rank 1 left the job") == 1, why
    assert "(killed by SIGKILL); restarting it alone (restart 2 of 2)" in why
    assert why.count("paratrain: rank 2 left the job") == 1, why
    assert "RuntimeError: planted failure of rank 2); the job goes on without it" in why
    assert "traceback of rank 2:" in why and why.count("Traceback") == 1, why
    assert why.rstrip().endswith("paratrain run: rank 1 left and came back; rank 2 left for good"), why
    done = {p.name: p.read_text() for p in tmp_path.glob("done-*")}
    finished = {name for name, attempt in done.items() if attempt == "1"}  # rank 1's replacement saw PARATRAIN_REJOIN=1
    # attempt 0's leavers may end their work before rank 0's death stops them, as the death lands
    assert finished == {"done-0-0", "done-1-1"} and set(done) - finished <= {"done-1-0", "done-2-0"}, (done, why)
    assert (tmp_path / "notice-1-1").read_bytes() == b"back" and (tmp_path / "notice-2-1").read_bytes() == b"gone"
    assert len(pids) == 7 and not alive(pids), pids  # 3 in attempt 0, 3 + a replacement in attempt 1


@pytest.mark.launched
def test_without_restarts_a_killed_leaver_leaves_and_the_job_succeeds(tmp_path):
    res = _launch(tmp_path, "-n", "2", job=("--leave", "1", "--die", "1@0.5", "--notice", "1:1"))
    why = res.stderr
    assert res.returncode == 0, why
    assert why.count("rank 1") == 3, why  # the report's first two lines and the closing line
    assert "paratrain: rank 1 left the job on" in why and "(killed by SIGKILL); the job goes on without it" in why
    assert why.rstrip().endswith("paratrain run: rank 1 left for good"), why
    assert sorted(p.name for p in tmp_path.glob("done-*")) == ["done-0-0"], why
    assert (tmp_path / "notice-1-1").read_bytes() == b"gone"
    assert not alive(_pids(tmp_path))


@pytest.mark.launched
def test_a_rank_that_did_not_allow_leaving_stops_the_job_as_before(tmp_path):
    res = _launch(tmp_path, "-n", "2", job=("--leave", "0", "--die", "1@0.5", "--work", "30"))
    check(
        "job: a rank that may not leave is killed beside one that may",
        rc=res.returncode,
        expect_rc=1,
        stderr=res.stderr,
        kind="report",
        lines=None,
        pids=_pids(tmp_path),
        words=["paratrain: rank 1 failed", "killed by SIGKILL", "rank 0 stopped by the launcher"],
    )
    assert "left" not in res.stderr and res.stderr.count("paratrain: rank") == 1, res.stderr
    assert not list(tmp_path.glob("done-*")), res.stderr


@pytest.mark.launched
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGKILL, -9)])
def test_stopping_the_launcher_stops_a_replacement_too(tmp_path, sig, code):
    proc = subprocess.Popen(
        [
            *PARATRAIN,
            "run",
            "-n",
            "2",
            "--max-restarts",
            "1",
            JOB,
            str(tmp_path),
            "--work",
            "60",
            "--leave",
            "1",
            "--die",
            "1@0.5",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        if not wait_for([tmp_path / "pid-0-1-1"], 60):
            pytest.fail("no replacement started")
        time.sleep(0.5)  # the replacement's own pid file is written: it runs the script
        sent = time.monotonic()
        proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=60)
        took = time.monotonic() - sent
    finally:
        proc.kill()
    pids = _pids(tmp_path)
    deadline = time.monotonic() + 10
    while alive(pids) and time.monotonic() < deadline:  # SIGKILL: the kernel ends the workers, a moment later
        time.sleep(0.1)
    assert proc.returncode == code, stderr
    assert len(pids) == 3 and not alive(pids), pids
    assert took < 10, f"{took:.1f} s to stop: a worker outlived SIGTERM until the grace period's SIGKILL"
    if sig == signal.SIGTERM:
        assert "paratrain: interrupted (SIGTERM), 2 ranks stopped in" in stderr, stderr
