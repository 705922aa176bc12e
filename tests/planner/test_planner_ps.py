"""The planner's ``ps`` row: a server holds 1/S of the dense model and of each table with their optimizer states, a
worker the dense model and only the rows its step touches; the bytes of a step are the runtime's, computed from the
``ps`` layout of the same model built here (nothing launched) and checked against benchmarks/RESULTS.md §16;
``ps`` is recommended only for a model with tables on a CPU host."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from paratrain.cli.main import main
from paratrain.distributed.param_server.config import PSConfig
from paratrain.distributed.param_server.holdings import plan_holdings
from paratrain.distributed.param_server.messages import (
    DTYPE_CODES,
    PULL_ROWS,
    PUSH_DENSE,
    PUSH_ROWS,
    Header,
)
from paratrain.planner import (
    InputSpec,
    Layout,
    Training,
    estimate,
    make_cluster,
    recommend,
    trace_module,
)
from paratrain.planner.param_server import rows_touched
from paratrain.planner.training import batching
from paratrain.workloads.recommender import Recommender

MIB = 2**20


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))


def _stats(factory, ids: int = 8):
    example = InputSpec(shape=(ids,), dtype=torch.long) if factory is not _mlp else InputSpec(shape=(784,))
    return trace_module(factory, example, name="model")


def _ps(stats, world: int, servers: int, training: Training):
    cluster = make_cluster("cpu", gpus=world)
    return estimate(stats, Layout.of(name="ps", dp=world - servers, servers=servers), training, cluster)


def test_the_trace_finds_the_table_the_runtime_would_hold_and_its_lookups():
    stats = _stats(Recommender)
    (table,) = stats.tables
    assert (table.name, table.rows, table.dim, table.lookups_per_sample) == ("table", 1_000_000, 32, 8)
    assert stats.dense_params == 32 * 256 + 256 + 256 * 256 + 256 + 256 * 2 + 2
    assert _stats(_mlp).tables == ()
    small = trace_module(lambda: Recommender(rows=1000), InputSpec(shape=(8,), dtype=torch.long), name="m")
    assert small.tables == ()  # below table_min_numel: dense, as tables="auto" leaves it


@pytest.mark.parametrize("servers", [1, 2, 3])
def test_a_server_holds_its_share_of_the_dense_model_and_of_the_table_with_their_states(servers):
    """The busiest server's dense share is the runtime layout's (whole tensors, biggest first onto the least
    loaded: here the 256 x 256 weight alone outweighs the rest), its rows a 1/S chunk of the table."""
    stats = _stats(Recommender)
    layout = plan_holdings(Recommender(), servers + 2, PSConfig(servers=servers))
    share = max(layout.dense_numel(s) for s in range(servers))
    chunk = layout.tables[0].bounds[0].hi * 32
    adagrad = Training(precision="fp32", optimizer="sgd-momentum", micro_batch=256, table_optimizer="adagrad")
    e = _ps(stats, servers + 2, servers, adagrad)
    server = e.serving.server
    assert (e.serving.dense_share, e.serving.table_rows) == (share, chunk)
    assert chunk == pytest.approx(1_000_000 * 32 / servers, rel=1e-5)
    assert server.parameters == 4 * (share + chunk)
    assert server.gradients == 4 * share  # the sum of the pushes
    assert server.optimizer_states == 4 * share + 4 * chunk  # momentum a dense parameter, Adagrad's sum a row element
    sgd = _ps(stats, servers + 2, servers, Training(precision="fp32", optimizer="sgd", micro_batch=256))
    assert sgd.serving.server.optimizer_states == 0
    adam = _ps(stats, servers + 2, servers, Training(precision="fp32", optimizer="adam", micro_batch=256))
    assert adam.serving.server.optimizer_states == 8 * share + 8 * chunk  # Adam's moments; SparseAdam's on rows


def test_a_worker_holds_the_dense_model_and_the_rows_it_touched_never_the_table():
    stats = _stats(Recommender)
    training = Training(precision="fp32", optimizer="adamw", micro_batch=256, table_optimizer="adam")
    e = _ps(stats, 3, 1, training)
    worker, table_bytes = e.serving.worker, 1_000_000 * 32 * 4
    assert worker.parameters == 4 * stats.dense_params
    assert worker.optimizer_states == 0  # the servers step
    rows = e.serving.traffic.rows[0]
    assert rows == pytest.approx(2046, abs=1)  # 256 samples x 8 ids of 1M rows: nearly all distinct
    assert worker.buffers >= rows * 32 * 4 * 2  # the rows pulled and their gradients
    held = worker.total - worker.overhead
    assert held < table_bytes / 10
    assert e.memory.total == max(worker.total, e.serving.server.total)
    ddp = estimate(stats, Layout.of(name="ddp", dp=3), training, make_cluster("cpu", gpus=3))
    assert ddp.memory.parameters >= table_bytes  # every ddp rank holds the table


def _runtime_bytes(model: nn.Module, ids_per_table: dict[str, torch.Tensor], world: int, servers: int):
    """One worker's sync step as the runtime counts it (``ClientStats``: request payloads as sent, trailers
    included; answers' tensors as received), and what each server receives and sends for one worker."""
    layout = plan_holdings(model, world, PSConfig(servers=servers))
    f32 = DTYPE_CODES[torch.float32]
    sent = received = 0
    per_server = [[0, 0] for _ in range(servers)]
    for table in layout.tables:
        ids = torch.unique(ids_per_table[table.name])
        owner = table.owner(ids)
        for s in range(servers):
            n = int((owner == s).sum())
            if n:
                out = (
                    Header(PULL_ROWS, count=n).payload_bytes
                    + Header(PUSH_ROWS, count=n, width=table.dim, dtype=f32).payload_bytes
                )
                back = n * table.dim * 4
                sent, received = sent + out, received + back
                per_server[s][0] += out
                per_server[s][1] += back
    for s in range(servers):
        out = Header(PUSH_DENSE, count=layout.dense_numel(s), width=1, dtype=f32).payload_bytes
        back = layout.dense_numel(s) * 4
        sent, received = sent + out, received + back
        per_server[s][0] += out
        per_server[s][1] += back
    return sent, received, per_server


