"""Checkpoints in one process: exact resume, the folder layout, atomic commits, safe loading, bad input, export."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.checkpoint_workers import dropout_model, train
from helpers.paths import SCRIPTS
from torch import nn

import paratrain
from paratrain.checkpoint import export, latest
from paratrain.errors import CheckpointError, ConfigError


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("accumulate", [1, 2])
def test_resume_mid_epoch_in_one_process_is_bitwise_exact(tmp_path, accumulate):
    options = {"accumulate": accumulate}
    whole = train("single", 18, str(tmp_path), save_at=7, options=options)  # 12 batches per epoch
    resumed = train("single", 18, str(tmp_path), load=True, options=options)
    assert resumed["resumed_at"] == (7, 7 * accumulate // 12)  # inside epoch 0, or 1 with accumulation
    assert resumed["batches"] == whole["batches"][7 * accumulate :]  # no batch replayed or skipped
    assert _equal(whole["params"], resumed["params"]) and _equal(whole["optim"], resumed["optim"])
    assert whole["lr"] == resumed["lr"]


def test_layout_keeps_the_newest_and_moves_latest_last(tmp_path):
    par = paratrain.Parallel("single", checkpoint=paratrain.CheckpointConfig(dir=str(tmp_path), keep=2))
    model = nn.Linear(2, 2)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(1, 4):
        with par.step(model, opt):
            par.backward(model(torch.ones(1, 2)).sum())
        assert par.save() == tmp_path / f"step-{step:08d}"
        assert (tmp_path / "latest").read_text() == f"step-{step:08d}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002", "step-00000003"]
    meta = json.loads((tmp_path / "step-00000003" / "meta.json").read_text())
    assert meta["step"] == 3 and meta["world_size"] == 1 and meta["optimizers"] == ["SGD"]
    (tmp_path / "latest").unlink()  # a lost pointer: the newest complete folder is taken
    assert latest(tmp_path) == tmp_path / "step-00000003"
    (tmp_path / "tmp-step-00000009").mkdir()  # a crashed save: never read, cleared by the next save
    assert latest(tmp_path) == tmp_path / "step-00000003"
    par.save()
    assert not (tmp_path / "tmp-step-00000009").exists()


def test_automatic_checkpoints_every_n_steps(tmp_path):
    train(
        "single",
        7,
        str(tmp_path / "d"),
        options={"checkpoint": paratrain.CheckpointConfig(dir=str(tmp_path / "d"), every=3)},
    )
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["latest", "step-00000003", "step-00000006"]


@pytest.mark.launched
@pytest.mark.parametrize("how", ["blocking", "async"])
@pytest.mark.parametrize("where", ["data", "publish"])
def test_a_crash_during_save_leaves_the_previous_checkpoint_loadable(tmp_path, where, how):
    res = subprocess.run(
        [
            sys.executable,
            str(SCRIPTS / "crash_during_save.py"),
            str(tmp_path),
            where,
            *(["async"] if how == "async" else []),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == -9, res.stderr  # SIGKILLed in the middle of the second save
    assert (tmp_path / "ckpt" / "latest").read_text() == "step-00000002"
    saved = torch.load(tmp_path / "params-at-2.pt", weights_only=True)
    assert _equal(_load_params(tmp_path / "ckpt"), saved)


def _load_params(path: Path) -> dict[str, torch.Tensor]:
    par = paratrain.Parallel("single")
    model = par.prepare(dropout_model())
    par.load(path)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def saved(tmp_path) -> Path:
    """A checkpoint of the dropout MLP with Adam after 3 steps."""
    train("single", 3, str(tmp_path / "ckpt"), save_at=3)
    return tmp_path / "ckpt" / "step-00000003"


def test_a_truncated_file_is_named(saved):
    data = saved / "__0_0.distcp"
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"damaged: __0_0.distcp has 100 bytes, \d+ were written"):
        train("single", 0, str(saved.parent), load=True)


@pytest.mark.parametrize("name", [".metadata", "train.pt", "rank-00000.pt"])
def test_garbage_in_any_file_is_a_one_line_error(saved, name):
    target = saved / name
    target.write_bytes(os.urandom(target.stat().st_size))  # same size: only the content can tell
    with pytest.raises(CheckpointError, match="damaged") as info:
        train("single", 0, str(saved.parent), load=True)
    assert "\n" not in str(info.value)


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


@pytest.mark.parametrize("name", [".metadata", "train.pt"])
def test_loading_never_runs_code_from_a_checkpoint(saved, name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _replace(saved, name, pickle.dumps(_Payload()) if name == ".metadata" else _torch_bytes({"step": _Payload()}))
    with pytest.raises(CheckpointError, match="refusing|unsafe"):
        train("single", 0, str(saved.parent), load=True)
    if name == ".metadata":
        with pytest.raises(CheckpointError, match="refusing to load .*refers to posix.system"):
            export(saved, tmp_path / "out.pt")
    assert not (tmp_path / "PWNED").exists()


def _torch_bytes(obj: object) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _replace(folder: Path, name: str, data: bytes) -> None:
    """Swap a file and keep meta.json consistent, as a crafted checkpoint would."""
    (folder / name).write_bytes(data)
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][name] = len(data)
    (folder / "meta.json").write_text(json.dumps(meta))


def test_an_unsafe_optimizer_value_is_refused(tmp_path):
    par = paratrain.Parallel("single")
    model = nn.Linear(2, 2)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with par.step(model, opt):
        par.backward(model(torch.ones(1, 2)).sum())
    opt.param_groups[0]["note"] = _Payload()  # any object in a param group is pickled into the checkpoint
    par.save(tmp_path)
    with pytest.raises(CheckpointError, match="refusing to load the value of 'optim.param_groups.weight.note'"):
        par.load(tmp_path)


def test_a_checkpoint_of_another_model_or_optimizer_is_refused(saved):
    def load_into(model: nn.Module, optimizer: type = torch.optim.Adam) -> None:
        par = paratrain.Parallel("single")
        model, opt = par.prepare(model, optimizer(model.parameters(), lr=0.1))
        par.load(saved)

    wider = nn.Sequential(nn.Linear(8, 33), nn.Tanh(), nn.Dropout(0.1), nn.Linear(33, 32), nn.Tanh(), nn.Linear(32, 4))
    with pytest.raises(CheckpointError, match=r"different shapes: model.0.bias \(saved \(32,\), here \(33,\)\)"):
        load_into(wider)
    deeper = nn.Sequential(*dropout_model(), nn.Linear(4, 4))
    with pytest.raises(CheckpointError, match=r"2 entries missing from it \(model.6.bias, model.6.weight\)"):
        load_into(deeper)
    with pytest.raises(CheckpointError, match="this job lacks"):
        load_into(nn.Sequential(nn.Linear(8, 32)))
    with pytest.raises(CheckpointError, match="saved with optimizer.s. Adam; this job uses SGD"):
        load_into(dropout_model(), torch.optim.SGD)


def test_missing_checkpoints_and_bad_options(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        train("single", 0, str(tmp_path / "nowhere"), load=True)
    with pytest.raises(CheckpointError, match="no complete step"):
        train("single", 0, str(tmp_path), load=True)
    with pytest.raises(ConfigError, match="checkpoint every needs a checkpoint directory"):
        paratrain.Parallel("single", checkpoint=paratrain.CheckpointConfig(every=5))
    with pytest.raises(ConfigError, match="checkpoint keep must be >= 1"):
        paratrain.CheckpointConfig(dir=str(tmp_path), keep=0)
    with pytest.raises(ConfigError, match="a directory or a paratrain.CheckpointConfig"):
        paratrain.Parallel("single", checkpoint=5)
    par = paratrain.Parallel("single", accumulate=2)
    model = nn.Linear(2, 2)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(CheckpointError, match="no checkpoint path given"):
        par.save()
    with par.step(model, opt):
        par.backward(model(torch.ones(1, 2)).sum())
    with pytest.raises(CheckpointError, match="inside an accumulation window"):
        par.save(tmp_path)
    with pytest.raises(ConfigError, match="scheduler is not built on an optimizer that prepare"):
        par.prepare(torch.optim.lr_scheduler.StepLR(torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1), 1))


def test_export_writes_a_plain_state_dict(saved, tmp_path, capsys):
    from paratrain.cli.main import main

    assert main(["export", str(saved.parent), str(tmp_path / "model.pt")]) == 0
    out = capsys.readouterr().out
    assert "6 tensors" in out and "(step 3)" in out
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert _equal(state, _load_params(saved))
    dropout_model().load_state_dict(state)  # plain names, no wrapper prefix
    assert main(["export", str(tmp_path / "none"), str(tmp_path / "x.pt")]) == 2
    assert capsys.readouterr().err.startswith("paratrain: error: no checkpoint at")


def test_the_former_checkpoint_keywords_still_work_and_say_what_to_write(tmp_path):
    with pytest.warns(FutureWarning, match=r"checkpoint=paratrain.CheckpointConfig\(dir=.*, every=3\)"):
        par = paratrain.Parallel("single", checkpoint_dir=str(tmp_path), checkpoint_every=3, monitor=False)
    assert (par.checkpoint_config.dir, par.checkpoint_config.every) == (str(tmp_path), 3)
    par.close()
    with pytest.raises(ConfigError, match="put them all in CheckpointConfig"):
        paratrain.Parallel("single", checkpoint=str(tmp_path), resume=True)


def test_a_checkpoint_directory_alone_and_the_launchers_variables(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CHECKPOINT_EVERY", "7")
    par = paratrain.Parallel("single", checkpoint=tmp_path, monitor=False)
    assert (par.checkpoint_config.dir, par.checkpoint_config.every) == (str(tmp_path), 7)
    par.close()
