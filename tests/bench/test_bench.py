"""``paratrain bench``: configuration checks, job planning and the report without processes; then one real
bench through the CLI (world 1 and 2, the torch-ddp comparison, threads) whose JSON, CSV and PNG are checked."""

from __future__ import annotations

import csv
import json

import pytest
import torch
import torch.distributed as dist

from paratrain import ConfigError
from paratrain.bench import BenchConfig, BenchResult, Row, format_report
from paratrain.bench.machine import Machine
from paratrain.bench.runner import plan_jobs
from paratrain.bench.subjects import ParatrainSubject, TorchDDPSubject
from paratrain.cli.main import main
from paratrain.testing import max_abs_diff
from paratrain.workloads import get_workload, workload_names

TWO_CORES = Machine(cores=2, physical_cores=2, gpus=0)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"nprocs": (0, 2)}, "world sizes >= 1"),
        ({"strategies": ("ddp", "nope")}, "unknown strategy 'nope'"),
        ({"scaling": "linear"}, "scaling must be one of weak, strong"),
        ({"compare": "torch-ddp", "strategies": ("zero3",)}, "add ddp to the strategies"),
        ({"compare": "horovod"}, "unknown comparison"),
        ({"steps": 0}, "steps must be >= 1"),
        ({"strategy_options": {"pipeline": {}}}, "not among"),
        ({"accelerator": "tpu"}, "unknown accelerator"),
    ],
)
def test_bad_configurations_are_one_line_errors(kwargs, words):
    with pytest.raises(ConfigError, match=words) as info:
        BenchConfig(**kwargs)
    assert "\n" not in str(info.value)


def test_world_1_is_always_the_baseline_and_strong_scaling_splits_the_batch():
    cfg = BenchConfig(nprocs=(4, 2), scaling="strong", batch=128)
    assert cfg.nprocs == (1, 2, 4)
    assert cfg.replica_batch(4) == 32
    with pytest.raises(ConfigError, match="use a multiple of 3"):
        cfg.replica_batch(3)
    assert BenchConfig(batch=16).replica_batch(4) == 16  # weak: per replica
    assert cfg.rank_threads(cores=8) == 2  # every rank the same 'device' at every world size


def test_jobs_skip_what_cannot_run_and_add_thread_rows():
    cfg = BenchConfig(nprocs=(1, 2, 4), strategies=("ddp", "hybrid"), compare="torch-ddp", threads=True)
    jobs, skipped, notes = plan_jobs(cfg, TWO_CORES)
    shapes = [(j.world, j.threads, [r.label for r in j.runs]) for j in jobs]
    assert shapes == [
        (1, 1, ["single"]),
        (2, 1, ["ddp", "torch-ddp"]),
        (4, 1, ["ddp", "hybrid", "torch-ddp"]),
        (1, 2, ["single"]),
        (1, 4, ["single"]),
    ]
    assert [(r.label, r.world) for r in skipped] == [("hybrid", 2)]
    assert "hybrid needs dp >= 2 and pp >= 2" in skipped[0].skipped
    thread_jobs = jobs[-2:]
    assert [j.config.batch for j in thread_jobs] == [128, 256]  # the global batch of 2 and 4 ranks (weak)
    assert notes == []


def test_gpu_machines_skip_world_sizes_beyond_their_gpus():
    jobs, _, notes = plan_jobs(BenchConfig(nprocs=(1, 2), threads=True), Machine(cores=16, physical_cores=8, gpus=1))
    assert [j.world for j in jobs] == [1]
    assert any("needs 2 GPUs and 1 are visible" in n for n in notes)
    assert any("--threads" in n for n in notes)


def test_oversubscription_counts_ranks_times_threads_against_physical_cores_or_gpus():
    assert TWO_CORES.oversubscribed(2, 1) is None
    assert TWO_CORES.oversubscribed(4, 1) == "4 x 1 threads on 2 physical cores"
    assert TWO_CORES.oversubscribed(1, 4) is not None
    assert Machine(cores=8, physical_cores=4, gpus=2).oversubscribed(4, 1) == "4 processes on 2 GPU(s)"


