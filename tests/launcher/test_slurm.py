"""SLURM: host lists, allocations read from fake ``SLURM_*`` environments, the generated sbatch script, and a
two-"node" job on this host started with no flags but the allocation's variables (as srun would)."""

from __future__ import annotations

import os
import shlex
import subprocess

import pytest
from helpers.cli import run_cli
from helpers.paths import SCRIPTS

from paratrain import ConfigError, LaunchError
from paratrain.cli.main import main
from paratrain.launcher.ports import port_in_use
from paratrain.launcher.sbatch import SbatchSpec, render_sbatch
from paratrain.launcher.slurm import PORT_BASE, expand_hostlist, read_slurm
from paratrain.launcher.torchrun import parse_args, resolve

SCRIPT = str(SCRIPTS / "plain_torchrun.py")


@pytest.mark.parametrize(
    "hostlist, hosts",
    [
        ("node[01-04,07]", ["node01", "node02", "node03", "node04", "node07"]),
        ("a[1-2],b3", ["a1", "a2", "b3"]),
        ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),
        ("gpu[08-10]", ["gpu08", "gpu09", "gpu10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("x[3],y[5-6]z", ["x3", "y5z", "y6z"]),
        ("login", ["login"]),
        ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
    ],
)
def test_hostlists_expand_like_slurm(hostlist, hosts):
    assert expand_hostlist(hostlist) == hosts


@pytest.mark.parametrize("hostlist", ["node[01-", "node]1[", "node[a-b]", "node[3-1]", "a,,b", "", "n[1-2-3]"])
def test_bad_hostlists_are_one_line_errors(hostlist):
    with pytest.raises(LaunchError, match="cannot parse SLURM host list") as info:
        expand_hostlist(hostlist)
    assert "\n" not in str(info.value)


def _step(**extra: str) -> dict[str, str]:
    """The variables srun sets in one task of a 4-node step, one task per node, 8 GPUs per node."""
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "node[01-04]",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_STEP_NODELIST": "node[01-04]",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_NTASKS": "4",
        "SLURM_NODEID": "2",
        "SLURM_PROCID": "2",
        "SLURM_GPUS_ON_NODE": "8",
        **extra,
    }


def test_an_srun_step_gives_every_torchrun_argument():
    job = read_slurm(_step())
    assert job is not None and job.under_srun and job.problem() is None and job.warning() is None
    assert job.torchrun_args("static") == {
        "nnodes": "4",
        "rdzv_id": "4242",
        "node_rank": 2,
        "master_addr": "node01",
        "master_port": PORT_BASE + 4242,
        "nproc_per_node": 8,
    }
    assert job.torchrun_args("c10d") == {
        "nnodes": "4",
        "rdzv_id": "4242",
        "nproc_per_node": 8,
        "rdzv_endpoint": f"node01:{PORT_BASE + 4242}",
    }


def test_a_step_on_part_of_the_allocation_uses_the_steps_nodes():
    job = read_slurm(
        _step(SLURM_STEP_NODELIST="node[03-04]", SLURM_STEP_NUM_NODES="2", SLURM_STEP_NUM_TASKS="2", SLURM_NODEID="1")
    )
    assert job.hosts == ("node03", "node04") and job.node_rank == 1


def test_outside_slurm_nothing_is_read():
    assert read_slurm({"HOME": "/root"}) is None


@pytest.mark.parametrize("step", [None, "4294967291"])  # an salloc shell; the batch script's own step
def test_an_allocation_entered_without_srun_is_noted(step):
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "0"}
    if step:
        env["SLURM_STEP_ID"] = step
    job = read_slurm(env)
    assert not job.under_srun and "not started by srun" in job.warning() and "--ntasks-per-node=1" in job.warning()


def test_several_tasks_per_node_are_refused():
    job = read_slurm(_step(SLURM_STEP_NUM_TASKS="32"))
    assert "32 tasks on 4 node(s)" in job.problem() and "--ntasks-per-node=1" in job.problem()


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"SLURM_STEP_NUM_NODES": "3"}, "has 4 nodes but the job reports 3"),
        ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 is outside 0..3"),
        ({"SLURM_NODEID": "x"}, "SLURM_NODEID 'x' is not a number"),
    ],
)
def test_inconsistent_slurm_variables_are_one_line_errors(extra, words):
    with pytest.raises(LaunchError, match=words):
        read_slurm(_step(**extra))


