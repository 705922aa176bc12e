"""Saves on preemption (paratrain.preemption): the ranks agree on a step, save there, exit 75, and resume bitwise."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import torch
from helpers.cli import PARATRAIN
from helpers.paths import SCRIPTS

from paratrain import CheckpointConfig, ConfigError
from paratrain.errors import PREEMPTED_EXIT_CODE
from paratrain.launcher.signals import MARK_VAR, marked, preempted, preemption_note
from paratrain.preemption import NOTE_VAR, SPAWNED_VAR, Note, StopSignals, caught_signals, flag_device
from paratrain.testing import alive, child_pids, spawn


def test_the_ranks_meet_only_every_k_steps_and_stop_where_any_rank_was_signalled():
    """The check is the only collective the stop adds: at every k-th optimizer step and at no other."""
    asked: list[tuple[int, bool]] = []

    def any_rank(flag: bool) -> bool:
        asked.append((step, flag))
        return flag

    stop = StopSignals(every=5, saves=True, warn=print)
    stops = []
    for step in range(1, 21):
        if step == 7:
            stop.received = signal.SIGTERM
        if stop.agreed(step, any_rank):
            stops.append(step)
    assert asked == [(5, False), (10, True), (15, True), (20, True)] and stops == [10, 15, 20]
    assert not StopSignals(every=1, saves=False, warn=print).agreed(3, any_rank)  # nothing to save: no collective


def test_the_stop_flag_travels_on_the_host_unless_the_group_is_nccl_only(monkeypatch):
    """A host tensor on gloo (no wait for the GPU); NCCL refuses host tensors, so there it is the rank's own GPU
    (the current device, cuda:3 for local rank 3), not cuda:0."""
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 3)
    assert flag_device("cuda:nccl") == torch.device("cuda", 3)
    assert flag_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert flag_device("cpu:gloo,cuda:gloo") == torch.device("cpu")


def test_a_stop_signal_is_noted_and_the_handler_given_back():
    before = signal.getsignal(signal.SIGUSR1)
    stop = StopSignals(every=1, saves=True, warn=print)
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGUSR1  # the first one
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_without_a_checkpoint_directory_a_stop_signal_warns_once_and_acts_as_before():
    got, warned = [], []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        stop = StopSignals(every=1, saves=False, warn=warned.append)
        stop.install()
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert got == [signal.SIGTERM, signal.SIGTERM] and stop.received is None
        assert (
            len(warned) == 1
            and "asked to stop (SIGTERM or SIGUSR1) but the job has no checkpoint directory" in warned[0]
        )
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.parametrize("var", [NOTE_VAR, SPAWNED_VAR])
def test_under_a_paratrain_launcher_sigterm_is_left_to_end_the_rank(tmp_path, monkeypatch, var):
    """A Python handler runs only once the main thread is back in the interpreter: a rank blocked in a collective
    whose peer died would outlive its launcher's SIGTERM until the kill. So where a paratrain launcher started the
    rank (``paratrain run``, which hands a stop on as SIGUSR1; ``paratrain.launch``), SIGTERM keeps its handler;
    SIGUSR1 is the stop. Under torchrun or srun alone both are."""
    monkeypatch.setenv(var, str(tmp_path / "note.json"))
    before = signal.getsignal(signal.SIGTERM)
    stop = StopSignals(every=1, saves=True, warn=print)
    try:
        stop.install()
        assert signal.getsignal(signal.SIGTERM) is before and signal.getsignal(signal.SIGUSR1) == stop._handle
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.received == signal.SIGUSR1
    finally:
        stop.uninstall()
    assert caught_signals({}) == (signal.SIGTERM, signal.SIGUSR1)


def test_stop_check_every_is_checked():
    with pytest.raises(ConfigError, match="stop_check_every must be an integer >= 1, got 0"):
        CheckpointConfig(dir="x", stop_check_every=0)
    assert CheckpointConfig.of(CheckpointConfig(stop_check_every=3), environ={}).stop_check_every == 3


def test_a_job_slurm_requeued_resumes():
    config = CheckpointConfig(dir="ckpt")
    assert config.should_resume({"SLURM_RESTART_COUNT": "1"}) and not config.should_resume({"SLURM_RESTART_COUNT": "0"})
    assert not CheckpointConfig(dir="ckpt", resume=False).should_resume({"SLURM_RESTART_COUNT": "1"})


def test_the_launcher_reports_a_preemption_only_when_every_rank_saved(tmp_path, monkeypatch):
    """And leaves the mark paratrain slurm's script requeues on."""
    monkeypatch.setenv(MARK_VAR, str(tmp_path / "mark"))
    with preemption_note() as path:
        assert os.environ[NOTE_VAR] == path
        assert preempted([PREEMPTED_EXIT_CODE] * 2, path) is None  # no rank said where it saved
        Note(40, str(tmp_path / "step-00000040")).write()
        done = preempted([PREEMPTED_EXIT_CODE] * 2, path)
        assert done is not None and done.exit_code == 75
        assert str(done).startswith(f"preempted at step 40, saved to {tmp_path / 'step-00000040'}; exit code 75")
        assert preempted([PREEMPTED_EXIT_CODE, 1], path) is None  # a rank failed of its own
        assert marked(done) is done and (tmp_path / "mark").exists()
    assert NOTE_VAR not in os.environ and not os.path.exists(path)