def test_report_marks_oversubscribed_rows_and_names_the_fastest():
    rows = [
        Row(
            label="single",
            world=1,
            threads=1,
            global_batch=64,
            samples_per_s=1000.0,
            step_ms=64.0,
            speedup=1.0,
            efficiency=1.0,
            comm_share=0.0,
            imbalance=0.0,
            peak_mb=[300.0],
            memory_kind="rss_peak",
        ),
        Row(
            label="ddp",
            world=4,
            threads=1,
            replicas=4,
            global_batch=256,
            samples_per_s=1500.0,
            step_ms=170.0,
            speedup=1.5,
            efficiency=0.375,
            comm_share=0.4,
            imbalance=0.05,
            peak_mb=[310.0, 320.0],
            memory_kind="rss_peak",
            oversubscribed="4 x 1 threads on 2 physical cores",
        ),
        Row(label="pipeline", world=4, threads=1, skipped="needs an nn.Sequential"),
    ]
    text = format_report(
        BenchResult(
            config=BenchConfig(nprocs=(1, 4)),
            machine=TWO_CORES,
            workload="mlp",
            rows=rows,
            comparisons=[],
            notes=[],
            versions={"paratrain": "x", "torch": "y"},
            wall_s=1.0,
        )
    )
    assert "ddp x4 *" in text and "* oversubscribed (4 x 1 threads on 2 physical cores)" in text
    assert "pipeline x4 *" not in text and "skipped: needs an nn.Sequential" in text
    assert "fastest on this machine: ddp x4 (1500 samples/s)" in text
    assert " 40%" in text and "0.38" in text and "peak RSS MiB" in text


def test_workloads_build_train_and_reject_unknown_names():
    assert workload_names() == ["mlp", "cnn", "gpt-tiny", "gpt-moe-tiny", "recommender", "recommender-tiny"]
    for name in workload_names():
        if name == "recommender":  # recommender-tiny is the same code on a 16 MiB table instead of 122 MiB
            continue
        w = get_workload(name)
        x, y = w.make_batch(4, torch.Generator().manual_seed(0))
        assert torch.equal(x, w.make_batch(4, torch.Generator().manual_seed(0))[0])  # seeded
        w.loss(w.model()(x), y).backward()
    with pytest.raises(
        ConfigError, match="unknown workload 'resnet'; choose one of: mlp, cnn, gpt-tiny, gpt-moe-tiny, recommender"
    ):
        get_workload("resnet")


def test_a_user_factory_may_return_a_tuple():
    w = get_workload("helpers.bench_workloads:linear_tuple")
    assert w.name == "helpers.bench_workloads:linear_tuple"
    first, second = w.model(), w.model()
    assert first is not second and torch.equal(first.weight, second.weight)  # a fresh, equal copy each time
    with pytest.raises(ConfigError, match="return a paratrain.workloads.Workload"):
        get_workload("helpers.bench_workloads:wrong")


