"""``ps``: parameter servers (``Parallel("ps")``, :mod:`paratrain.distributed.param_server`) in the planner's terms.

S servers hold the parameters and W = N − S workers train. The dense parameters are split over the servers by
size (biggest first onto the least loaded: ``memory.zero1_busiest``'s greedy); each keeps its share, a gradient
sum of the same size and the optimizer's states for it. Each table (``ModelStats.tables``) is cut into S
contiguous row chunks, each with the table optimizer's states (``Training.table_states``). A worker holds the whole
dense model but no table: only the rows its step touched, and their gradients.

A synchronous step: every worker computes as one process would on its batch, pulls the rows its batch looks up
(ids out, rows back), pushes its dense gradients and the touched rows' ids and gradients, and takes the dense
parameters back. The busiest server receives from every worker, sums, steps and answers every worker, one message
at a time (its loop is one thread): its link and its loop, not the workers', set the pace, and nothing of it hides
behind compute. Each request costs the server ``Device.ps_server_request_s`` of host work beyond its bytes and the
link's latency (the busiest server serves W x ``requests_per_step`` of them in turn), and its worker
``Device.ps_worker_request_s``. Messages are counted by their payloads, as the runtime's ``ClientStats`` counts
them: the 64-byte header of each message, the 8-byte trailer of each request and a dense push's float64 words (each
param group's learning rate, the max norm) are left out (under 0.1% of any step worth planning).
Elements travel in fp32: the runtime moves the model's one dtype, and paratrain's mixed precision keeps fp32
parameters (autocast).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from .hardware import Cluster, Link
from .layout import Layout
from .memory import MemoryBreakdown, memory_per_rank, zero1_busiest
from .model_stats import ModelStats, TableStats
from .timing import StepTime, optimizer_step_bytes, step_time
from .training import OPTIMIZER_BY_STATES, OPTIMIZER_STEP_BYTES, OPTIMIZER_TEMP_BYTES, Batching, Training

WIRE_BYTES = 4
"""Bytes of one element on the wire and on a server: fp32."""
ID_BYTES = 8
"""A row id: int64."""
SUM_PASSES = 3
"""Memory passes a server makes per element of each dense push it adds into its sum: two reads and a write."""
COPY_PASSES = 2
"""Memory passes of one copy: a read and a write. A worker copies its gradients into one flat tensor per server
and the parameters it pulls back into place; a server copies its parameters once per step for the answers."""
TABLE_STEP_BYTES = {n: OPTIMIZER_STEP_BYTES[name] for n, name in OPTIMIZER_BY_STATES.items()}
"""Bytes a table optimizer's step streams per element of a touched row, by its states (SGD, Adagrad, SparseAdam)."""


@dataclass(frozen=True, kw_only=True)
class Traffic:
    """Payload bytes of one synchronous step: each way per worker, and into and out of the busiest server (from and
    to all the workers)."""

    dense: float
    """The dense parameters' bytes: what a worker pushes (gradients) and pulls back (parameters)."""
    rows: tuple[float, ...]
    """Rows of each table one worker's step touches."""
    worker_sent: float
    worker_received: float
    server_received: float
    server_sent: float

    def as_dict(self) -> dict[str, object]:
        return {
            "dense_bytes": self.dense,
            "rows_per_step": list(self.rows),
            "worker_sent_bytes": self.worker_sent,
            "worker_received_bytes": self.worker_received,
            "server_received_bytes": self.server_received,
            "server_sent_bytes": self.server_sent,
        }


@dataclass(frozen=True, kw_only=True)
class Serving:
    """What a ``ps`` layout needs: a worker's and the busiest server's memory, the bytes of a step, and the time the
    servers take (their messages and their optimizer step)."""

    worker: MemoryBreakdown
    server: MemoryBreakdown
    traffic: Traffic
    link: Link
    """The link a server's messages cross."""
    dense_share: float
    """Dense parameters the busiest server holds."""
    table_rows: float
    """Table elements (rows x dim, all tables) the busiest server holds."""
    requests: int
    """Requests one worker's step sends each server (``requests_per_step``)."""
    requests_s: float
    """Of the step's communication: the busiest server's host work on its W x ``requests`` requests, and a
    worker's on its own."""
    time: StepTime

    def as_dict(self) -> dict[str, object]:
        return {
            "worker_memory_bytes": self.worker.as_dict(),
            "server_memory_bytes": self.server.as_dict(),
            "server_dense_params": self.dense_share,
            "server_table_elements": self.table_rows,
            "requests_per_worker_step": self.requests,
            "requests_s": self.requests_s,
            "link": self.link.name,
            **self.traffic.as_dict(),
        }


