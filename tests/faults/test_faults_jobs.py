"""Faults inside launched jobs (``paratrain run -n 2``): signals, errors raised in the ranks, ranks that disagree,
wait on each other or leave early, API misuse, and a rendezvous without its other node.

Every case asserts its outcome class (one line or one report, exit code, bounded time, no process left).
Launches are the expensive part (3–10 s each on two busy cores), so there are nine: the API-misuse job checks
twenty-one mistakes in one launch. Each subprocess has a hard timeout and every rank's pid is checked after.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from helpers.cli import PARATRAIN, run_cli
from helpers.faults import check, kill_alive, pids_in, split_hang_report, wait_for
from helpers.paths import ROOT, SCRIPTS

from paratrain.testing import alive

pytestmark = pytest.mark.launched  # every test here starts processes

JOB = str(SCRIPTS / "fault_job.py")
HARD_TIMEOUT_S = 90


@pytest.fixture(autouse=True)
def _no_rank_survives(tmp_path):
    """Even when a test fails, no rank it started outlives it."""
    yield
    kill_alive(_pids(tmp_path))


def _pids(out) -> list[int]:
    return pids_in(out, "*.pid")


def _env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(SCRIPTS), os.environ.get("PYTHONPATH", "")]), **extra}


def _launch(case: str, out, *flags: str, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.monotonic()
    res = run_cli("run", "-n", "2", *flags, JOB, case, str(out), timeout=HARD_TIMEOUT_S, env=_env(**env), cwd=ROOT)
    return res, time.monotonic() - start


def _start_sleeping_job(out, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [*PARATRAIN, "run", "-n", "2", *flags, JOB, "sleep", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        cwd=ROOT,
    )
    if not wait_for([out / "ready-0", out / "ready-1"], 60):
        proc.kill()
        pytest.fail(f"the job did not start: {proc.communicate(timeout=10)}")
    return proc


@pytest.mark.parametrize("program", [(), ("--no-python", sys.executable)], ids=["script", "no-python"])
def test_sigkill_of_the_launcher_leaves_no_worker(tmp_path, program):
    proc = _start_sleeping_job(tmp_path, *program)  # --no-python: python itself is the program
    pids = _pids(tmp_path)
    proc.kill()
    proc.wait(timeout=10)
    killed = time.monotonic()
    while alive(pids) and time.monotonic() - killed < 10:
        time.sleep(0.1)
    gone_after = time.monotonic() - killed
    check(
        "job: SIGKILL of paratrain run",
        rc=-9,
        expect_rc=-9,
        stderr="(killed)",
        kind="killed",
        lines=None,
        seconds=gone_after,
        max_s=5,
        pids=pids,
    )


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_ctrl_c_and_sigterm_stop_every_rank_in_one_line(tmp_path, sig, code):
    """SIGTERM is a preemption: a job without a checkpoint directory says, once, that it stops without a save."""
    proc = _start_sleeping_job(tmp_path)
    pids = _pids(tmp_path)
    sent = time.monotonic()
    proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=60)
    check(
        f"job: {sig.name} of paratrain run",
        rc=proc.returncode,
        expect_rc=code,
        stderr=stderr,
        kind="interrupted",
        words=[f"paratrain: interrupted ({sig.name}), 2 ranks stopped in"],
        lines=1 if sig == signal.SIGINT else 2,
        seconds=time.monotonic() - sent,
        max_s=35,
        pids=pids,
    )
    if sig == signal.SIGTERM:
        assert stderr.startswith(
            "paratrain: warning: asked to stop (SIGTERM or SIGUSR1) but the job has no checkpoint directory"
        ), stderr


def test_a_user_exception_is_one_report_with_one_traceback(tmp_path):
    res, _ = _launch("user_error", tmp_path)
    check(
        "job: user exception on every rank",
        rc=res.returncode,
        expect_rc=1,
        stderr=res.stderr,
        kind="report",
        lines=None,
        words=["paratrain: rank ", "failed", "ValueError: planted user error"],
        pids=_pids(tmp_path),
    )
    assert res.stderr.count("Traceback") == 1 and res.stderr.startswith("paratrain: rank "), res.stderr


def test_ranks_that_disagree_are_refused_at_construction_in_one_line(tmp_path):
    res, _ = _launch("disagree", tmp_path)
    check(
        "job: rank 0 ddp, rank 1 zero3",
        rc=res.returncode,
        expect_rc=1,
        stderr=res.stderr,
        words=["the ranks of this job disagree: strategy: 'ddp", "on rank 0, 'zero3", "on rank 1"],
        pids=_pids(tmp_path),
    )


def test_a_collective_only_one_rank_calls_speaks_while_it_waits_and_names_the_calls(tmp_path):
    for _ in range(2):  # the two ranks' equal timeouts race; a rare exit abort of gloo's gets one more try
        res, seconds = _launch("mismatch", tmp_path)
        stderr, report = split_hang_report(res.stderr)
        lines = stderr.strip().splitlines()
        if "terminate called" not in res.stderr:
            break
    waits = [line for line in lines if "has waited" in line]
    # each wait report, from either rank (both wait: rank 0 in par.mean, rank 1 in par.close), names both calls
    assert waits and all(
        "par.mean #1 (fault_job.py:" in line and "par.close #1 (fault_job.py:" in line for line in waits
    ), res.stderr
    # Both ranks wait with the same timeout: whichever gives up first says the calls did not match (rank 0 in
    # par.mean, or rank 1 in par.close), or rank 1 leaves and rank 0 names it as the rank that left first. Either
    # way the one line names both calls.
    check(
        "job: only rank 0 calls par.mean",
        rc=res.returncode,
        expect_rc=1,
        stderr=stderr,
        kind="wait report",
        lines=len(waits) + 1,
        words=["par.mean #1 (fault_job.py:", "par.close #1"],
        seconds=seconds,
        max_s=60,
        pids=_pids(tmp_path),
    )
    last = lines[-1]
    assert "made different paratrain calls" in last or "rank 1 left the job first" in last, res.stderr
    # and the flight recorder's report: rank 0's all-reduce against rank 1's barrier, at the same sequence number
    assert any("all_reduce" in line for line in report) and any("barrier" in line for line in report), res.stderr


def test_the_rank_that_left_first_is_named(tmp_path):
    res, _ = _launch("exit_early", tmp_path)
    stderr, report = split_hang_report(res.stderr)
    check(
        "job: rank 1 calls sys.exit(0) early",
        rc=res.returncode,
        expect_rc=1,
        stderr=stderr,
        words=["rank 1 left the job first", "while rank 0 was in par.mean #1"],
        pids=_pids(tmp_path),
    )
    assert any("rank 0 entered it, rank 1 never did" in line for line in report), res.stderr


def test_api_misuse_inside_a_job_is_one_paratrain_error_each(tmp_path):
    res, _ = _launch("misuse", tmp_path)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    per_rank = [(tmp_path / f"misuse-{r}.txt").read_text().splitlines() for r in range(2)]
    assert [line.split("\t")[:2] for line in per_rank[0]] == [line.split("\t")[:2] for line in per_rank[1]]
    assert len(per_rank[0]) == 22
    for line in per_rank[0]:
        case, kind, message = line.split("\t")
        check(
            f"job API: {case}",
            rc=2 if kind.startswith("paratrain.errors.") else 0,
            stderr=message,
            words=[] if "(MULTI-LINE)" not in message else ["<one line>"],
        )
    assert not alive(_pids(tmp_path))


def test_a_rendezvous_without_its_other_node_speaks_and_ends(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res, seconds = _launch(
        "user_error",
        tmp_path,
        "--nnodes",
        "2",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(port),
        "--rdzv-timeout",
        "6",
        PARATRAIN_RDZV_REPORT_S="2",
    )
    lines = res.stderr.strip().splitlines()
    waits = [line for line in lines if "waiting for the other nodes" in line]
    assert waits and "1 of 2 joined (node 0 on " in waits[0] and "s left" in waits[0], res.stderr
    check(
        "job: --nnodes 2 without the other node",
        rc=res.returncode,
        expect_rc=2,
        stderr=res.stderr,
        kind="wait report",
        lines=len(lines),
        words=["joined the rendezvous", "within 6 s"],
        seconds=seconds,
        max_s=45,
    )
    assert lines[-1].startswith("paratrain: error: ") and len(lines) == len(waits) + 1 + sum(
        "reaches" in line or "loopback" in line for line in lines
    ), res.stderr
