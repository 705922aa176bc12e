"""Experiment trackers: ``log_with`` and ``par.log`` refuse bad input in one line; TensorBoard and MLflow files
written by one process hold the run's configuration once, the script's metrics and the monitor's figures at the
expected steps; a 2-process gloo job writes TensorBoard, W&B (offline) and MLflow (sqlite) from rank 0 alone."""

import importlib.util
import math

import pytest
import torch
from helpers.tracker_files import mlflow_runs, tensorboard_runs, wandb_runs
from helpers.tracker_workers import BATCH, EVERY, FLOPS_PER_SAMPLE, PEAK_TFLOPS, SEQ, STEPS, tracked_runs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.errors import ConfigError
from paratrain.monitor import (
    MLflowConfig,
    MonitorConfig,
    RankStats,
    TensorBoardConfig,
    TrackerConfig,
    Trackers,
    WandbConfig,
    tracker_config,
)
from paratrain.monitor.figures import catalogue_peak_flops, job_figures
from paratrain.monitor.recorder import batch_size_of
from paratrain.testing import spawn

GIB = 1024**3
LOCAL = {"MLFLOW_DISABLE_TELEMETRY": "true", "DO_NOT_TRACK": "true", "WANDB_ERROR_REPORTING": "false"}
"""Nothing leaves the machine: MLflow's usage telemetry and W&B's error reports off (W&B runs offline)."""
HAS = {name: importlib.util.find_spec(name) is not None for name in ("tensorboard", "wandb", "mlflow", "sqlalchemy")}
needs_tensorboard = pytest.mark.skipif(not HAS["tensorboard"], reason="pip install 'paratrain[tensorboard]'")
needs_mlflow = pytest.mark.skipif(not (HAS["mlflow"] and HAS["sqlalchemy"]), reason="pip install 'paratrain[mlflow]'")
needs_all = pytest.mark.skipif(not all(HAS.values()), reason="pip install 'paratrain[tensorboard,wandb,mlflow]'")


@pytest.fixture(autouse=True)
def local_only(monkeypatch):
    for name, value in LOCAL.items():
        monkeypatch.setenv(name, value)


# ----------------------------------------------------------------- log_with and par.log: input
@needs_all
def test_log_with_takes_names_configs_lists_or_a_tracker_config(tmp_path):
    assert tracker_config(None) is None
    one = tracker_config("tensorboard")
    assert [type(t) for t in one.trackers] == [TensorBoardConfig] and one.project == "paratrain"
    mixed = tracker_config(["MLflow", WandbConfig(mode="offline")])
    assert [t.name for t in mixed.trackers] == ["mlflow", "wandb"] and mixed.trackers[1].mode == "offline"
    full = TrackerConfig(trackers="wandb", project="p", dir=str(tmp_path))
    assert tracker_config(full) is full and full.run.dir == tmp_path and full.run.project == "p"


@pytest.mark.parametrize(
    "log_with, message",
    [
        ("tensorbord", "unknown tracker 'tensorbord'; choose from: tensorboard, wandb, mlflow"),
        ([], "names at least one tracker"),
        (42, "a tracker is a name (tensorboard, wandb, mlflow) or paratrain.TensorBoardConfig"),
        (TrackerConfig, "a tracker is a name"),
    ],
)
def test_a_bad_log_with_is_one_line(log_with, message):
    with pytest.raises(ConfigError) as err:
        paratrain.Parallel("single", log_with=log_with)
    assert message in str(err.value) and "\n" not in str(err.value)


@needs_all
def test_bad_tracker_options_are_one_line():
    with pytest.raises(ConfigError, match="each tracker at most once, got tensorboard, tensorboard"):
        TrackerConfig(trackers=["tensorboard", TensorBoardConfig(dir="x")])
    with pytest.raises(ConfigError, match="TrackerConfig.project must be a non-empty string"):
        TrackerConfig(trackers="tensorboard", project="")
    with pytest.raises(ConfigError, match="TrackerConfig.config is a dict of hyperparameters"):
        TrackerConfig(trackers="tensorboard", config=["lr", 0.1])
    with pytest.raises(ConfigError, match="WandbConfig.mode must be one of online, offline, disabled"):
        WandbConfig(mode="ofline")
    with pytest.raises(ConfigError, match="MonitorConfig.flops_per_sample must be a number > 0"):
        MonitorConfig(flops_per_sample=0)


