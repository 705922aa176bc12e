"""The training monitor: its rules on made-up figures, its loader wrapper and table in one process, and real
2-process gloo runs with a planted slow rank, a planted slow dataset and a balanced run."""

import copy
import csv
import importlib.util
import pickle
import time

import pytest
import torch
from helpers.monitor_workers import PLANTED_MS, cuda_straggler, monitor_scenarios
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.data import shard_loader
from paratrain.errors import ConfigError
from paratrain.monitor import (
    Finding,
    Monitor,
    MonitorConfig,
    Persistence,
    RankStats,
    RunSummary,
    find_data_stalls,
    find_memory_imbalance,
    find_stragglers,
)
from paratrain.monitor.report import CsvLog
from paratrain.testing import spawn

GIB = 1024**3
CFG = MonitorConfig()


def _s(rank, busy=50.0, *, step=100.0, data=1.0, peer=0, used=-1.0, peak=-1.0, steps=50):
    return RankStats(rank, peer, steps, step, busy, data, peak, used)


# ----------------------------------------------------------------- rules on made-up figures
def test_the_slow_rank_is_named_with_its_ratio_and_no_other():
    found = find_stragglers([_s(0, 50), _s(1, 52), _s(2, 80), _s(3, 49)], CFG)
    assert [(f.kind, f.rank) for f in found] == [("straggler", 2)]
    assert found[0].value == pytest.approx(80 / 50)
    assert "rank 2 is a straggler" in found[0].message and "30.0 ms after its peers" in found[0].message


def test_in_a_pair_only_the_slower_rank_is_named():
    assert [f.rank for f in find_stragglers([_s(0, 40), _s(1, 100)], CFG)] == [1]


def test_jitter_and_negligible_lateness_are_not_stragglers():
    assert find_stragglers([_s(0, 50), _s(1, 55), _s(2, 48), _s(3, 52)], CFG) == []  # 10 %: under the threshold
    assert find_stragglers([_s(0, 2), _s(1, 4)], CFG) == []  # 2x, but 2 ms of a 100 ms step: under min cost


def test_only_peers_are_compared():
    stages = [_s(0, 10, peer=0), _s(1, 60, peer=1), _s(2, 10, peer=0), _s(3, 60, peer=1)]
    assert find_stragglers(stages, CFG) == []  # a pipeline's stages do different work
    assert find_stragglers([_s(0, 10), _s(1, 60, steps=0)], CFG) == []  # nothing measured yet


def test_data_warning_names_the_worst_rank_and_the_fix():
    found = find_data_stalls([_s(0, data=5), _s(1, data=30)], CFG, advice="raise num_workers")
    assert [(f.kind, f.rank, f.value) for f in found] == [("data", 1, 0.3)]
    assert found[0].message.startswith("rank 1 waits for the next batch 30.0 ms of every 100.0 ms step (30%)")
    assert found[0].message.endswith("raise num_workers")
    both = find_data_stalls([_s(0, data=25), _s(1, data=30)], CFG)
    assert both[0].message.startswith("2 of 2 ranks wait (worst: rank 1)")
    assert find_data_stalls([_s(0, data=19), _s(1, data=10)], CFG) == []


def test_memory_imbalance_names_the_fullest_gpu():
    stats = [_s(0, used=80 * GIB, peak=40 * GIB)] + [_s(r, used=48 * GIB, peak=40 * GIB) for r in (1, 2, 3)]
    (found,) = find_memory_imbalance(stats, CFG)
    assert (found.kind, found.rank, found.value) == ("memory", 0, pytest.approx(0.6))
    assert "rank 0's GPU holds 80.0 GiB, rank 1's 48.0 GiB (40% less)" in found.message
    assert "other processes or CUDA contexts" in found.message and "torch.cuda.set_device" in found.message
    assert find_memory_imbalance([_s(0, used=10 * GIB), _s(1, used=9 * GIB)], CFG) == []  # 10 %
    assert find_memory_imbalance([_s(0, used=1.0 * GIB), _s(1, used=0.6 * GIB)], CFG) == []  # 0.4 GiB: too small
    assert find_memory_imbalance([_s(0, peak=3 * GIB), _s(1, peak=1 * GIB)], CFG) == []  # CPU: not judged


def test_a_condition_is_reported_once_after_persisting_and_again_after_clearing():
    p = Persistence(3)
    slow = [Finding("straggler", 1, 2.0, "slow")]
    assert [p.update(slow) for _ in range(5)] == [[], [], slow, [], []]
    assert p.update([]) == []
    assert [p.update(slow) for _ in range(3)] == [[], [], slow]
    other = [Finding("straggler", 0, 2.0, "other")]
    assert p.update(other) == []  # a different rank starts its own count


