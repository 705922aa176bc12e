"""``paratrain run --tf`` for real: two TensorFlow workers on this machine (CPU, localhost).

TensorFlow takes seconds to import, so there are few launches and each checks several things: the guide's
programs, the demo (accuracy, table) with a SIGKILL noticed at once and a restart resuming bitwise, Ctrl-C,
a partner that never starts, and scripts that are not TensorFlow scripts. Every launch has a hard timeout and
the test checks that no worker is left behind.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.cli import PARATRAIN, run_cli
from helpers.paths import ROOT

# The extra (`make test` installs it); looked up, not imported: this process has torch.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="needs paratrain[tf]"),
    pytest.mark.launched,
]  # every test here starts processes

EXAMPLES = ROOT / "examples" / "tf"
_NOISE = ("cuInit", "oneDNN", "cuda drivers", "absl::InitializeLog")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _left_running(marker: str) -> list[str]:
    """Processes whose command line mentions ``marker`` (a test's own tmp path)."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmd and "pytest" not in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _cli(argv: list[str], marker: Path, timeout: float = 150, **env: str) -> subprocess.CompletedProcess:
    out = run_cli(*argv, timeout=timeout, env={**_env(), **env}, cwd=marker)
    time.sleep(0.2)
    assert not _left_running(str(marker)), _left_running(str(marker))
    return out


def test_the_guides_programs_run_unchanged(tmp_path):
    out = tmp_path / "mw.json"
    run = _cli(
        ["run", "--tf", "-n", "2", str(EXAMPLES / "multi_worker_keras.py"), "--epochs", "3", "--out", str(out)],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["replicas"] == 2 and "tf_keras" in result["keras"]  # MWMS over both workers, tf-keras
    assert result["test_acc"] > 0.6
    assert run.stdout.count("replicas in sync: 2") == 2
    assert run.stderr.count("TF_USE_LEGACY_KERAS=1 for the workers") == 1  # said once, by the launcher
    assert not [line for line in run.stderr.splitlines() if any(n in line for n in _NOISE)], run.stderr
    one = _cli(["run", "--tf", "-n", "1", str(EXAMPLES / "mirrored_keras.py"), "--epochs", "1"], tmp_path)
    assert one.returncode == 0, one.stderr
    assert "replicas in sync: 1" in one.stdout and "test accuracy" in one.stdout
    # A user's TF_USE_LEGACY_KERAS=0 (Keras 3) is kept and warned about: test_tf.py's test_keras_choice, the note
    # printed as above; a worker's failure is reported as test_a_partner_that_never_starts_and_scripts_… shows.


def test_demo_reaches_95_percent_and_a_killed_worker_restarts_bitwise(tmp_path):
    """6 epochs, not the demo's 10: the training is deterministic and passes 95% at its 5th (96.7% at the 6th)."""
    demo = _cli(["demo", "--tf", "--epochs", "6"], tmp_path)
    assert demo.returncode == 0, demo.stderr
    assert "MultiWorkerMirroredStrategy" in demo.stdout and "tf.keras = tf-keras" in demo.stdout
    acc = float(demo.stdout.split("final test acc ")[1].split("%")[0]) / 100
    assert acc >= 0.95, demo.stdout
    assert "worker   steps   step ms" in demo.stdout and demo.stdout.count("epoch ") >= 6
    digest = demo.stdout.split("final weights sha256 ")[1].split()[0]

    # Worker 1 SIGKILLs itself after epoch 5: the job must notice at once, restart both and resume from the last
    # backup. The chief writes its epoch-5 backup while worker 1 dies, so which one is last is the race's: epoch 5's
    # (resume at 6) or epoch 4's (resume at 5, written before epoch 5's first all-reduce). Never earlier.
    proc, killed = _watch(
        [
            "demo",
            "--tf",
            "--epochs",
            "6",
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            "--max-restarts",
            "1",
            "--fail-at-step",
            "5",
            "--fail-rank",
            "1",
        ],
        tmp_path,
        "fault injection: SIGKILL worker 1",
    )
    restart_line = next(line for line in proc.stdout if "restarting all workers" in line)
    seconds = time.monotonic() - killed
    rest = restart_line + proc.communicate(timeout=120)[0]
    assert proc.returncode == 0, rest
    assert seconds < 8, f"the job took {seconds:.1f} s to stop after the kill"
    assert "rank 1 failed (killed by SIGKILL" in rest and "restart 1 of 1" in rest
    resumed = re.search(r"resumed at epoch (\d+) after 1 restart\(s\)", rest)
    assert resumed and int(resumed[1]) in (5, 6), rest  # BackupAndRestore: at most the killed epoch again
    again = [int(e) for e in re.findall(r"^epoch +(\d+)/6 ", rest, re.M)]
    assert again == list(range(int(resumed[1]), 7)), rest  # the restart trained from there on, not from scratch
    assert rest.split("final weights sha256 ")[-1].split()[0] == digest  # as if never interrupted
    assert not _left_running(str(tmp_path))


def _watch(argv: list[str], marker: Path, until: str, timeout: float = 120) -> tuple[subprocess.Popen, float]:
    """Start the CLI and return once ``until`` appears on its stderr or stdout (and when)."""
    proc = subprocess.Popen(
        [*PARATRAIN, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_env(), cwd=marker
    )
    deadline = time.monotonic() + timeout
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if until in line:
            return proc, time.monotonic()
        if time.monotonic() > deadline:
            break
    proc.kill()
    pytest.fail(f"never saw {until!r}:\n{''.join(lines)}")


def test_ctrl_c_is_one_line(tmp_path):
    proc, _ = _watch(["demo", "--tf", "--epochs", "50"], tmp_path, "paratrain demo --tf: digits CNN")
    proc.send_signal(signal.SIGINT)
    sent = time.monotonic()
    rest = proc.communicate(timeout=30)[0]
    assert time.monotonic() - sent < 6, f"Ctrl-C took {time.monotonic() - sent:.1f} s"  # SIGINT, SIGKILL at 2 s
    assert proc.returncode == 130, rest
    lines = [line for line in rest.splitlines() if not line.startswith("epoch ")]
    assert len(lines) == 1 and lines[0].startswith("paratrain: interrupted (SIGINT), 2 ranks stopped in"), rest
    time.sleep(0.2)
    assert not _left_running(str(tmp_path))


def test_a_partner_that_never_starts_and_scripts_that_are_not_tensorflow(tmp_path):
    tf_config = {"cluster": {"worker": ["127.0.0.1:0", "127.0.0.1:1"]}, "task": {"type": "worker", "index": 0}}
    from paratrain.tf.cluster import free_ports

    tf_config["cluster"]["worker"] = [f"127.0.0.1:{p}" for p in free_ports(2)]
    env = {**_env(), "TF_CONFIG": json.dumps(tf_config)}
    start = time.monotonic()
    alone = run_cli(
        "run",
        "--tf",
        "-n",
        "1",
        "--rdzv-timeout",
        "3",
        "-m",
        "paratrain.tf.demo_job",
        "--out",
        str(tmp_path / "x"),
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert alone.returncode == 2, alone.stderr
    assert time.monotonic() - start < 60
    assert alone.stderr.strip().splitlines()[-1].startswith("paratrain: error: worker 1 (127.0.0.1:"), alone.stderr
    assert "never started its TensorFlow server within 3 s" in alone.stderr
    assert not _left_running(str(tmp_path))

    plain = tmp_path / "plain.py"
    plain.write_text("try:\n    import torch\nexcept ImportError:\n    print('no torch here')\n")  # optional: skipped
    torchy = tmp_path / "torchy.py"
    torchy.write_text("import torch\n")
    for script, words in [
        (plain, "plain.py ended without importing TensorFlow"),
        (torchy, "this --tf worker imports torch"),
    ]:
        run = _cli(["run", "--tf", "-n", "2", str(script)], tmp_path, timeout=60)
        assert ("no torch here" in run.stdout) == (script is plain), run.stdout  # an optional torch: skipped
        assert run.returncode == 1, run.stderr
        reports = [line for line in run.stderr.splitlines() if line.startswith("paratrain:")]
        assert len(reports) == 1 and words in reports[0], run.stderr
    raising = tmp_path / "raising.py"
    raising.write_text("def build():\n    raise ValueError('bad shape 3')\n\n\nbuild()\n")
    run = _cli(["run", "--tf", "-n", "2", str(raising)], tmp_path, timeout=60)
    assert run.returncode == 1 and "failed on" in run.stderr and "ValueError: bad shape 3" in run.stderr, run.stderr
    assert 'raising.py", line 2, in build' in run.stderr and "paratrain/tf/worker.py" not in run.stderr
    assert "stopped by the launcher (SIGINT, SIGKILL after 2 s)" in run.stderr or "ranks 0, 1" in run.stderr


def test_doctor_sees_tensorflow_in_a_process_of_its_own():
    from paratrain.tf.doctor import gather_tf

    facts = gather_tf()
    assert facts is not None and facts.devices is not None and "CPU:0" in facts.devices, facts
    assert facts.keras.legacy and facts.tf_keras_version.startswith("2.21")
    assert "tensorflow" not in sys.modules  # the doctor's process stays torch-only


def test_verify_two_workers_equal_one_on_a_users_model(tmp_path):
    (tmp_path / "kmodel.py").write_text(
        "import numpy as np\nimport tensorflow as tf\n\n\ndef build():\n"
        "    rng = np.random.default_rng(1)\n"
        "    x = rng.normal(size=(256, 12)).astype(np.float32)\n"
        "    y = (x @ rng.normal(size=(12, 1))).astype(np.float32)\n"
        "    model = tf.keras.Sequential([tf.keras.layers.Input(shape=(12,)),\n"
        "                                 tf.keras.layers.Dense(16, activation='tanh'), tf.keras.layers.Dense(1)])\n"
        "    return model, x, y, tf.keras.losses.MeanSquaredError()\n"
    )
    run = _cli(["verify", "--tf", "kmodel:build", "-n", "2", "--steps", "4"], tmp_path)
    assert run.returncode == 0, run.stderr
    assert "paratrain verify --tf: kmodel:build" in run.stdout
    diff = float(run.stdout.splitlines()[2].split()[1])
    assert diff <= 1e-5 and "PASS" in run.stdout


def test_bench_reports_speedup_and_efficiency_as_json_and_png(tmp_path):
    out = tmp_path / "bench.json"
    run = _cli(
        ["bench", "--tf", "--nproc", "1,2", "--steps", "3", "--rounds", "2", "--warmup", "2", "--json", str(out)],
        tmp_path,
    )
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    rows = {r["world"]: r for r in data["rows"]}
    assert rows[1]["speedup"] == 1.0 and rows[2]["replicas"] == 2 and rows[2]["global_batch"] == 128
    assert rows[2]["samples_per_s"] > 0 and rows[2]["efficiency"] == pytest.approx(rows[2]["speedup"] / 2)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "mwms x2" in run.stdout and "speedup" in run.stdout


def test_paratrain_tf_in_one_process(tmp_path):
    """strategy(), global_batch, scaled_lr and auto_shard inside TensorFlow (a process of its own: no torch)."""
    code = """
import json, sys
import paratrain.tf as ptf
mirrored = ptf.strategy(logical_cpus=2)
tf = ptf.import_tf()
ds = ptf.auto_shard(tf.data.Dataset.range(8), "off")
print(json.dumps({"strategy": type(mirrored).__name__, "replicas": mirrored.num_replicas_in_sync,
                  "batch": ptf.global_batch(16, mirrored), "lr": ptf.scaled_lr(0.1, "sqrt", mirrored),
                  "policy_off": ds.options().experimental_distribute.auto_shard_policy
                  == tf.data.experimental.AutoShardPolicy.OFF,
                  "keras": tf.keras.__name__, "torch": "torch" in sys.modules, "workers": ptf.num_workers()}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**_env(), "TF_CPP_MIN_LOG_LEVEL": "3"},
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    assert facts["strategy"] == "MirroredStrategy" and facts["replicas"] == 2 and facts["batch"] == 32
    assert facts["lr"] == pytest.approx(0.1 * 2**0.5) and facts["policy_off"] is True
    assert "tf_keras" in facts["keras"] and facts["torch"] is False and facts["workers"] == 1


def test_two_nodes_from_the_torch_flags(tmp_path):
    """Two launchers on this host, as two nodes: --nnodes 2 --node-rank R --master-addr --master-port."""
    from paratrain.launcher.ports import free_port

    port = str(free_port())

    def node(rank: int) -> subprocess.Popen:
        return subprocess.Popen(
            [
                *PARATRAIN,
                "run",
                "--tf",
                "--nnodes",
                "2",
                "--node-rank",
                str(rank),
                "--master-addr",
                "127.0.0.1",
                "--master-port",
                port,
                "-n",
                "1",
                "-m",
                "paratrain.tf.demo_job",
                "--epochs",
                "1",
                "--out",
                str(tmp_path / f"n{rank}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=tmp_path,
        )

    nodes = [node(1), node(0)]
    outs = [p.communicate(timeout=150) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    result = json.loads((tmp_path / "n0.json").read_text())  # written by worker 0, on node 0
    assert result["workers"] == 2 and result["replicas"] == 2 and result["strategy"] == "MultiWorkerMirroredStrategy"
    assert not (tmp_path / "n1.json").exists()
    assert not _left_running(str(tmp_path))
