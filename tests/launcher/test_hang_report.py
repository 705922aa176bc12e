"""The flight recorder's report of a stalled collective: from traces written here (unit), and read back from jobs
that hang in four ways (launched, one short job each: timeouts of 2 s, so each hang ends in seconds)."""

import os
import pickle
import signal
import time

import pytest
from helpers.cli import run_cli
from helpers.faults import kill_alive, pids_in, split_hang_report
from helpers.paths import SCRIPTS

from paratrain.hang_trace import TRACE_DIR_VAR
from paratrain.launcher.failure import collective_failure
from paratrain.launcher.hang_report import hang_report
from paratrain.testing import alive

JOB = SCRIPTS / "hang_job.py"
HARD_TIMEOUT_S = 90


def _entry(seq: int, op: str, sizes: list[list[int]], retired: bool = True, line: int = 7) -> dict:
    """One collective as torch 2.13's recorder dumps it on gloo (state stays 'scheduled')."""
    return {
        "record_id": seq - 1,
        "pg_id": 0,
        "process_group": ("0", "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"gloo:{op}",
        "time_created_ns": seq,
        "input_sizes": sizes,
        "input_dtypes": ["Float"],
        "output_sizes": sizes,
        "output_dtypes": ["Float"],
        "state": "scheduled",
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": retired,
        "timeout_ms": 3000,
        "is_p2p": False,
        "frames": [
            {"name": "all_reduce", "filename": "/x/site-packages/torch/distributed/distributed_c10d.py", "line": 1},
            {"name": "<module>", "filename": "/home/me/train.py", "line": line},
        ],
    }


def _write(folder, rank: int, entries: list[dict]) -> None:
    trace = {
        "version": "2.10",
        "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "pg_status": {},
        "entries": entries,
    }
    (folder / f"rank_{rank}").write_bytes(pickle.dumps(trace))


def test_a_rank_that_never_entered_a_collective_is_named_with_what_it_completed_last(tmp_path):
    done = [_entry(1, "all_reduce", [[3]]), _entry(2, "all_reduce", [[3]])]
    _write(tmp_path, 0, [*done, _entry(3, "all_gather", [[29]], retired=False, line=22)])
    _write(tmp_path, 1, done)
    lines = hang_report(str(tmp_path)).splitlines()
    assert lines[0].startswith(f"paratrain: flight recorder: traces of ranks 0, 1 in {tmp_path}")
    assert lines[1:] == [
        "  group default_pg #3 all_gather (sizes [[29]]): rank 0 entered it, rank 1 never did",
        "  rank 0 waits in group default_pg #3 all_gather (sizes [[29]], train.py:22)",
        "  rank 1 is in no collective; last completed group default_pg #2 all_reduce (sizes [[3]], train.py:7)",
    ]


def test_ranks_in_different_collectives_and_a_rank_that_died_without_a_trace(tmp_path):
    """torch's analyser names the op each rank made at the same sequence number; a timed-out collective that
    gloo marked done still reads as where its rank is stuck."""
    done = [_entry(1, "all_reduce", [[3]])]
    _write(tmp_path, 0, [*done, _entry(2, "all_gather", [[4]])])
    _write(tmp_path, 1, [*done, _entry(2, "all_reduce", [[4]], retired=False)])
    lines = hang_report(str(tmp_path)).splitlines()
    assert lines[1] == (
        "  group default_pg #2: the ranks disagree: all_gather (sizes [[4]]) on the others, "
        "rank 1 called all_reduce (sizes [[4]])"
    )
    assert lines[2].startswith("  rank 0 waits in group default_pg #2 all_gather")
    assert lines[3].startswith("  rank 1 waits in group default_pg #2 all_reduce")
    os.remove(tmp_path / "rank_0")
    lines = hang_report(str(tmp_path), {0: "killed by SIGABRT"}).splitlines()
    assert lines[1] == (
        "  rank 0 ended (killed by SIGABRT) and left no trace (gloo aborts a rank that is sent more than its tensor "
        "holds: sizes differ between ranks)"
    )
    assert hang_report(str(tmp_path / "none")) is None


def test_the_report_is_for_a_collective_s_failure_not_the_user_s_own_error():
    assert collective_failure(-signal.SIGABRT, None)
    assert collective_failure(1, "RuntimeError: [..unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")
    assert collective_failure(1, "paratrain.errors.CollectiveError: rank 1 left the job first (exited …)")
    assert not collective_failure(1, "ValueError: bad batch")
    assert not collective_failure(-signal.SIGKILL, None)


# ----------------------------------------------------------------------------------------------- launched jobs
def _line(text: str) -> str:
    """``hang_job.py:N``: the line of the job script that holds ``text``."""
    number = next(i for i, line in enumerate(JOB.read_text().splitlines(), 1) if text in line)
    return f"hang_job.py:{number}"


CASES = {
    "skip_forward": [
        "all_gather (sizes [[29]]): rank 0 entered it, rank 1 never did",
        f"rank 0 waits in group default_pg #12 all_gather (sizes [[29]], {_line('par.backward(model(torch.full')})",
        "rank 1 is in no collective; last completed group default_pg #11",
    ],
    "sizes": [
        "rank 0 ended (killed by SIGABRT) and left no trace (gloo aborts a rank that is sent more than its tensor",
        f"rank 1 is in no collective; last completed group default_pg #2 all_reduce (sizes [[8]], "
        f"{_line('4 if rank == 0 else 8')})",
    ],
    "loader": [
        "rank 0 entered it, rank 1 never did",
        f"rank 0 waits in group default_pg #10 broadcast (sizes [[5]], {_line('par.backward(model(x)')})",
        "rank 1 is in no collective; last completed group default_pg #9 all_reduce",
    ],
    "dcp_save": [
        "group default_pg #10 all_gather (sizes [[1]]): rank 0 entered it, rank 1 never did",
        f"rank 0 waits in group default_pg #10 all_gather (sizes [[1]], {_line('dcp.save(')})",
        "rank 1 is in no collective; last completed group default_pg #9 all_reduce",
    ],
}


@pytest.mark.launched
@pytest.mark.timeout(HARD_TIMEOUT_S + 10)
@pytest.mark.parametrize("case", CASES)
def test_a_stalled_job_reports_which_rank_waits_in_which_collective_and_which_never_entered_it(tmp_path, case):
    traces = tmp_path / "traces"
    env = {**os.environ, TRACE_DIR_VAR: str(traces)}
    start = time.monotonic()
    try:
        res = run_cli("run", "-n", "2", "--pg-timeout", "2", JOB, case, tmp_path, timeout=HARD_TIMEOUT_S, env=env)
    finally:
        kill_alive(pids_in(tmp_path, "*.pid"))
    seconds = time.monotonic() - start
    assert res.returncode == 1, res.stderr
    _, report = split_hang_report(res.stderr)
    assert report and report[0].startswith("paratrain: flight recorder: traces of rank"), res.stderr
    for words in CASES[case]:
        assert any(words in line for line in report), f"{words!r} not in\n{res.stderr}"
    assert sorted(os.listdir(traces)) == (["rank_1"] if case == "sizes" else ["rank_0", "rank_1"])
    assert seconds < 60 and not alive(pids_in(tmp_path, "*.pid"))