def test_rank_stats_travel_as_a_flat_list():
    s = _s(3, 12.5, data=2.0, peer=1, used=5.0, peak=7.0)
    assert RankStats.from_list(s.to_list()) == s
    assert (s.compute_ms, s.sync_ms, s.data_share) == (10.5, 87.5, 0.02)


# ----------------------------------------------------------------- reports and config
def test_summary_table_lists_every_rank_and_the_warnings():
    rows = [_s(0, 40, used=2 * GIB, peak=GIB), _s(1, 90, used=2 * GIB, peak=GIB)]
    table = (
        RunSummary(
            rows,
            [Finding("straggler", 1, 2.25, "rank 1 is slow")],
            sync_point="the gradient sync",
            memory="peak alloc",
            accumulate=4,
        )
        .table()
        .splitlines()
    )
    assert table[0].startswith("paratrain monitor: 50 optimizer steps of 4 micro-batches per rank")
    assert table[1].split() == [
        "rank",
        "steps",
        "step",
        "ms",
        "data",
        "wait",
        "compute",
        "ms",
        "sync",
        "ms",
        "peak",
        "alloc",
        "GPU",
        "used",
    ]
    assert table[2].split() == ["0", "50", "100.0", "1.0%", "39.0", "60.0", "1.00", "GiB", "2.00", "GiB"]
    assert table[-2:] == ["warnings (1):", "  - rank 1 is slow"]
    assert RunSummary([_s(0)]).to_dict()["ranks"][0]["step_ms"] == 100.0


def test_csv_log_appends_rows_under_one_header(tmp_path):
    path = tmp_path / "logs" / "monitor.csv"
    for step in (50, 100):
        log = CsvLog(path)
        log.write(step, [_s(0), _s(1)])
        log.close()
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["rank"]) for r in rows] == [("50", "0"), ("50", "1"), ("100", "0"), ("100", "1")]
    assert float(rows[0]["busy_ms"]) == 50.0


@pytest.mark.parametrize(
    "bad", [{"every": 0}, {"persist": 0}, {"straggler_threshold": 20}, {"data_threshold": 0}, {"memory_min_gib": -1}]
)
def test_bad_monitor_config_is_a_one_line_error(bad):
    with pytest.raises(ConfigError, match="MonitorConfig"):
        MonitorConfig(**bad)


def test_monitor_argument_must_be_a_bool_or_a_config():
    with pytest.raises(ConfigError, match="monitor must be True, False or a MonitorConfig"):
        paratrain.Parallel("single", monitor="on")


def test_tensorboard_without_the_package_is_refused_up_front(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else find_spec(name)
    )
    with pytest.raises(ConfigError, match=r"pip install 'paratrain\[tensorboard\]'"), pytest.warns(FutureWarning):
        paratrain.Parallel("single", monitor=MonitorConfig(tensorboard_dir=tmp_path))


# ----------------------------------------------------------------- one process
def _loader():
    data = TensorDataset(torch.arange(20.0).view(10, 2), torch.arange(10))
    return DataLoader(data, batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(0))


def test_a_prepared_loader_is_timed_without_changing_what_it_yields():
    par = paratrain.Parallel("single")
    plain = paratrain.Parallel("single", monitor=False).prepare_loader(_loader())
    prepared = par.prepare_loader(_loader())
    assert type(prepared).__name__ == type(plain).__name__ and type(prepared) is not type(plain)
    assert isinstance(prepared, DataLoader) and len(prepared) == 4 and prepared.batch_size == 3
    got, want = list(prepared), list(plain)
    assert len(got) == 4 and all(torch.equal(g[0], w[0]) and torch.equal(g[1], w[1]) for g, w in zip(got, want))
    assert par.monitor.recorder.data_s > 0
    par.close()


