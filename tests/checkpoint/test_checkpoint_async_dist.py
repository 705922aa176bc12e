"""Asynchronous saves across processes, under every strategy: training goes on while the save is written, the
checkpoint is bitwise the blocking save's, and a job resumed from it ends bitwise where the saving job ended."""

from pathlib import Path

import pytest
import torch
from helpers.checkpoint_async_workers import CASES, SAVE_AT, run_cases, run_ps

from paratrain.checkpoint.safety import SafeReader
from paratrain.testing import alive, child_pids, spawn

pytestmark = [pytest.mark.launched, pytest.mark.slow]


def _differ(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def _files(folder: Path) -> dict[str, object]:
    """Every file of a checkpoint folder, as bytes; DCP's ``.metadata`` as its index (it also names the folder it
    was written into and a random id), ``meta.json`` left out (it says when it was saved)."""
    out: dict[str, object] = {}
    for p in sorted(folder.rglob("*")):
        if p.name == ".metadata":
            index = SafeReader(p.parent).read_metadata()
            out[p.relative_to(folder).as_posix()] = (index.state_dict_metadata, index.storage_data, index.planner_data)
        elif p.is_file() and p.name != "meta.json":
            out[p.relative_to(folder).as_posix()] = p.read_bytes()
    return out


def _same_checkpoint(blocking: Path, background: Path) -> None:
    a, b = _files(blocking), _files(background)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    assert [name for name in a if a[name] != b[name]] == []


@pytest.mark.timeout(300)
def test_every_strategy_saves_in_the_background_bitwise_as_a_blocking_save(tmp_path):
    got = spawn(run_cases, 2, (str(tmp_path),), timeout_s=280)[0]
    step = f"step-{SAVE_AT:08d}"
    for index, (strategy, _) in enumerate(CASES):
        runs = got[strategy]
        assert "error" not in runs, (strategy, runs)
        blocking, background, resumed = runs["blocking"], runs["async"], runs["resumed"]
        assert blocking["published_on_return"] and not background["published_on_return"], strategy  # written later
        assert _differ(blocking["params"], background["params"]) == [], strategy  # saving changed nothing
        base = tmp_path / f"{index}-{strategy}"
        _same_checkpoint(base / "blocking" / step, base / "async" / step)
        assert resumed["batches"] == background["batches"][SAVE_AT:], strategy
        assert _differ(background["params"], resumed["params"]) == [], f"{strategy}: the resume differs"
        assert _differ(background["optim"], resumed["optim"]) == [] and background["lr"] == resumed["lr"], strategy
    assert not alive(child_pids())


@pytest.mark.timeout(200)
def test_parameter_servers_write_their_shards_in_the_background(tmp_path):
    got = spawn(run_ps, 4, (str(tmp_path),), timeout_s=180)[0]
    assert not got["published_on_return"]
    assert _differ(got["saved"], got["loaded"]) == []  # what the servers held at the save, not after
    assert _differ(got["first"], got["again"]) == []
    _same_checkpoint(tmp_path / "blocking" / "step-00000002", tmp_path / "async" / "step-00000002")
    assert not alive(child_pids())