def test_a_repeated_stop_signal_does_not_cut_the_ranks_save_short_but_a_second_ctrl_c_does():
    """The launcher acts on the first SIGTERM/SIGUSR1 (the agent forwards SIGTERM and waits its grace period); a
    scheduler's next signal must not end that wait, or the ranks die mid-save. A second Ctrl-C still leaves at once."""
    from paratrain.launcher.signals import caught_stop_signals

    acted: list[signal.Signals] = []
    with caught_stop_signals(acted.append) as request:
        for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            os.kill(os.getpid(), sig)
    assert request.signal == signal.SIGUSR1 and acted == [signal.SIGUSR1, signal.SIGINT]


@pytest.mark.launched
@pytest.mark.timeout(200)
def test_a_signal_mid_training_saves_at_one_step_and_the_resume_is_bitwise(tmp_path):
    """ddp, zero3, a pipeline and tp at world 2, in one job: rank 0 signalled after step 3, rank 1 after step 4
    (after the check at step 4, with a check every 2 steps): both save at step 4; a fresh ``Parallel`` resumes from
    that save and ends bitwise where the uninterrupted run ended."""
    from helpers.preempt_workers import CASES, STEPS, run_cases

    got = spawn(run_cases, 2, (str(tmp_path),), timeout_s=180)
    for strategy, _ in CASES:
        for rank, results in enumerate(got):
            runs = results[strategy]
            assert "error" not in runs, (strategy, runs)
            whole, stopped, resumed = runs["whole"], runs["stopped"], runs["resumed"]
            assert stopped["preempted"] == (4, "step-00000004") and stopped["step"] == 4, (strategy, rank)
            assert resumed["resumed_at"][0] == 4 and resumed["step"] == STEPS, (strategy, rank)
            assert resumed["batches"] == whole["batches"][4:], (strategy, rank)
            for what in ("params", "optim"):
                a, b = whole[what], resumed[what]
                assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == [], (strategy, what)
            assert whole["lr"] == resumed["lr"]
    assert not alive(child_pids())


@pytest.mark.launched
@pytest.mark.timeout(120)
def test_paratrain_run_forwards_sigterm_and_its_ranks_save_before_they_leave(tmp_path):
    """SIGTERM to ``paratrain run``: its ranks finish their step, save, exit 75; its last line says where."""
    ckpt, started = tmp_path / "ckpt", tmp_path / "started"
    env = {**os.environ, "PREEMPT_STARTED": str(started)}
    cmd = [*PARATRAIN, "run", "-n", "2", "--checkpoint-dir", str(ckpt), str(SCRIPTS / "preempt_job.py")]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 90
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == PREEMPTED_EXIT_CODE, (out, err)
    last = err.strip().splitlines()[-1]
    assert last.startswith("paratrain: preempted (SIGTERM) at step ") and f", saved to {ckpt}/step-" in last, err
    step = int(last.split("at step ")[1].split(",")[0])
    assert step % 10 == 0 and (ckpt / f"step-{step:08d}").is_dir() and "Traceback" not in err
    assert not alive(child_pids())
