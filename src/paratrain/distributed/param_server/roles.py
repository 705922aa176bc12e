"""The two roles a rank of a ``ps`` job plays: a server serves from ``prepare`` until training ends and then ends
its process (the job's result is the workers'); a worker trains with its tables and optimizer swapped for
stand-ins that talk to the servers."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from .async_serving import Returns, serve_each_worker
from .client import Client, ClientStats, ServerLoad
from .config import PSConfig
from .holdings import Holdings
from .optimizers import group_of, table_kind
from .peers import Peer
from .server import Server, ServerStats
from .shards import ServerShards
from .snapshot import ShardStore
from .tables import RemoteTable, replace_tables
from .worker import PushingOptimizer


def serve(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    layout: Holdings,
    rank: int,
    config: PSConfig,
    store: ShardStore | None = None,
    returns: Returns | None = None,
) -> ServerStats:
    """Hold this server's shards and serve until every worker is done (``store``: how a checkpoint holds them).

    Synchronous servers (more than one) first make a group of their own, among themselves while the workers make
    theirs: a clipped step adds up its norm over it. Asynchronous servers serve each worker in a thread of its own,
    so that one may leave (and, as ``returns`` says, come back) while the others train; the first of them prints
    the closing table, since the workers may no longer all be there to gather it."""
    shards = ServerShards(model, optimizer, layout, layout.servers.index(rank), config.table_optimizer)
    del model, optimizer  # what this server does not own goes now (the caller drops its references too)
    servers = None
    if config.synchronous and len(layout.servers) > 1 and dist.is_initialized():
        servers = dist.new_group(list(layout.servers), use_local_synchronization=True)
    server = Server(shards, layout, rank, config.staleness, config.max_rows, store, servers)
    if config.synchronous:
        return server.serve()
    index = layout.servers.index(rank)
    attendance = serve_each_worker(server, returns, index, len(layout.servers))
    if index == 0:
        rows = [server.reports[w] for w in sorted(server.reports)]
        loads = [
            ServerLoad(
                rank,
                server.stats.requests,
                server.stats.dropped,
                server.stats.bytes_in,
                server.stats.bytes_out,
                server.stats.busy_s,
            )
        ]
        print("\n".join(table(len(layout.servers), config, rows, loads) + attendance.lines()), flush=True)
    return server.stats


def shard_folder(index: int) -> str:
    """The folder, inside a checkpoint's, of server ``index``'s shard."""
    return f"server-{index:03d}"


class WorkerSide:
    """A worker's connection to the servers and the stand-ins it put into the model."""

    def __init__(
        self,
        model: nn.Module,
        layout: Holdings,
        rank: int,
        config: PSConfig,
        device: torch.device,
        peers: list[Peer] | None = None,
    ) -> None:
        """``peers``: how to reach each server (default: in the job's group)."""
        self.layout, self.config = layout, config
        self.names = {id(p): n for n, p in model.named_parameters()}  # before the tables leave the model
        skip = {f"{t.name}.weight" for t in layout.tables}
        dense = {n: p for n, p in model.named_parameters() if n not in skip}
        self.client = Client(layout, rank, dense, config.max_rows, peers)
        self.tables: list[RemoteTable] = replace_tables(model, layout.tables, self.client)
        if device.type != "cpu":  # the tables are gone (they may be on meta); the parameters keep their identity
            model.to(device)
        self.client.pull_dense()

    def optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module) -> PushingOptimizer:
        """The optimizer the worker steps; a table the servers could not update is refused here as there."""
        settings = group_of(optimizer, self.names)
        for t in self.layout.tables:
            if f"{t.name}.weight" in settings:
                table_kind(optimizer, t.name, settings[f"{t.name}.weight"], self.config.table_optimizer)
        return PushingOptimizer(
            optimizer, {id(p) for p in model.parameters()}, self.client, self.tables, self.config.synchronous
        )

    def full_state(self, model: nn.Module, chunk: int = 1 << 16) -> dict[str, torch.Tensor]:
        """The model's whole state as the servers hold it now (asynchronous workers may hold older parameters)."""
        self.client.pull_dense()
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        for remote in self.tables:
            t = remote.table
            parts = [torch.arange(i, min(i + chunk, t.rows)) for i in range(0, t.rows, chunk)]
            state[f"{t.name}.weight"] = torch.cat([self.client.pull_rows(t.index, ids) for ids in parts])
        return dict(sorted(state.items()))


def _mib(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.2f} GiB"
    return f"{n / 2**20:.2f} MiB" if n >= 2**16 else f"{n / 2**10:.1f} KiB"


def report(
    layout_servers: int,
    config: PSConfig,
    rank: int,
    stats: ClientStats | None,
    group: dist.ProcessGroup | None,
    servers: Sequence[ServerLoad] = (),
) -> str:
    """Every worker's pull/push time and bytes per step and staleness, and ``servers``' load, as a table (a
    collective over ``group``, the workers; ``stats`` None: a worker rank that trained nothing). Rank 0 gets the
    table, the others ''."""
    mine = (stats or ClientStats()).words(rank)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(rows, mine, group=group)
    return "\n".join(table(layout_servers, config, rows, servers)) if rank == 0 else ""


def table(
    layout_servers: int, config: PSConfig, rows: Sequence[torch.Tensor], servers: Sequence[ServerLoad] = ()
) -> list[str]:
    """The closing table's lines: a row per worker (:meth:`ClientStats.words`), a line per server."""
    mode = "synchronous" if config.synchronous else f"staleness <= {config.staleness}"
    lines = [
        f"paratrain ps: {layout_servers} server(s), {len(rows)} worker(s), {mode}",
        "rank   steps  pull ms/step  push ms/step  pulled/step  pushed/step  max staleness  dropped",
    ]
    for r in rows:
        rank_, steps, pull, push, pulled, pushed, stale, dropped = r.tolist()
        n = max(steps, 1)
        lines.append(
            f"{int(rank_):>4}  {int(steps):>6}  {1e3 * pull / n:>12.2f}  {1e3 * push / n:>12.2f}  "
            f"{_mib(pulled / n):>11}  {_mib(pushed / n):>11}  {int(stale):>13}  {int(dropped):>7}"
        )
    if servers:
        lines.append("server  requests  received   sent       busy s  dropped")
        lines += [
            f"{s.rank:>6}  {s.requests:>8}  {_mib(s.bytes_in):>9}  {_mib(s.bytes_out):>9}  {s.busy_s:>7.2f}  "
            f"{s.dropped:>7}"
            for s in servers
        ]
    return lines