@pytest.mark.parametrize("factory, servers", [(Recommender, 1), (Recommender, 2), (_mlp, 1), (_mlp, 2)])
def test_bytes_per_step_are_what_the_runtime_sends_for_the_same_model(factory, servers):
    """Planned against the runtime's messages for the same model, batch and ids: within 0.1% per worker (the
    requests' 8-byte trailers, the learning rate and the max norm, 24 bytes a message, are not planned), within 2%
    for the busiest server (the plan spreads the touched rows evenly over the servers)."""
    world, batch = servers + 2, 256
    model = factory()
    sparse = factory is Recommender
    ids = torch.randint(0, 1_000_000, (batch, 8), generator=torch.Generator().manual_seed(0)) if sparse else None
    sent, received, per_server = _runtime_bytes(model, {"table": ids} if sparse else {}, world, servers)
    distinct = torch.unique(ids).numel() if sparse else 0
    training = Training(precision="fp32", optimizer="sgd", micro_batch=batch, rows_per_step=distinct)
    traffic = _ps(_stats(factory), world, servers, training).serving.traffic
    assert traffic.worker_sent == pytest.approx(sent, rel=1e-3)
    assert traffic.worker_received == pytest.approx(received, rel=1e-3)
    workers = world - servers
    assert traffic.server_received == pytest.approx(workers * max(s for s, _ in per_server), rel=0.02)
    assert traffic.server_sent == pytest.approx(workers * max(r for _, r in per_server), rel=0.02)
    if sparse:  # left to the plan, the distinct ids of uniform draws: within 0.2% of these
        default = rows_touched(
            _stats(factory).tables[0], batching(training, dp=1, pp=1, world_size=1), Training(micro_batch=batch)
        )
        assert default == pytest.approx(distinct, rel=2e-3)


@pytest.mark.parametrize(
    "factory, batch, measured_sent, measured_received",
    [
        (Recommender, 256, 0.57, 0.54),
        (_mlp, 64, 7.11, 7.11),
    ],
)
def test_bytes_per_step_match_benchmarks_ps_measured_in_results_16(factory, batch, measured_sent, measured_received):
    """benchmarks/RESULTS.md §16, 1 server + 2 workers, per worker per step (MiB, two decimals). The dense
    workload's measured 7.32 MiB received counts the first pull too (34 pulls over 33 steps, 7.11 x 34/33); a
    step's is 7.11."""
    training = Training(precision="fp32", optimizer="sgd", micro_batch=batch)
    traffic = _ps(_stats(factory), 3, 1, training).serving.traffic
    assert traffic.worker_sent / MIB == pytest.approx(measured_sent, abs=0.006)
    assert traffic.worker_received / MIB == pytest.approx(measured_received, abs=0.006)