def rows_touched(table: TableStats, batch: Batching, training: Training) -> float:
    """Rows of ``table`` one worker's step touches: ``training.rows_per_step`` when given, else the distinct ids of
    each micro-batch's ``micro_batch x lookups_per_sample`` lookups (each forward pulls its distinct ids once),
    drawn uniformly: R(1 − (1 − 1/R)^k) of R rows. Real ids repeat more (popular items), so this is the most a
    step moves: give ``--ps-rows-per-step`` from a measurement for a skewed workload."""
    if training.rows_per_step is not None:
        return float(min(training.rows_per_step, table.rows))
    k, r = batch.micro_batch * table.lookups_per_sample, table.rows
    distinct = r if r == 1 else -r * math.expm1(k * math.log1p(-1 / r))
    return batch.micro_batches * distinct


def requests_per_step(tables: int, batch: Batching) -> int:
    """Requests one worker's step sends each server: its dense push, and per table a row pull per micro-batch (each
    forward pulls its rows) and one push of the touched rows' gradients. (A pull or push of more than the runtime's
    ``max_rows`` rows is cut into more requests; not counted.)"""
    return 1 + tables * (batch.micro_batches + 1)


def dense_share(stats: ModelStats, servers: int) -> float:
    """Dense parameters of the busiest server: the runtime's greedy over the dense tensors when their sizes are
    known, else an even split."""
    tensors = stats.dense_tensors
    if tensors and sum(tensors) == stats.dense_params:
        return float(zero1_busiest(tensors, servers))
    return stats.dense_params / servers


def dense_stats(stats: ModelStats) -> ModelStats:
    """``stats`` as a worker holds the model: without its tables (a stand-in pulls the rows a batch reads)."""
    if not stats.tables:
        return stats
    return replace(stats, params=max(1, stats.dense_params), tensors=stats.dense_tensors, tables=())