def test_the_loader_wrapper_keeps_the_object_and_copies_drop_it():
    monitor = Monitor(MonitorConfig(), rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    loader = _loader()
    sampler = loader.sampler
    assert monitor.wrap_loader(loader) is loader and isinstance(loader, DataLoader) and loader.sampler is sampler
    assert type(loader).__name__ == "DataLoader" and monitor.wrap_loader(loader) is loader  # wrapped once
    assert type(pickle.loads(pickle.dumps(loader))) is DataLoader  # copies are plain loaders
    assert type(copy.deepcopy(loader)) is DataLoader


def test_work_a_loader_does_for_a_checkpoint_is_not_data_wait():
    monitor = Monitor(MonitorConfig(), rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"))
    loader = shard_loader(_loader(), rank=0, world_size=1, seed=0)
    loader.before_fetch = lambda: time.sleep(0.05)  # where Parallel saves a pending checkpoint
    batches = list(monitor.wrap_loader(loader))
    assert len(batches) == 4 and 0 <= monitor.recorder.data_s < 0.1  # not the 0.2 s spent "saving"


def _train_one_process(monitor, steps=5, **kwargs):
    par = paratrain.Parallel("single", monitor=monitor, **kwargs)
    model = nn.Linear(2, 10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = par.prepare(model, optimizer, _loader())
    for _, (x, y) in zip(range(steps), loader):
        with par.step(model, optimizer):
            par.forward_backward(model, x.to(par.device), y.to(par.device), nn.functional.cross_entropy)
    par.close()
    return par


def test_close_prints_the_summary_table_in_one_process(capsys):
    par = _train_one_process(MonitorConfig(every=2), steps=4)
    out = capsys.readouterr().out
    assert "paratrain monitor: 4 optimizer steps per rank" in out and "peak RSS" in out
    assert "warnings: none" in out
    assert [r.steps for r in par.monitor.last_window] == [2]  # steps 3 and 4 (the window at step 2 had one)


def test_monitor_false_measures_and_prints_nothing(capsys):
    par = _train_one_process(False)
    assert par.monitor is None and "paratrain monitor" not in capsys.readouterr().out


# ----------------------------------------------------------------- 2 gloo processes
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every scenario of tests/helpers/monitor_workers.py on 2 processes (~20 s on a loaded 2-core machine)."""
    path = tmp_path_factory.mktemp("monitor") / "monitor.csv"
    ranks = spawn(monitor_scenarios, 2, (str(path),), timeout_s=150)
    return ranks, path


@pytest.mark.launched
@pytest.mark.parametrize(
    "scenario, sync",
    [("straggler", "gradient sync"), ("straggler_zero2", "forward"), ("straggler_tp", "tensor-parallel all-reduce")],
)
def test_a_planted_slow_rank_is_named_as_the_straggler(runs, scenario, sync):
    ranks, _ = runs
    run = ranks[0][scenario]  # PLANTED_MS: rank 1 sleeps 150 ms per step, rank 0 10 ms
    assert [(kind, rank) for kind, rank, _, _ in run["warnings"]] == [("straggler", 1)]
    kind, rank, ratio, message = run["warnings"][0]
    assert ratio > 1 and "rank 1 is a straggler" in message and sync in message
    fast, slow = run["rows"]
    # the sleeps lie before the sync point, so busy holds them; what load adds to either rank has no bound
    assert slow.busy_ms > 0.99 * PLANTED_MS[1] and fast.busy_ms > 0.99 * PLANTED_MS[0]
    assert fast.sync_ms > slow.sync_ms  # the fast rank is the one that waits
    assert ranks[1][scenario]["warnings"] == run["warnings"]  # every rank holds the same list


@pytest.mark.launched
def test_a_slow_dataset_triggers_the_data_loading_warning(runs):
    ranks, _ = runs
    warnings = ranks[0]["data"]["warnings"]  # __getitem__ sleeps 3 ms: 24 ms per batch of 8
    assert "data" in [kind for kind, *_ in warnings]
    ((_, _, share, message),) = [w for w in warnings if w[0] == "data"]
    assert share > 0.5 and "DataLoader(num_workers=" in message and "(now 0;" in message
    assert all(row.data_share > 0.5 for row in ranks[0]["data"]["rows"])


@pytest.mark.launched
def test_a_balanced_run_raises_no_warning(runs):
    ranks, _ = runs
    run = ranks[0]["balanced"]  # both ranks sleep 25 ms per micro-step, accumulate=2
    assert run["warnings"] == [] and "warnings: none" in run["table"]
    assert "12 optimizer steps of 2 micro-batches" in run["table"]
    assert all(45 < row.busy_ms < 200 for row in run["rows"])  # 2 x 25 ms per optimizer step


@pytest.mark.launched
def test_the_csv_log_holds_every_rank_every_window(runs):
    _, path = runs
    rows = list(csv.DictReader(path.open()))
    assert [(r["step"], r["rank"]) for r in rows] == [(s, r) for s in ("4", "8", "12") for r in ("0", "1")]
    assert [r["steps"] for r in rows[:2]] == ["3", "3"]  # the first step only starts the clock


# ----------------------------------------------------------------- CUDA (marker gpu; skipped without one)
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_table_shows_gpu_memory(capsys):
    par = _train_one_process(MonitorConfig(every=2), steps=6, accelerator="cuda")
    out = capsys.readouterr().out
    assert "peak alloc" in out and "GPU used" in out
    (row,) = par.monitor.last_window
    assert row.device_used > 0 and row.peak_mem > 0 and 0 < row.busy_ms


@pytest.mark.gpu
@pytest.mark.launched
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_on_two_gpus_the_planted_slow_rank_is_named():
    run = spawn(cuda_straggler, 2)[0]
    assert [(kind, rank) for kind, rank, _, _ in run["warnings"]] == [("straggler", 1)]
