"""The TensorFlow extra without TensorFlow: TF_CONFIG parsing, the Keras choice, the batch and LR rules, import
hygiene, and every bad input of ``paratrain run --tf`` answered in one line before anything starts."""

from __future__ import annotations

import contextlib
import io
import json
import socket
import subprocess
import sys

import pytest
from helpers.cli import in_process
from helpers.paths import ROOT

from paratrain.cli.main import main
from paratrain.errors import ConfigError, LaunchError
from paratrain.tf.config import TFConfig, parse_tf_config
from paratrain.tf.install import INSTALL_HINT, apply_keras_choice, keras_choice, require_tensorflow

GOOD = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 1}}


def test_tf_config_round_trip_and_rank():
    config = TFConfig.for_workers(["a:1", "b:2", "c:3"], 2)
    assert parse_tf_config(config.to_json()) == config
    assert (config.address, config.rank, config.num_workers) == ("c:3", 2, 3)
    chief = parse_tf_config(
        json.dumps({"cluster": {"chief": ["a:1"], "worker": ["b:2"]}, "task": {"type": "worker", "index": 0}})
    )
    assert (chief.rank, chief.num_workers) == (1, 2)


@pytest.mark.parametrize(
    "text, words",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"task": GOOD["task"]}), 'no "cluster"'),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": 2}}), "index 2 is out of range"),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": -1}}), "out of range"),
        (json.dumps({**GOOD, "task": {"type": "chief", "index": 0}}), "'chief' is not in the cluster"),
        (json.dumps({"cluster": {"worker": ["nohost"]}, "task": {"type": "worker", "index": 0}}), "not a 'host:port'"),
        (json.dumps({"cluster": {"worker": ["h:99999"]}, "task": {"type": "worker", "index": 0}}), "port in 1"),
        (json.dumps({"cluster": {"worker": ["h:1", "h:1"]}, "task": {"type": "worker", "index": 0}}), "share one"),
        (json.dumps({"cluster": {"boss": ["h:1"]}, "task": {"type": "boss", "index": 0}}), "unknown task type"),
        (json.dumps({"cluster": GOOD["cluster"]}), 'no "task"'),
    ],
)
def test_bad_tf_config_is_one_line(text, words):
    with pytest.raises(LaunchError, match=words) as err:
        parse_tf_config(text)
    assert "\n" not in str(err.value)


def test_keras_choice():
    assert keras_choice({"TF_USE_LEGACY_KERAS": "0"}).legacy is False
    assert "warning" in keras_choice({"TF_USE_LEGACY_KERAS": "0"}).note(2)
    assert keras_choice({"TF_USE_LEGACY_KERAS": "1"}).note(2) is None  # the user's own choice: nothing to say
    ours = keras_choice({})
    assert ours.legacy and ours.set_by_us and "TF_USE_LEGACY_KERAS=1" in ours.note(2)  # tf-keras is installed
    # what the launcher writes into the environment its workers inherit: a user's own choice is kept
    kept, set_here = {"TF_USE_LEGACY_KERAS": "0"}, {}
    assert not apply_keras_choice(kept).legacy and kept == {"TF_USE_LEGACY_KERAS": "0"}
    assert apply_keras_choice(set_here).legacy and set_here == {"TF_USE_LEGACY_KERAS": "1"}


def test_batch_and_lr_rules_follow_the_replicas():
    from paratrain.tf import global_batch, scaled_lr

    class Four:
        num_replicas_in_sync = 4

    assert global_batch(32, Four()) == 128
    assert scaled_lr(0.1, "linear", Four()) == pytest.approx(0.4)
    assert scaled_lr(0.1, "sqrt", Four()) == pytest.approx(0.2)
    with pytest.raises(ConfigError, match="unknown LR scaling rule"):
        scaled_lr(0.1, "cubic", Four())
    with pytest.raises(ConfigError, match="per-replica batch"):
        global_batch(0, Four())