@pytest.mark.parametrize("name", ["own_loss_nanogpt", "own_loss_labels"])
def test_a_model_that_computes_its_own_loss_is_benched_as_forward_backward_reads_it(name, tmp_path):
    """``loss=None``: nanoGPT's ``model(x, targets) -> (logits, loss)`` and a ``labels=`` model's ``.loss``; both
    subjects take the very step one process takes by hand (the hand-written DDP loop on a 1-rank group)."""
    w = get_workload(f"helpers.bench_workloads:{name}")
    x, y = w.batch(4, torch.Generator().manual_seed(0), torch.device("cpu"))
    ref = w.model()
    out = ref(x, **y) if isinstance(y, dict) else ref(x, y)
    (out.loss if isinstance(y, dict) else out[1]).backward()
    w.optimizer(ref.parameters()).step()
    ours = ParatrainSubject(w, "single", {}, 0, "cpu")
    ours.step(x, y)
    ours.forward_backward(x, y, sync=True)  # the probe's pass: gradients dropped, parameters kept
    assert max_abs_diff(dict(ours.model.named_parameters()), dict(ref.named_parameters())) == 0.0
    ours.close()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        theirs = TorchDDPSubject(w, 0, torch.device("cpu"))
        theirs.step(x, y)
        assert max_abs_diff(dict(theirs.model.module.named_parameters()), dict(ref.named_parameters())) == 0.0
        # DDP's reducer goes first: were it the group's last holder, its destructor (which keeps the GIL) would join
        # gloo's threads, one of which may wait for the GIL to free its last work (pytorch/pytorch#56297): a hang
        del theirs
    finally:
        dist.destroy_process_group()