def serving(stats: ModelStats, layout: Layout, batch: Batching, training: Training, cluster: Cluster) -> Serving:
    """A ``ps`` layout's memory, traffic and step time (see the module's docstring)."""
    s, w = layout.servers, layout.dp
    share = dense_share(stats, s)
    rows = tuple(rows_touched(t, batch, training) for t in stats.tables)
    chunks = tuple(math.ceil(t.rows / s) for t in stats.tables)
    busiest = tuple(r * c / t.rows for r, c, t in zip(rows, chunks, stats.tables))  # a server's part of them
    dense_b = stats.dense_params * WIRE_BYTES
    traffic = Traffic(
        dense=dense_b,
        rows=rows,
        worker_sent=dense_b + sum(r * (2 * ID_BYTES + t.dim * WIRE_BYTES) for r, t in zip(rows, stats.tables)),
        worker_received=dense_b + sum(r * t.dim * WIRE_BYTES for r, t in zip(rows, stats.tables)),
        server_received=w
        * (share * WIRE_BYTES + sum(r * (2 * ID_BYTES + t.dim * WIRE_BYTES) for r, t in zip(busiest, stats.tables))),
        server_sent=w * (share * WIRE_BYTES + sum(r * t.dim * WIRE_BYTES for r, t in zip(busiest, stats.tables))),
    )
    held = sum(c * t.dim for c, t in zip(chunks, stats.tables))
    pending = w * sum(r * (ID_BYTES + t.dim * WIRE_BYTES) for r, t in zip(busiest, stats.tables))
    overhead = cluster.device.overhead_gib * 2**30
    server = MemoryBreakdown(
        parameters=(share + held) * WIRE_BYTES,
        gradients=share * WIRE_BYTES,
        optimizer_states=share * training.state_bytes + held * 4 * training.table_states,
        activations=0.0,
        transient=share * OPTIMIZER_TEMP_BYTES[training.optimizer],
        buffers=2 * share * WIRE_BYTES + pending,
        overhead=overhead,
        phase="optimizer step",
    )
    worker = _worker_memory(stats, layout, batch, training, cluster, rows, share)

    link = cluster.link_for(layout.world_size, 1)
    tables = len(stats.tables)
    messages = w * (2 + 3 * tables)  # per worker: a dense push and its answer; per table a row pull, its answer, a push
    comm_s = (traffic.server_received + traffic.server_sent) / link.p2p_bytes_per_s + messages * link.p2p_latency_s
    requests = requests_per_step(len(stats.tables), batch)
    device = cluster.device
    requests_s = w * requests * device.ps_server_request_s + requests * device.ps_worker_request_s
    comm_s += requests_s
    one_server = _ranks(cluster, s)
    bandwidth = cluster.stream_bytes_per_s(one_server)
    updated = w * sum(r * t.dim for r, t in zip(busiest, stats.tables))
    server_s = (
        (SUM_PASSES * w + COPY_PASSES) * share * WIRE_BYTES
        + optimizer_step_bytes(share, training)
        + updated * TABLE_STEP_BYTES[training.table_states]
    ) / bandwidth
    workers = _ranks(cluster, w)
    comm_s += 2 * COPY_PASSES * dense_b / cluster.stream_bytes_per_s(workers)
    compute = step_time(dense_stats(stats), layout, batch, training, replace(cluster, ranks_per_node=workers))
    time = replace(compute, optimizer_s=server_s, comm_s=comm_s, exposed_comm_s=comm_s)
    return Serving(
        worker=worker,
        server=server,
        traffic=traffic,
        link=link,
        dense_share=share,
        table_rows=held,
        requests=requests,
        requests_s=requests_s,
        time=time,
    )


def _ranks(cluster: Cluster, active: int) -> int:
    """Ranks sharing a CPU host while ``active`` of them work: in a synchronous step the workers wait while the
    servers work and the servers wait (in a receive) while the workers compute. On GPUs, or over several nodes,
    every rank keeps its share."""
    if cluster.device.shared_by_ranks and cluster.nodes == 1:
        return max(1, active)
    return cluster.ranks_per_node


def _worker_memory(
    stats: ModelStats,
    layout: Layout,
    batch: Batching,
    training: Training,
    cluster: Cluster,
    rows: tuple[float, ...],
    share: float,
) -> MemoryBreakdown:
    """A worker: the dense model as one process holds it, with no optimizer state (the servers step), plus the rows
    its step pulled and their gradients; at the push, the flat gradients it sends and the parameters coming back."""
    dense = dense_stats(stats)
    alone = memory_per_rank(dense, Layout.of(name="single"), batch, replace(training, optimizer="sgd"), cluster)
    pulled = sum(r * (2 * t.dim * WIRE_BYTES + ID_BYTES) for r, t in zip(rows, stats.tables))
    computing = replace(alone, buffers=alone.buffers + pulled)
    pushing = MemoryBreakdown(
        parameters=alone.parameters,
        gradients=dense.params * training.bytes.grad,
        optimizer_states=alone.optimizer_states,
        activations=0.0,
        transient=(dense.params + share) * WIRE_BYTES,
        buffers=pulled,
        overhead=alone.overhead,
        phase="optimizer step",
    )
    return max(computing, pushing, key=lambda m: m.total)


def recommendable(stats: ModelStats, cluster: Cluster, layout: Layout) -> bool:
    """Whether ``layout`` may be recommended: parameter servers only for a model with tables, on a CPU host. For a
    dense model synchronous ``ps`` computes what ddp does while every step moves the whole model through the
    servers (benchmarks/RESULTS.md §16: 0.49x ddp), and the runtime's messages are CPU tensors over gloo."""
    return not layout.servers or (bool(stats.tables) and cluster.device.shared_by_ranks)
