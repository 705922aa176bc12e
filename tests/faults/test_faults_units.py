"""The fault machinery's parts in one process: failure reports, rank agreement, the call watch over a real
store, the launcher's signal settings, the epoch without a step."""

import io
import json
import os
import re
import signal
import time
from contextlib import redirect_stderr
from dataclasses import asdict
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
from helpers.faults import check
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.call_watch import Call, CallWatch
from paratrain.errors import CollectiveError, RankFailedError
from paratrain.launcher.failure import format_failure, from_child_failed, own_error, trace_of
from paratrain.launcher.finish import (
    DEFAULT_EXIT_TIMEOUT_S,
    EXIT_TIMEOUT_VAR,
    exit_code,
    exit_timeout,
)
from paratrain.launcher.signals import SIGNALS_VAR, restore_worker_signals
from paratrain.rank_agreement import disagreements


def _failure(exitcode: int, trace: str | None, timestamp: int = 100):
    data = {"message": {"message": "x", "extraInfo": {"py_callstack": trace}}} if trace else {}
    return SimpleNamespace(exitcode=exitcode, timestamp=timestamp, message=trace or "", pid=1, error_file_data=data)


def test_a_sigabrt_is_not_blamed_on_memory():
    report = format_failure(RankFailedError(rank=1, exitcode=-6, host="h", pid=2, traceback=None))
    check(
        "report: rank aborted by SIGABRT",
        rc=1,
        expect_rc=1,
        stderr=report,
        kind="report",
        lines=3,
        words=["killed by SIGABRT", "aborted inside torch's C++ code", "TORCH_DISTRIBUTED_DEBUG=DETAIL"],
    )
    assert "out of memory" not in report


def test_a_paratrain_error_is_one_line_with_every_rank_that_raised_it():
    trace = 'Traceback (most recent call last):\n  File "t.py", line 1\nparatrain.errors.ConfigError: bad thing\n'
    err = from_child_failed(SimpleNamespace(failures={1: _failure(1, trace), 0: _failure(1, trace)}))
    assert format_failure(err) == "paratrain: error: bad thing (ranks 0, 1)"


def test_the_root_cause_is_a_ranks_own_error_not_the_peer_that_lost_it():
    lost = "Traceback …\nRuntimeError: Connection closed by peer [127.0.0.1]:1234\n"
    own = "Traceback …\nValueError: the real cause\n"
    err = from_child_failed(SimpleNamespace(failures={0: _failure(1, lost), 1: _failure(1, own)}))
    assert err.rank == 1
    killed = from_child_failed(SimpleNamespace(failures={0: _failure(1, lost), 1: _failure(-9, None)}))
    assert killed.rank == 1
    noticed_later = {0: _failure(1, lost, timestamp=100), 1: _failure(-9, None, timestamp=101)}
    assert from_child_failed(SimpleNamespace(failures=noticed_later)).rank == 1  # stamped when the agent saw it
    left = (
        "Traceback …\nparatrain.errors.CollectiveError: rank 1 left the job first (exited 0 s ago after "
        "par.step #5 (job.py:9)) while rank 0 was in par.step #6 (job.py:9); every rank must make the same …\n"
    )
    assert from_child_failed(SimpleNamespace(failures={0: _failure(1, left), 1: _failure(1, own)})).rank == 1


def test_a_rank_the_launcher_stopped_is_not_blamed_for_the_one_that_died():
    """Rank 1 is SIGKILLed; the launcher then SIGTERMs rank 0, in the same second or the next."""
    for stopped_at in (100, 101):
        err = from_child_failed(SimpleNamespace(failures={0: _failure(-15, None, stopped_at), 1: _failure(-9, None)}))
        assert err.rank == 1 and err.exitcode == -9
    everyone = from_child_failed(SimpleNamespace(failures={1: _failure(-15, None), 0: _failure(-15, None)}))
    assert everyone.rank == 0  # a scheduler stopped the whole job: the first rank stands for it


