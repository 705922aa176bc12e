"""Asynchronous saves in one process: training goes on while the save is written, ``latest`` moves once it is
complete, one save is in flight at a time, what changes the state waits for the background copy, automatic saves
resume bitwise, a script that never closes still publishes its last save, and the configuration's bad input is one
line; the stager's CUDA choices, on CPU."""

import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch
from helpers.checkpoint_workers import dropout_model, train
from helpers.paths import SCRIPTS
from torch import nn
from torch.distributed.checkpoint import staging
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.filesystem import _FileSystemWriter

import paratrain
from paratrain.checkpoint import CheckpointConfig, background
from paratrain.errors import CheckpointError, ConfigError


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture
def held_writes(monkeypatch) -> threading.Event:
    """DCP's writes wait until the event is set."""
    release = threading.Event()
    write_data = _FileSystemWriter.write_data

    def held(self, *args, **kwargs):
        assert release.wait(30), "the test never released the write"
        return write_data(self, *args, **kwargs)

    monkeypatch.setattr(_FileSystemWriter, "write_data", held)
    return release


@pytest.fixture
def held_staging(monkeypatch) -> threading.Event:
    """The stager's background copies wait until the event is set."""
    release = threading.Event()
    stage = StateDictStager.stage

    def held(self, *args, **kwargs):
        assert release.wait(30), "the test never released the copy"
        return stage(self, *args, **kwargs)

    monkeypatch.setattr(StateDictStager, "stage", held)
    return release


def _job(root) -> tuple[paratrain.Parallel, nn.Module, torch.optim.Optimizer]:
    par = paratrain.Parallel("single", seed=0, monitor=False, checkpoint=str(root))
    model = dropout_model()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    return par, model, opt


def _step(par, model, opt) -> None:
    with par.step(model, opt):
        par.backward(model(torch.randn(4, 8)).pow(2).mean())


def test_training_goes_on_while_the_save_is_written_and_latest_moves_once_it_is_complete(tmp_path, held_writes):
    par, model, opt = _job(tmp_path)
    _step(par, model, opt)
    held_writes.set()
    par.save()  # step 1, blocking
    held_writes.clear()
    _step(par, model, opt)
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    folder = par.save(async_save=True)
    assert folder == tmp_path / "step-00000002" and not folder.exists()
    for _ in range(3):  # the write is held: these steps change the parameters it is writing
        _step(par, model, opt)
    assert (tmp_path / "latest").read_text() == "step-00000001" and (tmp_path / "tmp-step-00000002").is_dir()
    held_writes.set()
    par.close()  # waits for the write and publishes it
    assert (tmp_path / "latest").read_text() == "step-00000002"
    fresh, loaded, _ = _job(tmp_path)
    fresh.load(folder)
    assert _equal(loaded.state_dict(), at_save)  # what was staged at the save, not what training made of it after


def test_a_new_save_waits_for_the_one_in_flight(tmp_path, held_writes):
    par, model, opt = _job(tmp_path)
    _step(par, model, opt)
    par.save(async_save=True)
    _step(par, model, opt)
    threading.Timer(0.5, held_writes.set).start()
    start = time.perf_counter()
    par.save(async_save=True)  # step 2: first the save of step 1 is written and published
    assert time.perf_counter() - start >= 0.5
    assert (tmp_path / "latest").read_text() == "step-00000001"
    par.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000001", "step-00000002"]


def _snapshot(model: nn.Module, opt: torch.optim.Optimizer) -> dict:
    return {
        **{k: v.clone() for k, v in model.state_dict().items()},
        **{f"{i}.{k}": v.clone() for i, s in opt.state_dict()["state"].items() for k, v in s.items()},
    }


def _saved(folder, model: nn.Module) -> dict:
    """What ``folder`` holds, loaded into a fresh job with ``model``'s architecture."""
    par = paratrain.Parallel("single", seed=0, monitor=False)
    loaded, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2))
    par.load(folder)
    return _snapshot(loaded, opt)


def _after(seconds: float, release: threading.Event) -> float:
    """Set ``release`` in ``seconds``; returns the time now."""
    threading.Timer(seconds, release.set).start()
    return time.perf_counter()


def test_the_next_optimizer_step_waits_for_the_background_copy(tmp_path, held_staging):
    par, model, opt = _job(tmp_path)
    _step(par, model, opt)
    at_save = _snapshot(model, opt)
    folder = par.save(async_save=True)  # returns while the copy is held
    start = _after(0.5, held_staging)
    model(torch.randn(4, 8)).sum().backward()  # no saved buffer: the forward and backward go on meanwhile
    assert time.perf_counter() - start < 0.4
    opt.step()  # the optimizer changes the state being copied: it waits (an optimizer stepped by hand too)
    assert time.perf_counter() - start >= 0.5
    _step(par, model, opt)
    par.close()
    assert _equal(_saved(folder, dropout_model()), at_save)  # the step it was asked at, not a torn mix


def test_a_forward_that_changes_saved_buffers_waits_for_the_background_copy(tmp_path, held_staging):
    par = paratrain.Parallel("single", seed=0, monitor=False, checkpoint=str(tmp_path))
    model, opt = par.prepare(net := _batch_norm_model(), torch.optim.Adam(net.parameters(), lr=1e-2))
    _step(par, model, opt)
    at_save = _snapshot(model, opt)
    folder = par.save(async_save=True)
    start = _after(0.5, held_staging)
    model(torch.randn(4, 8))  # training mode: BatchNorm updates its running statistics in place
    assert time.perf_counter() - start >= 0.5
    par.close()
    assert _equal(_saved(folder, _batch_norm_model()), at_save)