@pytest.mark.launched
@pytest.mark.slow
def test_bench_end_to_end(tmp_path, capsys):
    """World 1, world 2 with ddp, pipeline and the hand-written DDP loop, and 1 process x 2 threads."""
    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "bench",
                "--nproc",
                "1,2",
                "--strategies",
                "ddp,pipeline",
                "--compare",
                "torch-ddp",
                "--threads",
                "--threads-per-rank",
                "1",
                "--accelerator",
                "cpu",
                "--rounds",
                "2",
                "--steps",
                "4",
                "--warmup",
                "1",
                "--batch",
                "16",
                "--json",
                str(out),
                "--csv",
                str(tmp_path / "bench.csv"),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "paratrain ddp vs hand-written DDP at world 2: overhead" in text and "fastest on this machine:" in text
    data = json.loads(out.read_text())
    rows = {r["name"]: r for r in data["rows"]}
    assert set(rows) == {"1 proc x 1 thread", "1 proc x 2 threads", "ddp x2", "pipeline x2", "torch-ddp x2"}
    base, ddp, pipe = rows["1 proc x 1 thread"], rows["ddp x2"], rows["pipeline x2"]
    assert base["speedup"] == 1.0 and base["comm_share"] == 0.0
    assert ddp["global_batch"] == 32 and pipe["global_batch"] == 16  # weak scaling: 16 per replica
    assert ddp["efficiency"] == pytest.approx(ddp["speedup"] / 2)
    assert 0 <= ddp["comm_share"] < 1 and ddp["imbalance"] is not None
    assert pipe["comm_share"] is None  # no_sync does not leave a pipeline's communication out
    assert rows["1 proc x 2 threads"]["global_batch"] == 32 and rows["1 proc x 2 threads"]["threads"] == 2
    assert all(len(r["peak_mb"]) == r["world"] and min(r["peak_mb"]) > 50 for r in rows.values())
    assert all(len(r["rounds_ms"]) == 2 and r["step_p90_ms"] >= r["step_ms"] > 0 for r in rows.values())
    (comparison,) = data["comparisons"]
    assert comparison["max_param_diff"] == 0.0  # the same steps on the same data: the very same parameters
    assert len(comparison["rounds"]) == 2 and comparison["overhead"] > 0
    with open(tmp_path / "bench.csv") as f:
        assert len(list(csv.DictReader(f))) == 5
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_bench_input_is_one_line(capsys):
    assert main(["bench", "--workload", "resnet"]) == 2
    assert main(["bench", "--nproc", "1,two"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown workload 'resnet'" in err[0] and "comma-separated world sizes" in err[1]


def test_a_serving_strategy_gets_a_job_of_its_own_at_each_world_size():
    jobs, skipped, _ = plan_jobs(BenchConfig(nprocs=(1, 2, 3), strategies=("ddp", "ps"), servers=2), TWO_CORES)
    shapes = [(j.world, [(r.label, r.serves, r.options) for r in j.runs]) for j in jobs]
    assert shapes == [
        (1, [("single", False, {})]),
        (2, [("ddp", False, {})]),
        (3, [("ddp", False, {})]),
        (3, [("ps", True, {"servers": 2})]),
    ]
    assert [(r.label, r.world) for r in skipped] == [("ps", 2)]  # 2 servers leave no worker among 2 processes
    assert "leaves no worker" in skipped[0].skipped
    with pytest.raises(ConfigError, match="servers must be >= 1"):
        BenchConfig(servers=0)


def test_bytes_per_step_is_the_mean_per_training_rank_and_step_and_shows_in_every_output(tmp_path):
    from paratrain.bench import write_csv, write_json
    from paratrain.bench.measure import Block, RankRecord
    from paratrain.bench.result import summarise

    def record(*moved):
        return RankRecord(
            label="ps",
            replicas=2,
            replica_batch=8,
            memory_kind="rss_peak",
            blocks=[Block(step_s=[0.01, 0.02], data_s=[0.0, 0.0], moved_bytes=m) for m in moved],
        )

    row = summarise("ps", 3, 1, [record(2000, 4000), record(6000, 4000)])  # the two workers; the server sent nothing
    row.servers = 1
    assert row.bytes_per_step == 2000.0 and row.global_batch == 16 and row.name == "ps x3 (1 server)"
    assert summarise("zero1", 2, 1, [record(None, None)] * 2).bytes_per_step is None  # not counted: "-"
    assert row.comm_share is None  # the messages' time not timed: "-"
    timed = [
        RankRecord(
            label="ps",
            replicas=2,
            replica_batch=8,
            memory_kind="rss_peak",
            blocks=[Block(step_s=[0.01, 0.03], data_s=[0.0, 0.0], moved_bytes=1, moving_s=s)],
        )
        for s in (0.01, 0.02)
    ]
    assert summarise("ps", 3, 1, timed).comm_share == pytest.approx(0.375)  # pulls and pushes: 25% and 50% of 40 ms
    ddp = Row(
        label="ddp",
        world=3,
        threads=1,
        global_batch=24,
        samples_per_s=900.0,
        step_ms=20.0,
        bytes_per_step=45 * 2**20,
        peak_mb=[400.0] * 3,
    )
    result = BenchResult(
        config=BenchConfig(nprocs=(3,), strategies=("ddp", "ps")),
        machine=TWO_CORES,
        workload="recommender",
        rows=[ddp, row],
        comparisons=[],
        notes=[],
        versions={"paratrain": "x", "torch": "y"},
        wall_s=1.0,
    )
    text = format_report(result)
    assert "bytes/step" in text and "45.00M" in text and "1.95K" in text
    assert "rows with servers: the batch, samples/s" in text
    write_json(result, tmp_path / "r.json")
    write_csv(result, tmp_path / "r.csv")
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["name"], r["servers"], r["bytes_per_step"]) for r in rows] == [
        ("ddp x3", 0, 45 * 2**20),
        ("ps x3 (1 server)", 1, 2000.0),
    ]
    with open(tmp_path / "r.csv") as f:
        assert [float(r["bytes_per_step"]) for r in csv.DictReader(f)] == [45 * 2**20, 2000.0]


def test_traffic_is_the_ring_all_reduce_for_ddp_and_counted_nowhere_it_is_not_known():
    from torch import nn

    from paratrain.strategies import create
    from paratrain.strategies.data_engines import all_reduce_traffic

    model = nn.Linear(10, 10)  # 110 fp32 parameters: 440 bytes of gradient
    assert all_reduce_traffic(model, 1) == 0
    assert all_reduce_traffic(model, 2) == 2 * 440  # sent 440, received 440
    assert all_reduce_traffic(model, 3) == round(4 * 2 / 3 * 440)  # 2(N-1)/N of the gradient each way
    model.bias.requires_grad_(False)
    assert all_reduce_traffic(model, 2) == 2 * 400
    assert create("single").traffic_bytes(model, 7) == 0
    assert create("ddp").traffic_bytes(model, 7) is None  # not wrapped in DDP (FSDP2's replicate): not counted
    assert create("zero1").traffic_bytes(model, 7) is None
    assert create("ps").traffic_bytes(model, 7) is None  # a server, or not prepared