def test_the_ranks_the_launcher_stopped_are_listed_as_stopped():
    failures = {0: _failure(-15, None, 101), 1: _failure(-9, None), 2: _failure(-15, None, 101)}
    err = from_child_failed(SimpleNamespace(failures=failures))
    assert err.rank == 1 and err.stopped == (0, 2)
    report = format_failure(err)
    assert "  ranks 0, 2 stopped by the launcher (SIGTERM) after this failure" in report.splitlines()
    one = format_failure(from_child_failed(SimpleNamespace(failures={0: _failure(-15, None), 1: _failure(-6, None)})))
    assert "  rank 0 stopped by the launcher (SIGTERM) after this failure" in one.splitlines()
    everyone = from_child_failed(SimpleNamespace(failures={1: _failure(-15, None), 0: _failure(-15, None)}))
    assert everyone.stopped == () and "stopped by the launcher" not in format_failure(everyone)


def test_a_finished_workers_exit_code_and_exit_timeout():
    assert [exit_code(c) for c in (None, 0, 3, 256 + 2)] == [0, 0, 3, 2]
    with redirect_stderr(io.StringIO()) as err:
        assert exit_code("bad input") == 1  # the interpreter prints the message and exits 1
    assert err.getvalue() == "bad input\n"
    assert exit_timeout({}) == DEFAULT_EXIT_TIMEOUT_S
    assert exit_timeout({EXIT_TIMEOUT_VAR: "2.5"}) == 2.5
    assert exit_timeout({EXIT_TIMEOUT_VAR: "never"}) == exit_timeout({EXIT_TIMEOUT_VAR: "0"}) == DEFAULT_EXIT_TIMEOUT_S


def test_disagreements_name_the_ranks_and_values():
    per_rank = [
        {"strategy": "ddp", "accumulate": "1"},
        {"strategy": "zero3", "accumulate": "1"},
        {"strategy": "ddp", "accumulate": "1"},
    ]
    assert disagreements(per_rank) == ["strategy: 'ddp' on ranks 0, 2, 'zero3' on rank 1"]
    assert disagreements(per_rank[:1] * 3) == []


def test_nodes_with_different_process_counts_agree_unless_the_layout_follows_the_node():
    """torchrun lets nodes run different numbers of processes: ranks compare the mesh they build, which for ddp
    does not depend on it and for hsdp (shard groups of one node) does."""
    from paratrain.env import ClusterEnv
    from paratrain.strategies.chosen import ChosenStrategy

    def agreed(strategy: str, per_node: int) -> dict[str, str]:
        env = ClusterEnv(world_size=8, local_world_size=per_node, launched=True)
        return ChosenStrategy(strategy, env, {}).agreed_values()

    assert disagreements([agreed("ddp", 4), agreed("ddp", 2)]) == []
    assert disagreements([agreed("hsdp", 4), agreed("hsdp", 2)]) == [
        "mesh: \"{'replicate': 2, 'shard': 4}\" on rank 0, \"{'replicate': 4, 'shard': 2}\" on rank 1"
    ]


@pytest.fixture
def store(monkeypatch):
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(server.port))
    yield server


def _publish(store, rank: int, call: Call, watch: int = 1) -> None:
    """``rank``'s state as its ``watch``-th CallWatch (its ``watch``-th Parallel) publishes it."""
    store.set(f"paratrain/calls/0/{watch}/{rank}", json.dumps(asdict(call)))


def test_a_rank_alone_in_work_every_rank_must_do_fails_at_once_naming_the_peer_that_went_on(store):
    watch = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    for _ in range(4):
        with watch.call("par.step"):
            pass
    _publish(store, 1, Call("par.step", 5, "train.py:30", time.time(), active=True))
    started = time.monotonic()
    with pytest.raises(
        CollectiveError,
        match=r"rank 0 is alone in the model's forward \(test_faults_units.py:\d+\): "
        r"rank 1 went on to par.step #5 \(train.py:30\); evaluate everywhere",
    ):
        watch.meet("the model's forward", "evaluate everywhere")
    assert time.monotonic() - started < 5  # a bound that catches a hang
    watch.close()


def test_a_rank_that_runs_more_forwards_than_a_peer_is_told_so_not_that_it_is_alone(store):
    """Both ranks met at two forwards (an evaluation on every rank), rank 0 runs a third: uneven, not alone."""
    watch = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    for nth in (1, 2):  # rank 1 is at each meeting first
        store.add(f"paratrain/calls/0/1/meet/the model's forward/{nth}", 1)
        watch.meet("the model's forward", "evaluate everywhere", "even them out")
    _publish(store, 1, Call("par.mean", 1, "eval.py:9", time.time(), active=True))
    with pytest.raises(
        CollectiveError,
        match=r"^rank 0 ran the model's forward more times than rank 1: rank 1 ran it 2 times and went on to "
        r"par.mean #1 \(eval.py:9\), rank 0 is in its #3 \(test_faults_units.py:\d+\); even them out$",
    ):
        watch.meet("the model's forward", "evaluate everywhere", "even them out")
    watch.close()