@pytest.mark.launched
def test_importing_paratrain_tf_imports_neither_tensorflow_nor_torch():
    code = (
        "import sys, paratrain, paratrain.tf as t; t.scaled_lr; t.TFConfig; import paratrain.tf.worker; "
        "print(sorted(m for m in ('tensorflow', 'torch', 'keras') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_missing_tensorflow_is_the_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    with pytest.raises(ConfigError) as err:
        require_tensorflow()
    assert str(err.value) == INSTALL_HINT
    rc, stderr = in_process(["run", "--tf", "-n", "2", str(ROOT / "examples" / "tf" / "multi_worker_keras.py")])
    assert rc == 2 and stderr.strip() == f"paratrain: error: {INSTALL_HINT}"


SCRIPT = str(ROOT / "examples" / "tf" / "multi_worker_keras.py")


@pytest.mark.parametrize(
    "tf_config, argv, words",
    [
        ("{oops", ["-n", "1"], "TF_CONFIG is not valid JSON"),
        (json.dumps({**GOOD, "task": {"type": "worker", "index": 5}}), ["-n", "1"], "task index 5 is out of range"),
        (json.dumps(GOOD), ["-n", "2"], "run `paratrain run --tf -n 1"),
        (None, ["--nnodes", "2", "--max-restarts", "1"], "restarts the workers of one node"),
        (None, ["--no-python"], "--no-python cannot be combined"),
        (None, ["-n", "cpu"], "needs a number of workers"),
        (None, ["--node-rank", "3", "--nnodes", "2"], "--node-rank 3 is outside"),
        (None, ["--rdzv-timeout", "0"], "--rdzv-timeout must be at least 1"),
    ],
)
def test_bad_input_under_tf_is_one_line(tf_config, argv, words, monkeypatch):
    if tf_config is not None:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    rc, stderr = in_process(["run", "--tf", *argv, SCRIPT])
    assert rc == 2, stderr
    assert len(stderr.strip().splitlines()) == 1 and words in stderr, stderr


def test_a_busy_port_in_tf_config_is_one_line(monkeypatch):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv(
            "TF_CONFIG",
            json.dumps(
                {"cluster": {"worker": [f"127.0.0.1:{port}", "127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
            ),
        )
        rc, stderr = in_process(["run", "--tf", "-n", "1", SCRIPT])
    assert rc == 2 and len(stderr.strip().splitlines()) == 1 and f"port {port} is already in use" in stderr, stderr


def test_tf_before_the_script_is_tensorflows_launcher_and_after_it_the_scripts_own_flag(monkeypatch):
    """One dispatch point (``cli.main``) reads run's parsed flags; tests/cli/test_cli_run.py runs the torch job."""
    import importlib

    torchrun = importlib.import_module("paratrain.launcher.torchrun")
    tf_launcher = importlib.import_module("paratrain.tf.launcher")

    launched = []
    monkeypatch.setattr(torchrun, "launch", lambda args, **_: launched.append(("torch", args)))
    monkeypatch.setattr(tf_launcher, "launch", lambda args, **_: launched.append(("tf", args)))
    assert main(["run", "-n", "2", SCRIPT, "--tf"]) == 0
    assert main(["run", "--tf", "-n", "2", SCRIPT]) == 0
    (torch_job, script_flag), (tf_job, own_flag) = launched
    assert torch_job == "torch" and script_flag.training_script_args == ["--tf"] and not script_flag.tf
    assert tf_job == "tf" and own_flag.tf and own_flag.training_script_args == []


def test_nodes_swap_their_workers_addresses_through_node_0():
    import threading

    from paratrain.launcher.ports import free_port
    from paratrain.tf.cluster import multi_node

    port, found = free_port(), {}

    def node(rank: int, nproc: int) -> None:
        found[rank] = multi_node(
            nproc=nproc, nnodes=2, node_rank=rank, master_addr="127.0.0.1", master_port=port, timeout_s=30
        )

    threads = [threading.Thread(target=node, args=(r, n)) for r, n in ((1, 1), (0, 2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert found[0].addresses == found[1].addresses and len(found[0].addresses) == 3
    assert (list(found[0].indices), list(found[1].indices)) == ([0, 1], [2])
    assert all(a.startswith("127.0.0.1:") for a in found[0].addresses)


def test_a_node_alone_gives_up_after_the_rendezvous_timeout():
    from paratrain.launcher.ports import free_port
    from paratrain.tf.cluster import multi_node

    with pytest.raises(LaunchError, match="did not all meet at 127.0.0.1"):
        multi_node(nproc=1, nnodes=2, node_rank=1, master_addr="127.0.0.1", master_port=free_port(), timeout_s=1)


def test_a_slurm_step_fills_in_the_tf_job(monkeypatch):
    from paratrain.launcher.torchrun import parse_args
    from paratrain.tf.launcher import plan

    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.setenv("SLURM_STEP_NODELIST", "n[1-2]")
    monkeypatch.setenv("SLURM_STEP_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    job = plan(parse_args(["--tf", "-n", "1", SCRIPT]))
    assert (job.nnodes, job.node_rank, job.master_addr, job.nproc) == (2, 1, "n1", 1)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["slurm", "--tf", "--nodes", "2", "-n", "1", SCRIPT]) == 0
    assert "paratrain run --nproc-per-node 1 --tf " in out.getvalue()


def test_doctor_tensorflow_section(tmp_path, monkeypatch):
    from paratrain.doctor.checks import Status
    from paratrain.tf.doctor import TFFacts, check_tf_config, tf_checks
    from paratrain.tf.install import KerasChoice

    facts = TFFacts(
        version="2.21.0",
        keras=KerasChoice(legacy=True, set_by_us=True),
        keras_version="3.15.1",
        tf_keras_version="2.21.0",
        devices=("CPU:0",),
        tf_config=json.dumps(GOOD),
    )
    both = tmp_path / "both.py"
    both.write_text("import torch\nfrom tensorflow import keras\n")
    checks = {c.name: c for c in tf_checks(facts, (str(both),))}
    assert checks["tensorflow"].status is Status.OK and "CPU:0" in checks["tensorflow"].evidence
    assert checks["keras"].status is Status.OK and "tf-keras 2.21.0" in checks["keras"].evidence
    assert checks["TF_CONFIG"].status is Status.OK and "worker 1 of 2" in checks["TF_CONFIG"].evidence
    assert checks["script imports"].status is Status.WARN and "torch" in checks["script imports"].evidence
    keras3 = tf_checks(TFFacts(**{**facts.__dict__, "keras": KerasChoice(legacy=False, set_by_us=False)}))
    assert keras3[1].status is Status.WARN and "keras#20585" in keras3[1].evidence
    assert check_tf_config("{bad").status is Status.FAIL
    assert check_tf_config(json.dumps({**GOOD, "task": {"type": "worker", "index": 9}})).status is Status.FAIL
    elsewhere = {"cluster": {"worker": ["10.255.255.1:2222"]}, "task": {"type": "worker", "index": 0}}
    assert check_tf_config(json.dumps(elsewhere)).status is Status.WARN
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        busy = {"cluster": {"worker": [f"127.0.0.1:{taken.getsockname()[1]}"]}, "task": {"type": "worker", "index": 0}}
        assert check_tf_config(json.dumps(busy)).status is Status.FAIL
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    from paratrain.tf.doctor import gather_tf

    assert gather_tf() is None and tf_checks(None) == []  # no TensorFlow: no section
    assert tf_checks(None, (str(both),))[0].status is Status.FAIL  # ... unless the script needs it


def test_verify_names_the_cause_from_the_workers_records():
    from paratrain.tf.verify import diagnose

    ref = {"batch": 4, "seen": [[0, 1, 2, 3]]}
    good = [{"initial": "a", "batch": 4, "seen": [[0, 1]]}, {"initial": "a", "batch": 4, "seen": [[2, 3]]}]
    assert diagnose(ref, good) == []
    seeds = [{**good[0], "initial": "a"}, {**good[1], "initial": "b"}]
    assert "different initial weights" in diagnose(ref, seeds)[0]
    same = [{**good[0], "seen": [[0, 1]]}, {**good[1], "seen": [[0, 1]]}]
    assert "unsharded data: at step 1" in diagnose(ref, same)[0]
    double = [{**good[0], "seen": [[0, 2]]}, {**good[1], "seen": [[4, 6]]}]
    assert "double-sharded data" in diagnose(ref, double)[0]
    halved = [{**good[0], "batch": 2}, {**good[1], "batch": 2}]
    assert "batch not scaled" in diagnose(ref, halved)[0]
    with pytest.raises(ConfigError, match="N >= 2"):
        from paratrain.tf.verify import verify_tf

        verify_tf(nproc=1)


@pytest.mark.parametrize(
    "argv, words",
    [
        (["bench", "--tf", "--nproc", "1,x"], "--nproc must be world sizes"),
        (["bench", "--tf", "--nproc", "1,2", "--steps", "0"], "steps must be >= 1"),
        (["verify", "--tf", "-n", "1"], "N >= 2 workers"),
        (["demo", "--tf", "--epochs", "0"], "--epochs must be >= 1"),
    ],
)
def test_bad_tf_command_input_is_one_line(argv, words):
    rc, stderr = in_process(argv)
    assert rc == 2 and len(stderr.strip().splitlines()) == 1 and words in stderr, stderr