@pytest.mark.launched
@pytest.mark.slow
def test_bench_ps_against_ddp_on_the_sparse_workload(tmp_path, capsys):
    """One bench at world 3: ddp on 3 processes and ps on 1 server + 2 workers (a job of its own, whose server ends
    its process), on a 16 MiB table: ps moves a sliver of ddp's bytes per step."""
    from paratrain.strategies.data_engines import all_reduce_traffic

    out = tmp_path / "ps.json"
    assert (
        main(
            [
                "bench",
                "--workload",
                "recommender-tiny",
                "--nproc",
                "3",
                "--strategies",
                "ddp,ps",
                "--ps-servers",
                "1",
                "--accelerator",
                "cpu",
                "--threads-per-rank",
                "1",
                "--rounds",
                "1",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--batch",
                "8",
                "--no-comm-probe",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    text = capsys.readouterr().out
    assert "ps x3 (1 server)" in text and "bytes/step" in text
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"1 proc x 1 thread", "ddp x3", "ps x3 (1 server)"}
    ddp, ps = rows["ddp x3"], rows["ps x3 (1 server)"]
    assert (ps["replicas"], ps["servers"], ps["global_batch"], len(ps["peak_mb"])) == (2, 1, 16, 2)  # the workers'
    assert ps["samples_per_s"] > 0 and ps["step_ms"] > 0
    assert ddp["bytes_per_step"] == all_reduce_traffic(get_workload("recommender-tiny").model(), 3)
    assert 0 < ps["bytes_per_step"] < ddp["bytes_per_step"] / 100  # touched rows and the MLP, not the whole table
    assert rows["1 proc x 1 thread"]["bytes_per_step"] == 0
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tp_runs_inside_the_strategies_that_take_it_with_the_workloads_plan():
    cfg = BenchConfig(workload="mlp", nprocs=(1, 2, 4), strategies=("tp", "zero3", "zero1", "hsdp"), tp=2)
    jobs, skipped, _ = plan_jobs(cfg, TWO_CORES)
    runs = {(job.world, run.label): run.options for job in jobs for run in job.runs}
    plan = {"0": "colwise", "2": "rowwise"}  # the MLP has no built-in plan: the workload's
    assert runs[(2, "tp")] == {"tp_plan": plan} == runs[(4, "tp")]  # tp splits over every rank
    assert runs[(2, "zero3+tp2")] == {"tp": 2, "tp_plan": plan} == runs[(4, "zero1+tp2")]
    assert {r.label for r in skipped} == {"hsdp+tp2"}  # refused in its own words
    assert all("does not take tp" in r.skipped for r in skipped)


def test_schedules_time_each_pipeline_strategy_under_each_schedule_in_one_job():
    cfg = BenchConfig(nprocs=(1, 2), strategies=("ddp", "pipeline"), schedules=("1f1b", "zbv", "dualpipev"))
    jobs, skipped, _ = plan_jobs(cfg, TWO_CORES)
    assert [r.label for r in jobs[1].runs] == ["ddp", "pipeline/1f1b", "pipeline/zbv", "pipeline/dualpipev"]
    assert [r.options.get("schedule") for r in jobs[1].runs] == [None, "1f1b", "zbv", "dualpipev"]
    assert skipped == []
    with pytest.raises(ConfigError, match="add pipeline or hybrid"):
        BenchConfig(strategies=("ddp",), schedules=("zbv",))
    with pytest.raises(ConfigError, match="schedules must be distinct names among"):
        BenchConfig(strategies=("pipeline",), schedules=("zbv", "zero-bubble"))