def test_ranks_that_all_come_meet_and_a_peer_still_behind_is_waited_for(store):
    import threading

    watch = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    with watch.call("par.step"):
        pass
    _publish(store, 1, Call("par.step", 1, "train.py:30", time.time(), active=True))  # finishing the same step

    def arrive() -> None:  # rank 1 comes to the same meeting a little later
        time.sleep(0.3)
        if store.add("paratrain/calls/0/1/meet/par.save/1", 1) >= 2:
            store.set("paratrain/calls/0/1/meet/par.save/1/all", "1")

    peer = threading.Thread(target=arrive)
    peer.start()
    with watch.call("par.save", meet="every rank must call it"):
        pass
    peer.join()
    watch.close()


def test_a_peer_that_completes_the_meeting_and_goes_on_while_a_rank_looks_is_not_taken_for_one_that_left(store):
    """Rank 1 arrives, completes the meeting and publishes its next call between rank 0's look at the meeting and
    its read of the peers: rank 0 has met it (the race a slow machine hits), and goes on."""
    watch = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    read_peers = watch._read_all

    def peer_meets_and_goes_on_first(*args):
        if store.add("paratrain/calls/0/1/meet/par.save/1", 1) >= 2:
            store.set("paratrain/calls/0/1/meet/par.save/1/all", "1")
        _publish(store, 1, Call("par.step", 1, "train.py:31", time.time(), active=True))
        watch._read_all = read_peers
        return read_peers(*args)

    watch._read_all = peer_meets_and_goes_on_first
    with watch.call("par.save", meet="every rank must call it"):
        pass
    watch.close()


def test_a_peer_state_from_an_earlier_parallel_is_not_read(store):
    """A test job runs case after case, each with a Parallel of its own: rank 1's first watch exited; rank 0's
    second watch meets rank 1's second, not the first's state."""
    first = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    first.close()
    _publish(store, 1, Call("par.close", 1, "cases.py:9", time.time(), exited=True), watch=1)
    second = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    store.set("paratrain/calls/0/2/meet/par.load/1", "1")  # rank 1's second watch already counted itself in
    with second.call("par.load", meet="every rank must call it"):
        pass
    second.close()


def test_a_long_wait_names_the_rank_not_arrived_and_its_last_call(store):
    _publish(store, 1, Call("par.step", 7, "train.py:9", time.time() - 3, active=False))
    watch = CallWatch(0, 2, timeout_s=30, report_after_s=0.3)
    err = io.StringIO()
    with redirect_stderr(err), watch.call("par.mean"):
        time.sleep(1.0)
    watch.close()
    lines = err.getvalue().strip().splitlines()
    check(
        "watch: a wait past the report threshold",
        rc=1,
        expect_rc=1,
        stderr=lines[0] if lines else "",
        kind="wait report",
        words=[
            "rank 0 has waited",
            "in par.mean #1 (test_faults_units.py:",
            "for rank 1: rank 1 last called par.step #7 (train.py:9)",
            "it fails in",
        ],
    )
    assert 1 <= len(lines) <= 3


def test_a_wait_past_its_timeout_for_a_rank_that_carried_on_ends_the_job_naming_that_rank(store, tmp_path, monkeypatch):
    """Rank 1 caught a paratrain error and carried on outside any call: rank 0's wait said "it fails in 0 s" for
    ten minutes. A report period past the timeout, the watch ends the job as a failed rank, naming rank 1."""
    _publish(store, 1, Call("par.mean", 3, "train.py:9", time.time() - 3, active=False))
    watch = CallWatch(0, 2, timeout_s=0.6, report_after_s=0.2)
    ended: list[str] = []
    watch._end_job = ended.append
    with redirect_stderr(io.StringIO()), watch.call("par.step"):
        deadline = time.monotonic() + 10
        while not ended and time.monotonic() < deadline:
            time.sleep(0.05)
    watch.close()
    assert ended and re.fullmatch(
        r"rank 0 waited \d+ s in par.step #1 \(test_faults_units.py:\d+\), past its 0.6 s timeout, for rank 1: "
        r"rank 1 last called par.mean #3 \(train.py:9\), \d+ s ago, and is not in a paratrain call; ended the job "
        r"\(a rank that catches a paratrain error must stop, not carry on alone\)",
        ended[0],
    ), ended
    now = time.time()
    late = watch._waiting_line(Call("par.step", 1, "t.py:1", now - 5, active=True), {1: Call("par.mean", 3)}, now)
    assert late.endswith("; its timeout has passed") and "fails in" not in late

    # The real ending: the line recorded as the rank's error (the launcher's one-line report), then the exit.
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(os, "_exit", lambda code: ended.append(f"exit {code}"))
    with redirect_stderr(io.StringIO()):
        CallWatch._end_job(watch, "rank 0 waited 9 s in par.step #1 (t.py:1), past its 0.6 s timeout")
    assert ended[-1] == "exit 1"
    failure = SimpleNamespace(error_file_data=json.loads(error_file.read_text()))
    assert own_error(trace_of(failure)) == "rank 0 waited 9 s in par.step #1 (t.py:1), past its 0.6 s timeout"


