"""Disk and checkpoint faults, in one process: a full disk, a file where a folder belongs, damaged files.

Each must end in one line that names the problem (without torch's advice to load with ``weights_only=False``),
leave no partial folder or temporary file behind, and keep the previous checkpoint loadable.
"""

import errno
import os
import shutil
import subprocess
import time
from unittest import mock

import pytest
import torch.distributed.checkpoint.filesystem as dcp_fs
from helpers.faults import check
from helpers.faults_checkpoint import small_checkpoint, trained

import paratrain
from paratrain.checkpoint import layout
from paratrain.errors import CheckpointError


def _error(case: str, fn, *words: str, kept=()) -> str:
    with pytest.raises(CheckpointError) as info:
        fn()
    message = str(info.value)
    check(case, rc=2, stderr=f"paratrain: error: {message}", words=words, kept=kept)
    assert "weights_only=False" not in message and "Re-running" not in message
    return message


def _enospc(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("where", ["dcp", "rank file"])
def test_a_full_disk_names_the_disk_removes_the_partial_folder_and_keeps_the_last_checkpoint(tmp_path, where):
    par = paratrain.Parallel("single", monitor=False)
    model, opt = trained(par)
    first = par.save(tmp_path)
    with par.step(model, opt):
        par.backward(model(__import__("torch").randn(3, 4)).sum())
    target = (
        mock.patch.object(dcp_fs, "_write_item", _enospc)
        if where == "dcp"
        else mock.patch.object(layout, "write_file", _enospc)
    )
    with target:
        message = _error(
            f"checkpoint: disk full ({where})",
            lambda: par.save(tmp_path),
            "no space left on",
            "needs about",
            "is free",
            "step-00000001 is kept",
            kept=[str(first / "meta.json")],
        )
    assert " B," in message or "iB," in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]  # no tmp-step-* left
    assert layout.latest(tmp_path) == first
    par.load(tmp_path)  # the previous checkpoint still loads


def test_a_background_write_that_fails_is_one_line_at_the_next_step(tmp_path):
    """The disk fills while an asynchronous save is written: training went on, and the next step says so in one
    line; the partial folder is removed and the previous checkpoint stays the latest."""
    import torch

    par = paratrain.Parallel("single", monitor=False)
    model, opt = trained(par)
    first = par.save(tmp_path)
    with par.step(model, opt):
        par.backward(model(torch.randn(3, 4)).sum())
    with mock.patch.object(dcp_fs, "_write_item", _enospc):
        par.save(tmp_path, async_save=True)  # returns: the write fails in the background

        def next_step() -> None:
            for _ in range(100):  # the failure surfaces at the first step after the write ended
                with par.step(model, opt):
                    par.backward(model(torch.randn(3, 4)).sum())
                time.sleep(0.05)

        _error(
            "checkpoint: disk full (background write)",
            next_step,
            "no space left on",
            "step-00000001 is kept",
            kept=[str(first / "meta.json")],
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001"]
    par.load(tmp_path)


@pytest.mark.launched
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root to mount a tmpfs")
def test_a_real_full_tmpfs(tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        par = paratrain.Parallel("single", monitor=False)
        model = __import__("torch").nn.Linear(64, 64)  # 16 KiB of weights, 48 KiB with Adam's two moments
        model, opt = par.prepare(model, __import__("torch").optim.Adam(model.parameters()))
        with par.step(model, opt):
            par.backward(model(__import__("torch").randn(2, 64)).sum())
        first = par.save(disk)
        (disk / "filler").write_bytes(b"\0" * (shutil.disk_usage(disk).free - 8192))  # what the disk has left
        with par.step(model, opt):
            par.backward(model(__import__("torch").randn(2, 64)).sum())
        _error(
            "checkpoint: a real full tmpfs",
            lambda: par.save(disk),
            f"no space left on {disk} (tmpfs)",
            "step-00000001 is kept",
            kept=[str(first / "meta.json")],
        )
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "latest", "step-00000001"]
        par.load(disk)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


def test_save_into_a_file_is_one_line(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("keep me")
    par = paratrain.Parallel("single", monitor=False)
    trained(par)
    _error("checkpoint: save into a file", lambda: par.save(a_file), "it is a file", kept=[str(a_file)])
    assert a_file.read_text() == "keep me"


@pytest.mark.parametrize(
    "victim, words",
    [
        ("__0_0.distcp", ["is damaged or unsafe", "a tensor file cannot be read", "load an older checkpoint"]),
        ("train.pt", ["is damaged or unsafe: cannot load train.pt", "load an older checkpoint"]),
        (".metadata", ["is damaged: cannot read .metadata"]),
    ],
)
def test_a_damaged_file_is_named_without_torchs_unsafe_advice(tmp_path, victim, words):
    folder = small_checkpoint(tmp_path / "ck")
    path = folder / victim
    data = bytearray(path.read_bytes())
    for i in range(len(data)):  # same size, other bytes: only the contents are wrong
        data[i] = (data[i] * 7 + 3) % 256
    path.write_bytes(bytes(data))
    par = paratrain.Parallel("single", monitor=False)
    trained(par)
    _error(f"checkpoint: damaged {victim}", lambda: par.load(folder), *words)


def test_export_of_a_damaged_checkpoint_is_one_line(tmp_path):
    from paratrain.checkpoint.export import export

    folder = small_checkpoint(tmp_path / "ck")
    (folder / "__0_0.distcp").write_bytes(b"\0" * (folder / "__0_0.distcp").stat().st_size)
    _error("checkpoint: export of a damaged shard", lambda: export(folder, tmp_path / "m.pt"), "is damaged or unsafe")
    assert not (tmp_path / "m.pt").exists()