def test_ps_is_recommended_for_a_table_on_a_cpu_host_never_for_a_dense_model_or_on_gpus():
    training = Training(precision="fp32", optimizer="sgd", micro_batch=256)
    sparse = recommend(_stats(Recommender), make_cluster("cpu", gpus=3), training, ps_servers=1)
    assert sparse.choice.name == "ps" and "faster than ddp" in sparse.reason
    dense = _stats(_mlp)
    for cluster in (make_cluster("cpu", gpus=3), make_cluster("h100", gpus=8)):
        without = recommend(dense, cluster, training)
        with_ps = recommend(dense, cluster, training, ps_servers=1)
        assert "ps" in [e.name for e in with_ps.estimates] and "ps" not in [e.name for e in without.estimates]
        assert with_ps.choice.name == without.choice.name
        assert any("ps is planned, not recommended: the model has no embedding table" in n for n in with_ps.notes)
    on_gpus = recommend(_stats(Recommender), make_cluster("h100", gpus=8), training, ps_servers=1)
    assert on_gpus.choice.name != "ps"
    assert any("servers keep to host memory" in n for n in on_gpus.notes)


def test_a_ps_step_trains_the_per_gpu_share_on_each_worker():
    """The workers take what as many data-parallel ranks would each; the servers read nothing."""
    training = Training(precision="fp32", optimizer="sgd", micro_batch=256, global_batch=1024)
    e = _ps(_stats(Recommender), 4, 1, training)
    assert (e.batch.micro_batch, e.batch.micro_batches) == (256, 1)
    assert e.samples_per_s == pytest.approx(3 * 256 / e.time.step_s)


def test_a_ps_step_pays_each_request_on_the_busiest_server_for_every_worker():
    """The serving loop is one thread: the busiest server's host work is W x the requests a worker sends it (its
    dense push, and per table a row pull per micro-batch and a row push), each at ``Device.ps_server_request_s``;
    a worker pays its own requests at ``ps_worker_request_s``."""
    training = Training(precision="fp32", optimizer="sgd", micro_batch=256)
    stats = _stats(Recommender)
    cluster = make_cluster("cpu", gpus=3)
    server, worker = cluster.device.ps_server_request_s, cluster.device.ps_worker_request_s
    assert server > 0 and worker > 0
    for world, servers in ((2, 1), (3, 1), (5, 1), (5, 2)):
        w = world - servers
        layout = Layout.of(name="ps", dp=w, servers=servers)
        with_work = make_cluster("cpu", gpus=world)
        without = replace(with_work, device=replace(with_work.device, ps_server_request_s=0.0, ps_worker_request_s=0.0))
        e, bare = (estimate(stats, layout, training, c) for c in (with_work, without))
        n = e.serving.requests
        assert n == 1 + e.batch.micro_batches + 1  # a dense push, a row pull per micro-batch, a row push
        assert e.time.step_s - bare.time.step_s == pytest.approx(w * n * server + n * worker, rel=1e-9)
        assert e.serving.requests_s == pytest.approx(w * n * server + n * worker, rel=1e-9)
    accumulated = estimate(
        stats, Layout.of(name="ps", dp=2, servers=1), replace(training, micro_batch=64, global_batch=768), cluster
    )
    assert accumulated.batch.micro_batches == 4 and accumulated.serving.requests == 1 + 4 + 1
    dense = estimate(_stats(_mlp), Layout.of(name="ps", dp=2, servers=1), training, cluster)
    assert dense.serving.requests == 1
    assert make_cluster("h100", gpus=8).device.ps_server_request_s == server  # a host process there too


def test_plan_shows_a_ps_row_with_server_memory_and_bytes_per_step(capsys, tmp_path, monkeypatch):
    (tmp_path / "ps_models.py").write_text(
        "from test_planner_ps import Recommender\n\ndef build():\n    return Recommender()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    argv = [
        "plan",
        "--model",
        "ps_models:build",
        "--input",
        "long:8",
        "--gpu",
        "cpu",
        "--gpus",
        "4",
        "--ps-servers",
        "2",
        "--optimizer",
        "sgd",
        "--batch",
        "256",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ps                 workers=2 servers=2" in out
    assert "the busiest server" in out and "per step a worker sends 5" in out and "its link and its serving loop" in out
    assert main([*argv, "--json"]) == 0
    import json

    plan = json.loads(capsys.readouterr().out)
    (ps,) = [e for e in plan["strategies"] if e["name"] == "ps"]
    assert ps["layout"]["servers"] == 2 and ps["ps"]["server_memory_bytes"]["total"] > 0
    assert ps["ps"]["worker_sent_bytes"] == pytest.approx(0.566 * MIB, rel=0.01)
    assert main([*argv, "--ps-servers", "0"]) == 0
    assert "workers=" not in capsys.readouterr().out
