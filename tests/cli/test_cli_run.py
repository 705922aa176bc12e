"""End-to-end ``paratrain run``: plain torchrun scripts, fail-fast, bad input — each rank writes files we check."""

import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.paths import SCRIPTS

from paratrain.testing import alive

pytestmark = pytest.mark.launched  # every test here starts processes


def _run(cmd: list[str], timeout: float = 60, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def test_plain_torchrun_script_runs_unchanged(paratrain_cmd, tmp_path):
    """Its own flags too: a --tf after the script is the script's (a torch job), not paratrain's."""
    res = _run([*paratrain_cmd, "run", "-n", "2", str(SCRIPTS / "plain_torchrun.py"), str(tmp_path), "--tf"])
    assert res.returncode == 0, res.stderr
    lines = sorted((tmp_path / f"rank{r}.txt").read_text().split() for r in range(2))
    # rank, world, local rank, all-reduced sum, threads per process (2 cores / 2 processes), __name__, its flags
    assert [line[:4] for line in lines] == [["0", "2", "0", "3"], ["1", "2", "1", "3"]]
    assert all(line[5:] == ["__main__", "--tf"] for line in lines)
    assert {line[4] for line in lines} == {str(max(1, len(os.sched_getaffinity(0)) // 2))}


def test_underscore_flags_and_module_entry_point(paratrain_cmd, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(SCRIPTS)}
    res = _run([*paratrain_cmd, "run", "--nproc_per_node=2", "-m", "plain_torchrun", str(tmp_path)], env=env)
    assert res.returncode == 0, res.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.txt", "rank1.txt"]


@pytest.mark.parametrize("how", ["raise", "kill", "abort"])
def test_failing_rank_ends_the_job_fast_and_names_the_rank(paratrain_cmd, tmp_path, how):
    res = _run(
        [
            *paratrain_cmd,
            "run",
            "-n",
            "2",
            str(SCRIPTS / "failing_job.py"),
            "--fail-rank",
            "1",
            "--fail-step",
            "5",
            "--how",
            how,
            "--pid-dir",
            str(tmp_path),
        ],
        timeout=30,
    )
    elapsed = time.time() - float((tmp_path / "failed_at").read_text())  # from the failure, not the start-up
    assert res.returncode != 0
    assert elapsed < 10, f"the job took {elapsed:.1f} s to end after rank 1 failed"
    assert "paratrain: rank 1 failed" in res.stderr, res.stderr[-3000:]
    report = res.stderr[res.stderr.index("paratrain: rank 1 failed") :]
    if how == "raise":
        assert "(exit code 1: " in report and "RuntimeError: planted failure at step 5" in report
        assert "worker.py" not in report  # the launcher's own frames are hidden
    else:
        assert f"killed by SIG{'KILL' if how == 'kill' else 'ABRT'}" in report
    assert "Fatal Python error" not in res.stderr  # no faulthandler dump of every thread unless --debug
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 2 and not alive(pids)


def test_a_finished_script_is_a_success_even_when_its_exit_crashes_or_hangs(paratrain_cmd, tmp_path):
    """Both ranks return; the interpreter's teardown would then abort them, and their atexit handlers never return."""
    env = {**os.environ, "PARATRAIN_EXIT_TIMEOUT": "2"}
    res = _run(
        [
            *paratrain_cmd,
            "run",
            "-n",
            "2",
            str(SCRIPTS / "exit_job.py"),
            "--end",
            "stuck-atexit",
            "--crash-at-teardown",
            "--out",
            str(tmp_path),
        ],
        timeout=45,
        env=env,
    )
    assert res.returncode == 0, res.stderr
    for rank in range(2):
        assert f"paratrain: rank {rank} finished, then stuck at exit for 2 s; ended it" in res.stderr
        assert (tmp_path / f"rank{rank}.atexit").exists()  # the script's own atexit handlers ran
        assert (tmp_path / f"rank{rank}.unclosed").read_text() == "written\n"  # a file it left open was flushed
    pids = [int((tmp_path / f"rank{rank}.done").read_text()) for rank in range(2)]
    assert not alive(pids)


def _one_line_error(res: subprocess.CompletedProcess, words: str) -> None:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert words in lines[0]


def test_bad_input_gives_one_line_errors(paratrain_cmd, tmp_path):
    script = str(SCRIPTS / "plain_torchrun.py")
    cases = [
        (["run", "-n", "0", script], "at least 1"),
        (["run", "-n", "2", str(tmp_path / "missing.py")], "not found"),
        (["run", "-m", "no_such_module_xyz"], "not found"),
        (["run", "--no-such-flag", script], "unrecognized"),
        (["demo", "--strategy", "nope"], "unknown strategy 'nope'; choose one of"),
        (["demo", "--strategy", "dp", "-n", "2"], "use strategy 'ddp'"),
        (["demo", "--strategy", "hybrid", "-n", "2"], "launch 4 processes"),
        (
            ["demo", "--strategy", "zero3", "--tp", "3", "-n", "4"],
            "valid layouts: zero3 tp=2 (2 x 2), zero3 tp=4 (1 x 4)",
        ),
        (["demo", "--strategy", "hsdp", "--tp", "2", "-n", "4"], "does not take tp"),
    ]
    with socket.socket() as taken, ThreadPoolExecutor(4) as pool:  # each is a fresh interpreter importing torch
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cases.append(
            (
                ["run", "-n", "2", "--master-port", str(port), script, str(tmp_path)],
                f"--master-port {port} is already in use",
            )
        )
        results = list(pool.map(lambda case: _run([*paratrain_cmd, *case[0]]), cases))
    for (_, words), res in zip(cases, results):
        _one_line_error(res, words)


def test_debug_shows_the_traceback(paratrain_cmd):
    res = _run([*paratrain_cmd, "--debug", "run", "-n", "0", "x.py"])
    assert res.returncode != 0 and "Traceback" in res.stderr


def test_console_script_is_installed():
    exe = Path(sys.executable).with_name("paratrain")
    res = _run([str(exe), "--version"])
    assert res.returncode == 0 and res.stdout.startswith("paratrain ")


def test_a_paratrain_error_inside_the_ranks_ends_in_one_line(paratrain_cmd):
    res = _run([*paratrain_cmd, "run", "-n", "2", str(SCRIPTS.parent.parent / "examples" / "data_parallel_dp.py")])
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr  # once for the job, not a traceback per rank
    assert lines[0].startswith("paratrain: error: strategy 'dp' (nn.DataParallel) runs in one process")
    assert lines[0].endswith(("(ranks 0, 1)", "(rank 0)", "(rank 1)"))


def test_a_script_named_by_a_relative_path_sees_its_absolute_file(paratrain_cmd, tmp_path):
    """``__file__`` is absolute, as under python (3.9+) and torchrun: scripts find their data beside themselves."""
    (tmp_path / "where.py").write_text("import os, sys\nprint(os.path.isabs(__file__), __file__)\n")
    res = _run([*paratrain_cmd, "run", "-n", "1", "where.py"], cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", str(tmp_path / "where.py")]