def test_a_peer_that_exited_first_is_named_in_place_of_a_lost_connection(store):
    watch = CallWatch(0, 2, timeout_s=30, report_after_s=10)
    _publish(store, 1, Call("par.step", 3, "train.py:9", time.time(), exited=True))
    with pytest.raises(
        CollectiveError,
        match=r"rank 1 left the job first \(exited .* after par.step #3 "
        r"\(train.py:9\)\) while rank 0 was in par.barrier #1",
    ):
        with watch.call("par.barrier"):
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:555")
    with pytest.raises(ValueError, match="a user's own error"):  # anything else passes through unchanged
        with watch.call("par.step"):
            raise ValueError("a user's own error")
    watch.close()


def test_a_timeout_names_the_calls_that_did_not_match(store):
    watch = CallWatch(0, 2, timeout_s=5, report_after_s=10)
    _publish(store, 1, Call("par.close", 1, "train.py:20", time.time() - 5, active=True))
    with pytest.raises(
        CollectiveError,
        match=r"gave up on par.mean #1 .* after 5 s: the ranks made different "
        r"paratrain calls: rank 1 is in par.close #1 \(train.py:20\)",
    ):
        with watch.call("par.mean"):
            raise RuntimeError("Timed out waiting 5000ms for recv operation to complete")
    watch.close()


def test_workers_see_the_signal_settings_torchrun_would_give_them():
    env = {SIGNALS_VAR: "SIGHUP,SIGQUIT", "PARATRAIN_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGUSR1"}
    restore_worker_signals(env)
    assert env == {SIGNALS_VAR: "SIGTERM,SIGINT,SIGUSR1"}


def test_the_launcher_signal_handler_stops_the_agent_with_sigterm():
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from paratrain.errors import JobInterrupted
    from paratrain.launcher.processes import children
    from paratrain.launcher.signals import stop_signals

    args = SimpleNamespace(signals_to_handle="SIGTERM,SIGINT,SIGHUP")
    before = signal.getsignal(signal.SIGINT)  # a shell's background job starts with SIGINT ignored
    others = len(children())  # this test process's own helpers (none in a launcher), counted as ranks alike
    with pytest.raises(JobInterrupted) as info, stop_signals(args):
        assert args.signals_to_handle == "SIGHUP"
        with pytest.raises(SignalException) as inner:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        assert inner.value.sigval == signal.SIGTERM  # what the agent forwards to the workers
        raise inner.value
    assert info.value.exit_code == 130 and f"interrupted (SIGINT), {others} rank" in str(info.value)
    assert args.signals_to_handle == "SIGTERM,SIGINT,SIGHUP" and signal.getsignal(signal.SIGINT) is before


def test_an_epoch_without_an_optimizer_step_is_said_once(capsys):
    par = paratrain.Parallel("single", accumulate=4, monitor=False)
    model = torch.nn.Linear(2, 1)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loader = par.prepare(DataLoader(TensorDataset(torch.randn(4, 2)), batch_size=2))
    for _ in par.epochs(2):
        for (x,) in loader:
            with par.step(model, opt):
                par.backward(model(x).sum())
    err = capsys.readouterr().err
    check(
        "loop: an epoch that takes no optimizer step",
        rc=0,
        expect_rc=0,
        stderr=err,
        kind="warning",
        words=["paratrain: warning: epoch 0 took no optimizer step (accumulate=4"],
    )