def _resolve(argv: list[str], environ: dict[str, str]):
    os.environ.update(environ)
    notes: list[str] = []
    return resolve(parse_args(argv), note=notes.append), notes


def test_paratrain_run_fills_in_the_allocation_and_explicit_flags_win():
    env = _step(SLURM_STEP_NODELIST="127.0.0.[1-4]")
    args, _ = _resolve([SCRIPT], env)
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_id, args.nproc_per_node) == (
        "4",
        2,
        "127.0.0.1",
        PORT_BASE + 4242,
        "4242",
        8,
    )
    assert args.local_addr is None  # the single-node loopback default is not applied to a multi-node job
    args, _ = _resolve(["--node-rank", "0", "--master-port", "1234", "-n", "3", "--rdzv-id", "mine", SCRIPT], env)
    assert (args.node_rank, args.master_port, args.nproc_per_node, args.rdzv_id) == (0, 1234, 3, "mine")
    assert args.nnodes == "4"


def test_paratrain_run_outside_srun_stays_on_this_node_and_says_so():
    args, notes = _resolve([SCRIPT], {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"})
    assert args.nnodes == "1:1" and args.local_addr == "127.0.0.1"
    assert len(notes) == 1 and "not started by srun" in notes[0]


def test_paratrain_run_refuses_several_tasks_per_node():
    with pytest.raises(LaunchError, match="run one task per node"):
        _resolve([SCRIPT], _step(SLURM_STEP_NUM_TASKS="8"))


@pytest.mark.launched
def test_srun_paratrain_run_with_no_flags_runs_two_nodes(paratrain_cmd, tmp_path):
    job_id = next(j for j in range(4100, 5000) if not port_in_use("127.0.0.1", PORT_BASE + j))
    step = {
        "SLURM_JOB_ID": str(job_id),
        "SLURM_STEP_ID": "0",
        "SLURM_STEP_NODELIST": "127.0.0.[1-2]",
        "SLURM_STEP_NUM_NODES": "2",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_GPUS_ON_NODE": "1",
    }
    procs = [
        subprocess.Popen(
            [*paratrain_cmd, "run", SCRIPT, str(tmp_path)],
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **step, "SLURM_NODEID": str(node)},
        )
        for node in (0, 1)
    ]
    try:
        errors = [p.communicate(timeout=90)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errors
    lines = sorted((tmp_path / f"rank{r}.txt").read_text().split()[:4] for r in range(2))
    assert lines == [["0", "2", "0", "3"], ["1", "2", "0", "3"]]  # rank, world, local rank, all-reduced sum


def _spec(**kw) -> SbatchSpec:
    base = dict(
        target="train.py",
        target_args=("--lr", "3e-4", "--name", "my run"),
        nodes=4,
        gpus_per_node=8,
        cpus_per_task=32,
        time="2:00:00",
        partition="gpu",
        setup=("source .venv/bin/activate",),
        run_args=("--rdzv-timeout", "900"),
    )
    return SbatchSpec(**{**base, **kw})


@pytest.mark.launched
def test_the_sbatch_script_asks_for_one_task_per_node_and_runs_paratrain(tmp_path):
    text = render_sbatch(_spec())
    for line in (
        "#SBATCH --job-name=train",
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --cpus-per-task=32",
        "#SBATCH --time=2:00:00",
        "#SBATCH --partition=gpu",
        "#SBATCH --output=%x-%j.out",
        "source .venv/bin/activate",
    ):
        assert line in text.splitlines()
    path = tmp_path / "job.sbatch"
    path.write_text(text)
    res = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, timeout=20)
    assert res.returncode == 0, res.stderr
    [srun] = [line for line in text.splitlines() if line.startswith("srun ")]
    assert "--ntasks-per-node=1" in srun and '--cpus-per-task="$SLURM_CPUS_PER_TASK"' in srun
    run_argv = shlex.split(srun.split(" paratrain run ", 1)[1].removesuffix(" || status=$?"))
    args = parse_args(run_argv)  # our own parser reads the line the script runs
    assert (args.nproc_per_node, args.rdzv_timeout, args.training_script) == ("8", 900, "train.py")
    assert args.training_script_args == ["--lr", "3e-4", "--name", "my run"]


def test_a_module_target_and_minimal_options():
    text = render_sbatch(SbatchSpec(target="pkg.train", module=True, nodes=2, grace=0))
    assert "#SBATCH --job-name=train" in text and "--gpus-per-node" not in text and "--signal" not in text
    assert text.rstrip().endswith("srun --ntasks-per-node=1 --kill-on-bad-exit=1 paratrain run -m pkg.train")


@pytest.mark.launched
def test_the_script_warns_the_ranks_before_the_time_limit_and_requeues_once_they_saved(tmp_path):
    """SIGUSR1 ``grace`` s before the limit to every process of the step; paratrain run waits that long for its
    ranks to save; exit code 75 requeues the job, and so does the mark of a preempted paratrain run whatever srun's
    code (``--kill-on-bad-exit`` may kill another node's launcher first); any other is the job's."""
    text = render_sbatch(SbatchSpec(target="train.py", nodes=2, grace=300))
    lines = text.splitlines()
    for line in ("#SBATCH --signal=USR1@300", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert line in lines
    [srun] = [line for line in lines if line.startswith("srun ")]
    assert srun.endswith("paratrain run --shutdown-timeout 300 train.py || status=$?")
    assert parse_args(shlex.split(srun.split(" paratrain run ", 1)[1].split(" || ")[0])).shutdown_timeout == 300
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_srun = '#!/bin/bash\n[ -z "$MARK" ] || touch "$PARATRAIN_PREEMPTED_MARK"\nexit "$SRUN_STATUS"\n'
    (bin_dir / "srun").write_text(fake_srun)  # a preempted paratrain run leaves the mark; srun ends with $SRUN_STATUS
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" > {tmp_path}/requeued\n')
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    for status, mark, requeued in ((75, "", True), (137, "1", True), (1, "", False), (0, "", False)):
        (tmp_path / "requeued").unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SRUN_STATUS": str(status), "MARK": mark}
        env.update(SLURM_JOB_ID="42", TMPDIR=str(tmp_path))
        res = subprocess.run(["bash", str(script)], env=env, timeout=20)
        assert res.returncode == status
        assert (tmp_path / "requeued").exists() == requeued
        assert not requeued or (tmp_path / "requeued").read_text() == "requeue 42\n"
    with pytest.raises(ConfigError, match="--grace must be a whole number of seconds >= 0"):
        SbatchSpec(target="train.py", grace=-1)


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"nodes": 0}, "--nodes must be a whole number >= 1"),
        ({"time": "1 h"}, "not a SLURM time limit"),
        ({"partition": "a b"}, "--partition 'a b' must be one word"),
        ({"target": ""}, "give the training script"),
    ],
)
def test_bad_sbatch_options_are_one_line_errors(kw, words):
    with pytest.raises(ConfigError, match=words):
        _spec(**kw)


def test_paratrain_slurm_prints_or_writes_the_script(tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    assert (
        main(["slurm", "--nodes", "2", "--gpus-per-node", "4", "--output", str(out), "train.py", "--epochs", "3"]) == 0
    )
    assert f"sbatch {out}" in capsys.readouterr().err
    written = out.read_text()
    assert os.access(out, os.X_OK) and "run --nproc-per-node 4 --shutdown-timeout 120 train.py --epochs 3" in written
    assert main(["slurm", "-N", "2", "train.py"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("#!/bin/bash") and "--nodes=2" in printed
    for argv, words in (
        (["--time", "soon"], "not a SLURM time limit"),
        (["--run-args=--rdzv-timout 9"], "unrecognized arguments: --rdzv-timout"),
    ):
        assert main(["slurm", *argv, "train.py"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, err


@pytest.mark.launched
def test_the_console_script_lists_the_command():
    res = run_cli("--help", timeout=30)
    assert "paratrain slurm" in res.stdout
