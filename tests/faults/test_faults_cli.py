"""Bad input to every command: one line saying what to do, exit code 2, no traceback, nothing started.

Runs the CLI in this process (no launch, no subprocess), so the whole family costs about a second. Each case's
outcome class is checked and tallied by :mod:`faults`.
"""

import socket

import pytest
from helpers.cli import in_process
from helpers.faults import check
from helpers.paths import SCRIPTS

SCRIPT = str(SCRIPTS / "plain_torchrun.py")

ONE_LINE = [
    # paratrain run
    (["run", "-n", "2", "--nproc-per-node", "3", SCRIPT], "-n 2 and --nproc-per-node 3 disagree"),
    (["run", "--nproc_per_node=2", "-n3", SCRIPT], "--nproc_per_node 2 and -n 3 disagree"),
    (["run", "--master-port", "99999", SCRIPT], "--master-port 99999 is not a TCP port"),
    (["run", "--nnodes", "2", "--node-rank", "5", SCRIPT], "--node-rank 5 is outside a job of --nnodes 2"),
    (["run", "--node-rank", "-1", SCRIPT], "--node-rank -1 is outside"),
    (["run", "-n", "0", SCRIPT], "at least 1"),
    (["run", "-n", "abc", SCRIPT], "must be a number"),
    (["run", "--nnodes", "3:2", SCRIPT], "0 < MIN <= MAX"),
    (["run", "--rdzv-timeout", "0", SCRIPT], "--rdzv-timeout must be at least 1"),
    (["run", "--pg-timeout", "0", SCRIPT], "--pg-timeout must be > 0"),
    (["run", "--checkpoint-every", "0", "--checkpoint-dir", "ck", SCRIPT], "checkpoint every must be >= 1"),
    (["run", "--checkpoint-every", "5", SCRIPT], "needs a checkpoint directory"),
    (["run", "--checkpoint-async", SCRIPT], "checkpoint async_save needs a checkpoint directory"),
    (["run", "-n", "2", "missing_script.py"], "not found"),
    (["run", "-m", "no_such_module_xyz"], "not found"),
    (["run", "--no-such-flag", SCRIPT], "unrecognized"),
    (["run"], "required"),
    # paratrain plan
    (["plan", "--model", "gpt2", "--gpus", "8", "--dp", "8", "--global-batch", "12"], "1.5 samples each"),
    (
        ["plan", "--model", "gpt2", "--gpus", "8", "--dp", "8", "--global-batch", "4"],
        "(0.5 samples each); use a multiple of 8, e.g. 8",
    ),
    (["plan", "--model", "nope"], "unknown model 'nope'"),
    (["plan", "--model", "gpt2", "--gpus", "0"], "--gpus must be >= 1"),
    (["plan", "--model", "gpt2", "--gpu", "nope"], "unknown GPU 'nope'"),
    (["plan", "--model", "gpt2", "--batch", "0"], "--batch must be >= 1"),
    (["plan"], "give --model"),
    # paratrain bench
    (["bench", "--workload", "nope"], "unknown workload 'nope'"),
    (["bench", "--nproc", "0"], "world sizes >= 1"),
    (["bench", "--nproc", "x"], "comma-separated world sizes"),
    (["bench", "--strategies", "nope"], "unknown strategy 'nope'"),
    # paratrain verify
    (["verify", "nomodule_xyz:build"], "cannot import 'nomodule_xyz'"),
    (["verify", "json:dumps", "--strategy", "nope"], "unknown strategy 'nope'"),
    (["verify", "nocolon"], "write module:function"),
    # paratrain slurm
    (["slurm", "--nodes", "0", SCRIPT], "--nodes must be a whole number >= 1"),
    (["slurm", "--nodes", "2", "--gpus-per-node", "-1", SCRIPT], "--gpus-per-node must be a whole number"),
    (["slurm", "--nodes", "2", "--time", "soon", SCRIPT], "is not a SLURM time limit"),
    # paratrain k8s
    (["k8s", "--image", "img", "--nodes", "0", SCRIPT], "--nodes must be >= 1, got 0"),
    (["k8s", "--image", "img", "--name", "My_Job", SCRIPT], "--name 'My_Job' is not a TrainJob name"),
    (["k8s", "--image", "img", "--env", "PET_NNODES=2", SCRIPT], "Kubeflow Trainer sets the PET_* variables itself"),
    (["k8s", "--image", "img", "--run-args", "--nnodes 2", SCRIPT], "use `paratrain k8s --nodes` instead"),
    # paratrain demo
    (["demo", "--strategy", "nope"], "unknown strategy 'nope'"),
    (["demo", "--epochs", "0"], "--epochs must be >= 1"),
    (["demo", "-n", "0"], "--nproc must be >= 1, got 0"),
    (["demo", "--accumulate", "0"], "--accumulate must be >= 1"),
    (["demo", "--lr", "0"], "--lr must be > 0, got 0"),
    (["demo", "--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["demo", "--checkpoint-every", "5"], "--checkpoint-every, --checkpoint-async and --resume need --checkpoint-dir"),
    (["demo", "--checkpoint-async"], "--checkpoint-every, --checkpoint-async and --resume need --checkpoint-dir"),
    (["demo", "-n", "2", "--fail-at-step", "3", "--fail-rank", "2"], "--fail-rank 2 is not a rank of a 2-process job"),
    (["demo", "--strategy", "dp", "-n", "2"], "use strategy 'ddp'"),
    (["demo", "--tf", "--strategy", "ddp"], "--strategy is an option of the torch demo; drop it with --tf"),
    # paratrain dry-run, tp-plan
    (["dry-run", "--model", "gpt-tiny", "--world", "0"], "--world must be >= 1, got 0"),
    (["tp-plan", "--model", "gpt-tiny", "--tp", "1"], "tp-plan needs --tp N (N >= 2)"),
    # paratrain export
    (["export", "no/such/ckpt", "out.pt"], "no checkpoint at no/such/ckpt"),
]


@pytest.mark.parametrize("argv, words", ONE_LINE, ids=[" ".join(a[:4]) for a, _ in ONE_LINE])
def test_bad_input_is_one_line(argv, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, stderr = in_process(argv)
    check(f"cli: {' '.join(argv)}".replace(str(SCRIPTS) + "/", ""), rc=rc, stderr=stderr, words=["paratrain", words])


@pytest.mark.parametrize(
    "argv",
    [
        ["doctor", "--nope"],
        ["nope"],
        ["plan", "--gpus", "two"],
        ["export", "only_one"],
        ["bench", "--threads", "x"],
        ["verify"],
        ["slurm"],
        ["k8s", SCRIPT],
    ],
)
def test_argparse_errors_are_one_line(argv):
    rc, stderr = in_process(argv)
    check(f"cli: {' '.join(argv)}", rc=rc, stderr=stderr, words=["error:", "--help`"])


def test_a_taken_master_port_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, stderr = in_process(["run", "-n", "2", "--master-port", str(port), SCRIPT])
    check("cli: run --master-port <taken>", rc=rc, stderr=stderr, words=[f"--master-port {port} is already in use"])


def test_a_bad_kubeflow_variable_is_one_line_naming_it(monkeypatch):
    monkeypatch.setenv("PET_NODE_RANK", "first")
    rc, stderr = in_process(["run", SCRIPT])
    check("cli: run with PET_NODE_RANK=first", rc=rc, stderr=stderr, words=["PET_NODE_RANK='first' is not a node rank"])


def test_slurm_warns_about_a_script_that_is_not_here(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, stderr = in_process(["slurm", "--nodes", "2", "missing.py"])
    check(
        "cli: slurm missing.py", rc=rc, stderr=stderr, kind="warning", expect_rc=0, words=["missing.py does not exist"]
    )


def test_export_refuses_to_overwrite_or_write_a_directory(tmp_path):
    from helpers.faults_checkpoint import small_checkpoint

    ckpt = small_checkpoint(tmp_path / "ck")
    existing = tmp_path / "model.pt"
    existing.write_bytes(b"precious")
    rc, stderr = in_process(["export", str(ckpt), str(existing)])
    check(
        "cli: export onto an existing file", rc=rc, stderr=stderr, words=["exists; pass --force"], kept=[str(existing)]
    )
    assert existing.read_bytes() == b"precious"
    folder = tmp_path / "a_dir"
    folder.mkdir()
    rc, stderr = in_process(["export", str(ckpt), str(folder)])
    check("cli: export onto a directory", rc=rc, stderr=stderr, words=["is a directory"])
    assert list(folder.iterdir()) == [] and not list(tmp_path.glob(".*tmp*"))
    rc, stderr = in_process(["export", "--force", str(ckpt), str(existing)])
    assert rc == 0 and existing.read_bytes() != b"precious", stderr


def test_export_to_hugging_face_refuses_in_one_line(tmp_path):
    from helpers.faults_checkpoint import small_checkpoint

    ckpt = small_checkpoint(tmp_path / "ck")  # a plain torch model: no config travels with it
    rc, stderr = in_process(["export", "--format", "hf", str(ckpt), str(tmp_path / "out")])
    check("cli: export --format hf without a config", rc=rc, stderr=stderr, words=["give --config DIR"])
    rc, stderr = in_process(["export", "--format", "hf", "--config", str(tmp_path), str(ckpt), str(tmp_path / "out")])
    check("cli: export --format hf, --config without config.json", rc=rc, stderr=stderr, words=["holds no config.json"])
    rc, stderr = in_process(["export", "--format", "hf", "--max-shard-size", "0", str(ckpt), str(tmp_path / "out")])
    check("cli: export --format hf, a shard of 0 GiB", rc=rc, stderr=stderr, words=["must be positive"])
    existing = tmp_path / "ck"
    rc, stderr = in_process(["export", "--format", "hf", str(ckpt), str(existing)])
    check("cli: export --format hf onto an existing folder", rc=rc, stderr=stderr, words=["goes into a new folder"])
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*tmp*"))