@pytest.mark.parametrize(
    "tracker, missing, extra",
    [
        ("tensorboard", "tensorboard", "tensorboard"),
        ("wandb", "wandb", "wandb"),
        ("mlflow", "mlflow", "mlflow"),
        ("mlflow", "sqlalchemy", "mlflow"),
    ],
)
def test_a_tracker_not_installed_is_one_line_naming_the_extra(monkeypatch, tracker, missing, extra):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ConfigError) as err:
        paratrain.Parallel("single", log_with=tracker)
    assert f"needs the {missing} package: pip install 'paratrain[{extra}]'" in str(err.value)


@needs_tensorboard
def test_bad_metrics_and_steps_are_one_line_on_every_rank(tmp_path):
    tracking = Trackers(TrackerConfig(trackers="tensorboard", dir=tmp_path), active=False)  # a rank other than 0
    for metrics, step, message in [
        ({"loss": "low"}, 0, "par.log: 'loss' is a str, not a number"),
        ({"loss": torch.ones(3)}, 0, "'loss' is a tensor of 3 elements; log one number (loss.item(), or par.mean"),
        ([("loss", 1.0)], 0, "par.log takes a dict of names to numbers, got list"),
        ({"": 1.0}, 0, "metric names are non-empty strings"),
        ({"loss": 1.0}, -1, "step must be an integer >= 0 (an optimizer step"),
        ({"loss": 1.0}, 1.5, "got 1.5"),
        ({"loss": 1.0}, True, "got True"),
    ]:
        with pytest.raises(ConfigError, match="par.log") as err:
            tracking.log(metrics, step)
        assert message in str(err.value)
    assert not any(tmp_path.iterdir())  # nothing opened, nothing written


