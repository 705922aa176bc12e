"""Ray Train: ``ray_train_loop`` runs a script as ``paratrain run`` would (``__main__``, its argv, the driver's
directory) inside a worker whose group Ray made; on a real local Ray cluster with 2 CPU workers a paratrain script,
unchanged, ends with the parameters it ends with under ``paratrain run -n 2`` (ddp and zero3)."""

from __future__ import annotations

import json
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers.cli import run_cli
from helpers.paths import SCRIPTS

from paratrain import LaunchError, ray_train_loop
from paratrain.testing import alive

SHOW_ARGV = "import os, sys\nopen('seen.txt', 'w').write(repr((__name__, sys.argv, os.getcwd())))\n"


@pytest.fixture
def one_rank_group():
    """What a Ray Train worker has before it calls the function: a process group, and RANK/WORLD_SIZE."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")


def test_the_loop_runs_the_script_as_main_in_the_drivers_directory_and_puts_everything_back(
    tmp_path, monkeypatch, one_rank_group
):
    (tmp_path / "show.py").write_text(SHOW_ARGV)
    monkeypatch.chdir(tmp_path)
    loop = pickle.loads(pickle.dumps(ray_train_loop("show.py", "--lr", "3e-4")))  # Ray pickles it to each worker
    ray_dir = tmp_path / "ray-run"
    ray_dir.mkdir()
    monkeypatch.chdir(ray_dir)  # where Ray Train puts a worker
    argv, path = list(sys.argv), list(sys.path)
    loop()
    assert eval((tmp_path / "seen.txt").read_text()) == (
        "__main__",
        [str(tmp_path / "show.py"), "--lr", "3e-4"],
        str(tmp_path),
    )
    assert (sys.argv, sys.path, os.getcwd()) == (argv, path, str(ray_dir))
    ray_train_loop(str(tmp_path / "show.py"), cwd=None)()  # cwd=None: stay where Ray Train put the worker
    assert eval((ray_dir / "seen.txt").read_text())[2] == str(ray_dir)


def test_a_script_that_exits_with_an_error_status_fails_the_worker(tmp_path, one_rank_group):
    (tmp_path / "ok.py").write_text("import sys\nsys.exit(0)\n")
    (tmp_path / "bad.py").write_text("import sys\nsys.exit(3)\n")
    ray_train_loop("ok.py", cwd=tmp_path)()
    with pytest.raises(LaunchError, match=r"bad.py exited with status 3$"):
        ray_train_loop("bad.py", cwd=tmp_path)()


def test_misuse_is_one_line(tmp_path, one_rank_group):
    with pytest.raises(LaunchError, match=f"^script {tmp_path}/nope.py not found on "):
        ray_train_loop("nope.py", cwd=tmp_path)()
    with pytest.raises(LaunchError, match="does not exist on .*: pass ray_train_loop\\(cwd=…\\)"):
        ray_train_loop("x.py", cwd=tmp_path / "gone")()
    dist.destroy_process_group()
    with pytest.raises(LaunchError, match="^ray_train_loop is the function a Ray Train worker runs after Ray "):
        ray_train_loop("x.py", cwd=tmp_path)()


def _session(sid: int) -> list[int]:
    """The processes of session ``sid``: the driver started with ``start_new_session`` and every Ray process it
    started (raylet, GCS, workers) stay in it."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and int(fields[3]) == sid:
            pids.append(int(entry.name))
    return alive(pids)


@pytest.mark.launched
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_a_ray_train_job_equals_the_same_script_under_paratrain_run(tmp_path):
    pytest.importorskip("ray.train", reason="Ray Train is the extra paratrain[ray]")
    train = str(SCRIPTS / "cluster_train.py")
    for strategy in ("ddp", "zero3"):
        (tmp_path / "run" / strategy).mkdir(parents=True)
        res = run_cli("run", "-n", "2", train, tmp_path / "run" / strategy, "--strategy", strategy, timeout=90)
        assert res.returncode == 0, res.stderr
    temp = tempfile.mkdtemp(prefix="pt-ray-", dir="/tmp")  # Ray's socket paths must stay short
    (tmp_path / "ray").mkdir()
    driver = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "ray_train_job.py"), str(tmp_path / "ray"), temp],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"},
    )
    try:
        log, _ = driver.communicate(timeout=300)
        left = _session(driver.pid)
    finally:
        for pid in _session(driver.pid):
            os.kill(pid, signal.SIGKILL)
        driver.kill()
        driver.wait()
        subprocess.run(["rm", "-rf", temp], timeout=60)
    assert driver.returncode == 0, log[-6000:]
    assert left == [], "the Ray cluster outlived the driver's ray.shutdown()"
    for strategy, init_method_env in (("ddp", True), ("zero3", False)):
        ranks = [json.loads((tmp_path / "ray" / strategy / f"rank{r}.json").read_text()) for r in range(2)]
        assert [(r["rank"], r["world"], r["local_rank"]) for r in ranks] == [(0, 2, 0), (1, 2, 1)]
        assert all(r["group_before"] and r["master_addr_set"] is init_method_env for r in ranks)
        got = torch.load(tmp_path / "ray" / strategy / "params.pt")
        want = torch.load(tmp_path / "run" / strategy / "params.pt")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), strategy
