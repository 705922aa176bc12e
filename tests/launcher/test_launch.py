"""In-process ``paratrain.launch``: results, fail-fast, timeouts, nothing left behind."""

import time
from pathlib import Path

import pytest
from helpers.dist_workers import fail_at, rank_and_threads, sleep_forever, where_started

from paratrain import JobTimeoutError, LaunchError, RankFailedError, launch
from paratrain.testing import alive, child_pids, spawn


def _pids(d: Path) -> list[int]:
    return [int(p.read_text()) for p in d.glob("*.pid")]


@pytest.mark.launched
def test_launch_returns_each_ranks_value_with_a_torchrun_environment():
    assert launch(rank_and_threads, 2, timeout_s=60) == [(0, 2, 1), (1, 2, 1)]
    assert not alive(child_pids())


@pytest.mark.launched
@pytest.mark.parametrize("how, words", [("raise", "ValueError: planted failure at step 5"), ("kill", None)])
def test_a_failing_rank_stops_the_job_within_seconds(tmp_path, how, words):
    spawn(rank_and_threads, 2)  # the fork server is up: the bound below times the failure, not importing torch
    start = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        spawn(fail_at, 2, (1, 5, how, str(tmp_path)), timeout_s=60)
    assert time.monotonic() - start < 10
    err = info.value
    assert err.rank == 1
    assert "rank 1 failed" in str(err)
    if words:
        assert words in err.traceback and err.exitcode == 1
    else:
        assert err.exitcode == -9 and "SIGKILL" in str(err)
    assert len(_pids(tmp_path)) == 2 and not alive(_pids(tmp_path))


def test_the_summary_names_the_last_exception_not_the_last_line_of_its_message():
    wrapped = (
        'Traceback (most recent call last):\n  File "x.py", line 1, in f\nRuntimeError: assert failed\n\n'
        "The above exception was the direct cause of the following exception:\n\nTraceback (most recent call "
        'last):\n  File "y.py", line 2, in g\nRuntimeError: \n            [Stage 0] failed to run forward:\n'
        "            args: ('Tensor(torch.Size([1, 8]))',)\nkwargs: {}\n"
    )
    assert "(exit code 1: RuntimeError: [Stage 0] failed to run forward:)" in str(
        RankFailedError(rank=0, exitcode=1, host="h", pid=1, traceback=wrapped)
    )
    plain = 'Traceback (most recent call last):\n  File "x.py", line 1, in f\nValueError: bad value\n'
    assert "(exit code 1: ValueError: bad value)" in str(RankFailedError(0, 1, "h", 1, plain))
    assert "(exit code 1: something odd)" in str(RankFailedError(0, 1, "h", 1, "something odd\n"))


@pytest.mark.launched
def test_timeout_stops_every_process():
    start = time.monotonic()
    with pytest.raises(JobTimeoutError, match="within 2 s"):
        launch(sleep_forever, 2, timeout_s=2)
    assert time.monotonic() - start < 15
    assert not alive(child_pids())


@pytest.mark.launched
def test_ranks_forked_from_a_server_start_where_and_as_the_caller_is_now(tmp_path, monkeypatch):
    """testing.spawn's fork server started with the environment of its first job; each job's ranks still get the
    caller's variables and directory at the call, as spawned ranks do, and the preloaded modules."""
    spawn(rank_and_threads, 2)  # the server is up (if no test before started it)
    monkeypatch.setenv("PARATRAIN_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    assert spawn(where_started, 2, ("PARATRAIN_PROBE",)) == [("set after the server started", str(tmp_path), True)] * 2
    assert not alive(child_pids())


def test_bad_process_count():
    with pytest.raises(LaunchError, match="nprocs"):
        launch(sleep_forever, 0)


@pytest.mark.launched
def test_ranks_die_with_a_caller_that_is_killed(tmp_path):
    """SIGKILL of the launching process skips its cleanup; the kernel still stops its ranks."""
    import os
    import signal
    import subprocess
    import sys

    tests = str(Path(__file__).parents[1])
    code = (
        "import paratrain, sys; from helpers import dist_workers; "
        f"paratrain.launch(dist_workers.sleep_forever, 2, ({str(tmp_path)!r},))"
    )
    caller = subprocess.Popen(
        [sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": os.pathsep.join([tests, *sys.path])}
    )
    try:
        deadline = time.monotonic() + 60
        while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        ranks = _pids(tmp_path)
        assert len(ranks) == 2, "the ranks did not start"
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=10)
        deadline = time.monotonic() + 10
        while alive(ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(ranks)
    finally:
        caller.kill()
        for pid in alive(_pids(tmp_path)):
            os.kill(pid, signal.SIGKILL)