def test_par_log_without_trackers_only_checks(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    par = paratrain.Parallel("single", monitor=False)
    par.log({"loss": torch.tensor(0.5), "lr": 1e-3, "n": 3})
    with pytest.raises(ConfigError, match="step must be an integer"):
        par.log({"loss": 0.5}, step=-2)
    par.close()
    assert not par.trackers.active and list(tmp_path.iterdir()) == []


@needs_tensorboard
def test_only_the_active_rank_opens_its_trackers(tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    config = TrackerConfig(trackers=TensorBoardConfig(dir=blocked / "tb"))
    assert not Trackers(config, active=False).active  # rank 1 never tries
    with pytest.raises(ConfigError) as err:  # rank 0 cannot start it: one line, what to check
        Trackers(config, active=True)
    assert str(err.value).startswith("tensorboard could not start a run: ")
    assert "TrackerConfig.dir (or TensorBoardConfig.dir) is a folder this process may write" in str(err.value)


# ----------------------------------------------------------------- the monitor's figures
def _s(rank, *, step=100.0, busy=50.0, data=1.0, peak=2 * GIB, samples=8.0, tokens=0.0, steps=4):
    return RankStats(rank, 0, steps, step, busy, data, peak, -1.0, samples, tokens)


def test_job_figures_count_every_replica_once_and_mfu_per_device():
    rows = [_s(0, data=10.0, samples=8, tokens=512), _s(1, data=30.0, peak=3 * GIB, samples=8, tokens=512)]
    two = job_figures(rows, replicas=2, flops_per_sample=1e9, peak_flops=1e12)  # ddp: two replicas, 100 ms steps
    assert two == pytest.approx(
        {
            "monitor/step_ms": 100.0,
            "monitor/data_share": 0.3,
            "monitor/peak_mem_gib": 3.0,
            "monitor/samples_per_s": 160.0,
            "monitor/tokens_per_s": 10240.0,
            "monitor/tflops_per_device": 0.08,
            "monitor/mfu": 0.08,
        }
    )
    one = job_figures(rows, replicas=1, flops_per_sample=1e9)  # tp: both ranks read the same batch; peak unknown
    assert one["monitor/samples_per_s"] == 80.0 and "monitor/mfu" not in one
    assert one["monitor/tflops_per_device"] == pytest.approx(0.04)
    plain = job_figures([_s(0, samples=0, peak=-1.0)], replicas=1)  # a batch that is not a tensor, memory unknown
    assert set(plain) == {"monitor/step_ms", "monitor/data_share"}
    assert job_figures([_s(0, steps=0)], replicas=1) == {}


@pytest.mark.parametrize(
    "batch, counted",
    [
        (torch.zeros(4, 3, 8, 8), (4, 0)),  # images: samples, no tokens
        (torch.zeros(4, 3, 8, 8, dtype=torch.uint8), (4, 0)),
        ((torch.zeros(4, 16, dtype=torch.long), torch.zeros(4, 16, dtype=torch.long)), (4, 64)),  # (x, y) token ids
        ({"input_ids": torch.zeros(2, 5, dtype=torch.int32), "attention_mask": torch.ones(2, 5)}, (2, 10)),
        ({"pixels": torch.zeros(3, 2)}, (3, 0)),
        (((torch.zeros(2, 7, dtype=torch.long), torch.ones(2, 7)), torch.zeros(2)), (2, 14)),
        ([torch.zeros(5, 2, 3, dtype=torch.long)], (5, 0)),  # 3-D integers are not token ids
        (torch.tensor(1.0), (0, 0)),
        ("text", (0, 0)),
        ([], (0, 0)),
        ({}, (0, 0)),
        (None, (0, 0)),
    ],
)
def test_a_batch_counts_its_samples_and_tokens(batch, counted):
    assert batch_size_of(batch) == counted


def test_a_gpu_peak_comes_from_the_planner_catalogue(monkeypatch):
    assert catalogue_peak_flops(torch.device("cpu"), "bf16-mixed") is None
    for name, precision, peak in [
        ("NVIDIA H100 80GB HBM3", "bf16-mixed", 989e12),
        ("NVIDIA H100 PCIe", "fp32", 67e12),
        ("NVIDIA A100-SXM4-40GB", "bf16-true", 312e12),
        ("NVIDIA L4", "bf16-mixed", 121e12),
        ("NVIDIA L40S", "bf16-mixed", None),
        ("NVIDIA GeForce RTX 4090", "fp16-mixed", 165e12),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
        assert catalogue_peak_flops(torch.device("cuda", 0), precision) == peak, name


# ----------------------------------------------------------------- one process: files read back
def _train(steps=6, **kwargs):
    """``steps`` optimizer steps of a tiny classifier on batches of 3 samples, logging the loss after each, and an
    evaluation figure at a step of the script's own; returns the losses logged."""
    par = paratrain.Parallel("single", seed=0, **kwargs)
    model = nn.Linear(2, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(3 * steps, 2), torch.randint(0, 4, (3 * steps,)))
    model, optimizer, loader = par.prepare(model, optimizer, DataLoader(data, batch_size=3))
    losses = []
    for x, y in loader:
        with par.step(model, optimizer):
            losses.append(par.forward_backward(model, x, y, nn.functional.cross_entropy))
        par.log({"loss": losses[-1], "lr": optimizer.param_groups[0]["lr"]})  # a tensor and a float
    par.log({"eval/accuracy": 0.5}, step=50)
    par.close()
    return [float(loss) for loss in losses]


MONITOR = MonitorConfig(every=2, summary=False, flops_per_sample=48.0, peak_tflops=1e-6)


def _check_run(run, losses):
    """What every tracker of ``_train`` holds: the configuration once, the script's and the monitor's figures."""
    config, scalars = run["config"], run["scalars"]
    assert float(config["lr"]) == pytest.approx(0.1) and str(config["model.width"]) == "4"
    assert config["paratrain.strategy"] == "single" and str(config["paratrain.world_size"]) == "1"
    assert [step for step, _ in scalars["loss"]] == [1, 2, 3, 4, 5, 6]
    assert [value for _, value in scalars["loss"]] == pytest.approx(losses, rel=1e-6)
    assert scalars["lr"] == [(s, pytest.approx(0.1)) for s in range(1, 7)]
    assert scalars["eval/accuracy"] == [(50, 0.5)]
    for figure in ("step_ms", "data_share", "peak_mem_gib", "samples_per_s", "tflops_per_device", "mfu"):
        assert [step for step, _ in scalars[f"monitor/{figure}"]] == [2, 4, 6], figure  # the same step axis
    assert "monitor/tokens_per_s" not in scalars  # float features: no tokens
    for (_, step_ms), (_, per_s), (_, mfu) in zip(
        *(scalars[f"monitor/{f}"] for f in ("step_ms", "samples_per_s", "mfu"))
    ):
        assert per_s == pytest.approx(3 / (step_ms / 1e3), rel=1e-5)  # 3 samples per step
        assert mfu == pytest.approx(48.0 * per_s / 1e6, rel=1e-5)
    assert all(0 < value < 64 for _, value in scalars["monitor/peak_mem_gib"])


@needs_tensorboard
def test_tensorboard_holds_the_config_the_loss_and_the_monitor_at_their_steps(tmp_path):
    losses = _train(
        monitor=MONITOR,
        log_with=TrackerConfig(
            trackers="tensorboard",
            dir=tmp_path,
            project="digits",
            run_name="run-1",
            config={"lr": 0.1, "model": {"width": 4}},
        ),
    )
    runs = tensorboard_runs(tmp_path)
    assert list(runs) == [next(iter(runs))] and next(iter(runs)).startswith("tensorboard/digits/run-1/events.out.")
    _check_run(next(iter(runs.values())), losses)


RANK_FIGURES = {f"monitor/{f}/rank0" for f in ("step_ms", "data_share", "compute_ms", "sync_ms", "peak_mem_gib")}


@needs_tensorboard
def test_each_ranks_figures_go_to_the_trackers_when_asked(tmp_path):
    _train(
        monitor=MonitorConfig(every=2, summary=False, per_rank=True), log_with=TensorBoardConfig(dir=tmp_path / "tb")
    )
    (run,) = tensorboard_runs(tmp_path / "tb").values()
    assert RANK_FIGURES <= set(run["scalars"]) and "monitor/step_ms" in run["scalars"]
    assert [step for step, _ in run["scalars"]["monitor/step_ms/rank0"]] == [2, 4, 6]
    _train(monitor=MonitorConfig(every=2, summary=False), log_with=TensorBoardConfig(dir=tmp_path / "job"))
    (run,) = tensorboard_runs(tmp_path / "job").values()
    assert not RANK_FIGURES & set(run["scalars"])  # the job's figures alone by default


@needs_tensorboard
def test_the_former_tensorboard_dir_is_a_tensorboard_tracker_with_each_ranks_figures(tmp_path):
    with pytest.warns(FutureWarning, match=r"log_with=paratrain.TensorBoardConfig\(dir=.*per_rank=True"):
        config = MonitorConfig(every=2, summary=False, tensorboard_dir=tmp_path / "tb")
    _train(monitor=config)
    (run,) = tensorboard_runs(tmp_path / "tb").values()
    assert RANK_FIGURES <= set(run["scalars"])
    with pytest.raises(ConfigError, match="tensorboard_dir given beside log_with's TensorBoard tracker"):
        _train(monitor=config, log_with="tensorboard")


@needs_mlflow
@pytest.mark.launched  # importing MLflow runs `uname -p` (its telemetry's platform description)
def test_mlflow_holds_the_config_the_loss_and_the_monitor_and_marks_failures(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    tracking = TrackerConfig(
        trackers="mlflow", dir=tmp_path, project="digits", run_name="run-1", config={"lr": 0.1, "model": {"width": 4}}
    )
    losses = _train(monitor=MONITOR, log_with=tracking)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with (
        pytest.raises(RuntimeError, match="planted"),
        paratrain.Parallel(
            "single",
            monitor=False,
            log_with=TrackerConfig(trackers=MLflowConfig(tracking_uri=uri, experiment="other"), run_name="crashed"),
        ),
    ):
        raise RuntimeError("planted")
    runs = mlflow_runs(uri)
    assert set(runs) == {"digits/run-1", "other/crashed"}
    assert runs["digits/run-1"]["status"] == "FINISHED" and runs["other/crashed"]["status"] == "FAILED"
    _check_run(runs["digits/run-1"], losses)


# ----------------------------------------------------------------- 2 gloo processes, every tracker at once
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """tests/helpers/tracker_workers.py on 2 processes: a ddp run and a tp run, each to all three trackers."""
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as patch:  # the ranks inherit it
        for name, value in LOCAL.items():
            patch.setenv(name, value)
        ranks = spawn(tracked_runs, 2, (str(root),), timeout_s=200)
    return root, ranks


@needs_all
@pytest.mark.launched
@pytest.mark.timeout(240)
def test_rank_0_alone_writes_and_every_tracker_holds_the_same_run(job):
    root, (first, second) = job
    assert first["ddp"]["active"] and not second["ddp"]["active"]
    assert second["imported"] == []  # rank 1 never imported a tracker's client, so it wrote nothing
    tb, wb, ml = tensorboard_runs(root / "runs"), wandb_runs(root / "runs"), mlflow_runs(f"sqlite:///{root}/mlflow.db")
    assert (
        sorted(p.split("/")[2] for p in tb) == ["ddp", "tp"]
        and len(wb) == 2
        and set(ml) == {"tiny-lm/ddp", "tiny-lm/tp"}
    )
    assert sorted(run["name"] for run in wb.values()) == ["ddp", "tp"] and {r["project"] for r in wb.values()} == {
        "tiny-lm"
    }
    by_tracker = {
        "tensorboard": {p.split("/")[2]: r for p, r in tb.items()},
        "wandb": {r["name"]: r for r in wb.values()},
        "mlflow": {p.split("/")[1]: r for p, r in ml.items()},
    }
    for tracker, runs in by_tracker.items():
        for strategy, replicas in (("ddp", 2), ("tp", 1)):
            run, losses = runs[strategy], first[strategy]["losses"]
            assert str(run["config"]["paratrain.strategy"]) == strategy, tracker
            assert (
                str(run["config"]["paratrain.data_parallel_size"]) == str(replicas) == str(first[strategy]["replicas"])
            )
            assert str(run["config"]["model.vocab"]) == "16"
            scalars = run["scalars"]
            assert scalars["loss"] == [(s + 1, pytest.approx(v, rel=1e-6)) for s, v in enumerate(losses)], tracker
            assert scalars["eval/loss"] == [(100, pytest.approx(losses[-1], rel=1e-6))]
            figures = {f: scalars[f"monitor/{f}"] for f in ("step_ms", "samples_per_s", "tokens_per_s", "mfu")}
            assert all([s for s, _ in points] == list(range(EVERY, STEPS + 1, EVERY)) for points in figures.values())
            for (_, ms), (_, samples), (_, tokens), (_, mfu) in zip(*figures.values()):
                # every replica's batch of BATCH sequences of SEQ tokens, in a step of the ranks' median time
                assert samples == pytest.approx(replicas * BATCH / (ms / 1e3), rel=1e-5), (tracker, strategy)
                assert tokens == pytest.approx(samples * SEQ, rel=1e-5)
                assert mfu == pytest.approx(FLOPS_PER_SAMPLE * samples / 2 / (PEAK_TFLOPS * 1e12), rel=1e-5)
                assert math.isfinite(ms) and ms > 0
