"""Code nobody here wrote is the test: real clients train under ``paratrain run -n 2`` exactly as under their own
launcher (torchrun; ``accelerate launch`` for Accelerate) — the same final loss and weights, bit for bit, exit 0,
no worker left behind.

Each script in ``tests/clients/`` has every rank write its pid, and rank 0 write ``result.json``: the client's final
loss, each rank's own last loss, the world size, a checksum of the weights and how far the ranks' checksums differ.
Both launches get ``OMP_NUM_THREADS=1`` (torchrun's default; paratrain's is cores ÷ processes), so the numbers are
comparable exactly. The equality is not vacuous: equal weights on both ranks after each saw a different shard
(different local losses) show the ranks exchanged gradients, and one run with another seed shows the loss depends
on what was trained.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from helpers.paths import ROOT

from paratrain.testing import alive

pytestmark = pytest.mark.launched  # every test here starts processes

CLIENTS = ROOT / "tests" / "clients"
LAUNCH_TIMEOUT_S = 150
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
ACCELERATE = [
    sys.executable,
    "-m",
    "accelerate.commands.launch",
    "--multi_gpu",
    "--num_processes",
    "2",
    "--num_machines",
    "1",
    "--mixed_precision",
    "no",
    "--dynamo_backend",
    "no",
]
"""``--multi_gpu`` is Accelerate's torchrun path and works on CPU; ``--cpu --num_processes 2`` runs one process."""

CASES = {  # script: (package it needs, its own launcher)
    "torchrun_ddp.py": ("torch", TORCHRUN),
    "accelerate_script.py": ("accelerate", ACCELERATE),
    "hf_trainer.py": ("transformers", TORCHRUN),
    "lightning_ddp.py": ("lightning", TORCHRUN),
}


def _launch(launcher: list[str], script: str, out: Path, *args: str) -> tuple[int, dict, str, int]:
    """One job, killed as a whole past the timeout; then every rank it started must be gone.
    Returns the exit code, rank 0's result, the output and how many ranks reached the script's last line."""
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HOME": str(out / "hf"), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [*launcher, str(CLIENTS / script), str(out), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        log, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{' '.join(launcher[:3])} {script} ran past {LAUNCH_TIMEOUT_S} s:\n{log[-3000:]}")
    pids = [int(p.read_text()) for p in out.glob("rank*.pid")]
    assert len(pids) == 2, f"{len(pids)} ranks started:\n{log[-3000:]}"
    assert not alive(pids), f"workers left behind: {alive(pids)}"
    result = out / "result.json"
    done = len(list(out.glob("rank*.done")))
    return proc.returncode, json.loads(result.read_text()) if result.exists() else {}, log, done


def _check_own_exit(rc: int, log: str, done: int) -> None:
    """The reference launcher must succeed too, with one known exception: plain torchrun can lose a rank that has
    finished its script to SIGABRT (``terminate called without an active exception``) or SIGSEGV while the
    interpreter tears down (gloo's threads; ``benchmarks/RESULTS.md`` §15). That is tolerated there only after
    every rank reached the script's last line; ``paratrain run`` must exit 0 every time."""
    if rc != 0:
        assert done == 2 and ("SIGABRT" in log or "SIGSEGV" in log), log[-3000:]
        warnings.warn(f"the reference launcher lost a finished rank at exit (exit code {rc})", stacklevel=2)


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)  # the two launches run side by side
@pytest.mark.parametrize("script", list(CASES))
def test_a_client_trains_the_same_under_paratrain_run_as_under_its_own_launcher(script, paratrain_cmd, tmp_path):
    package, own = CASES[script]
    pytest.importorskip(package, reason=f"{package} is not installed")
    with ThreadPoolExecutor(2) as pool:  # the two jobs overlap: 4 ranks on 2 cores, but half the wall time
        theirs = pool.submit(_launch, own, script, tmp_path / "own")
        ours = pool.submit(_launch, [*paratrain_cmd, "run", "-n", "2"], script, tmp_path / "paratrain")
        (own_rc, own_result, own_log, own_done), (rc, result, log, done) = theirs.result(), ours.result()
    assert rc == 0 and done == 2, log[-3000:]
    _check_own_exit(own_rc, own_log, own_done)
    assert result["world"] == 2 and result["spread"] == 0.0, result  # the ranks ended with the same weights,
    assert result["rank_losses"][0] != result["rank_losses"][1], result  # each from its own shard of the data
    assert result == own_result


@pytest.mark.timeout(LAUNCH_TIMEOUT_S + 30)
def test_the_loss_compared_depends_on_the_training(paratrain_cmd, tmp_path):
    """Another seed, another loss: the comparison above would notice a client that trains differently."""
    with ThreadPoolExecutor(2) as pool:
        runs = list(
            pool.map(
                lambda seed: _launch(
                    [*paratrain_cmd, "run", "-n", "2"], "torchrun_ddp.py", tmp_path / f"seed{seed}", str(seed)
                ),
                (0, 1),
            )
        )
    assert [rc for rc, *_ in runs] == [0, 0], runs[0][2][-3000:] + runs[1][2][-3000:]
    (_, seed0, *_), (_, seed1, *_) = runs
    assert seed0["loss"] != seed1["loss"] and seed0["params"] != seed1["params"]