def test_a_copy_that_fails_is_one_line_where_its_save_is_published(tmp_path, monkeypatch):
    def fails(self, *args, **kwargs):
        raise RuntimeError("cannot allocate memory")

    monkeypatch.setattr(StateDictStager, "stage", fails)
    par, model, opt = _job(tmp_path)
    _step(par, model, opt)
    par.save(async_save=True)
    with pytest.raises(
        CheckpointError,
        match=r"^could not write checkpoint .*tmp-step-00000001: .*cannot allocate "
        r"memory$",
    ):
        for _ in range(100):  # the failure surfaces at the first step after the write ended, nothing waits forever
            _step(par, model, opt)
            time.sleep(0.05)
    assert not (tmp_path / "tmp-step-00000001").exists()
    par.close()


def _batch_norm_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))


def test_the_stager_pins_on_cuda_only_and_copies_without_blocking_from_one_gpu_only():
    cpu, gpu, gpus = (background.staging_options(n) for n in (0, 1, 2))
    assert (cpu.use_pinned_memory, cpu.use_non_blocking_copy, cpu.use_async_staging) == (False, False, True)
    assert (gpu.use_pinned_memory, gpu.use_non_blocking_copy, gpu.use_async_staging) == (True, True, True)
    assert (gpus.use_pinned_memory, gpus.use_non_blocking_copy, gpus.use_async_staging) == (True, False, True)
    assert not any(o.use_shared_memory for o in (cpu, gpu, gpus))  # the writer is a thread of this process
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when asked to pin without CUDA
        background.new_stager([]).close()
    assert background.state_gpus([_batch_norm_model()]) == []


def test_on_cuda_the_stager_copies_on_the_states_device_what_the_last_step_computed(monkeypatch):
    """On CPU, with torch.cuda's device context and current stream recorded: the stager makes its copy stream on
    the state's device (not GPU 0's), and the kernels that computed the state finish before it copies."""
    seen: list = []

    class Device:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            seen.append(("enter", self.device))

        def __exit__(self, *exc):
            seen.append(("exit", self.device))

    class Stream:
        def synchronize(self):
            seen.append("synchronized")

    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(staging, "DefaultStager", lambda options: seen.append(("stager", options.use_pinned_memory)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: seen.append(("stream", device)) or Stream())
    gpu1, gpu2 = torch.device("cuda", 1), torch.device("cuda", 2)
    background.new_stager([gpu1])
    background.computed([gpu1])
    background.computed([])  # nothing to wait for on the CPU
    assert seen == [("enter", gpu1), ("stager", True), ("exit", gpu1), ("stream", gpu1), "synchronized"]
    seen.clear()
    background.new_stager([gpu1, gpu2])  # a model split over two GPUs: blocking copies, on each device's stream
    background.computed([gpu1, gpu2])
    assert seen == [("stager", True), ("stream", gpu1), "synchronized", ("stream", gpu2), "synchronized"]


def test_automatic_saves_in_the_background_resume_bitwise(tmp_path):
    def config(root, background: bool) -> dict:
        return {"checkpoint": CheckpointConfig(dir=str(root), every=5, async_save=background)}

    blocking = train("single", 18, str(tmp_path / "b"), options=config(tmp_path / "b", False))
    background = train("single", 18, str(tmp_path / "a"), options=config(tmp_path / "a", True))
    assert _equal(blocking["params"], background["params"])
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "latest",
        "step-00000005",
        "step-00000010",
        "step-00000015",
    ]
    for name in ("__0_0.distcp", "train.pt", "rank-00000.pt"):
        assert (tmp_path / "a" / "step-00000015" / name).read_bytes() == (
            tmp_path / "b" / "step-00000015" / name
        ).read_bytes()
    resumed = train("single", 18, str(tmp_path / "a"), load=True)
    assert resumed["resumed_at"] == (15, 1) and resumed["batches"] == background["batches"][15:]
    assert _equal(background["params"], resumed["params"]) and _equal(background["optim"], resumed["optim"])


@pytest.mark.launched
def test_a_script_that_never_closes_still_publishes_its_last_save(tmp_path):
    res = subprocess.run(
        [sys.executable, str(SCRIPTS / "async_save_then_exit.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "latest").read_text() == "step-00000002" and (tmp_path / "step-00000002" / "meta.json").exists()


def test_the_launchers_variable_and_bad_configurations_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("PARATRAIN_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("PARATRAIN_CHECKPOINT_ASYNC", "1")
    config = CheckpointConfig.of(None)
    assert config.async_save and config.environ()["PARATRAIN_CHECKPOINT_ASYNC"] == "1"
    monkeypatch.delenv("PARATRAIN_CHECKPOINT_DIR")
    with pytest.raises(
        ConfigError,
        match=r"^checkpoint async_save needs a checkpoint directory; give "
        r"CheckpointConfig\(dir=\.\.\.\) \(or paratrain run --checkpoint-dir\)$",
    ):
        CheckpointConfig.of(None)

    import torch.distributed.checkpoint as dcp

    monkeypatch.setattr(
        dcp, "async_save", lambda state_dict, *, storage_writer=None, planner=None, process_group=None: None
    )  # the signature of torch 2.6's
    with pytest.raises(
        ConfigError,
        match=r"^asynchronous checkpoints need torch >= 2\.9 \(this is .*\); upgrade "
        r"torch or save without async_save",
    ):
        paratrain.Parallel("single", monitor=False, checkpoint=CheckpointConfig(dir=str(tmp_path), async_save=True))
