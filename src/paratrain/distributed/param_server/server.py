"""The serving loop a server rank runs from ``prepare`` until every worker is done.

One request at a time (:meth:`Server.serve_one`): in synchronous mode one thread receives them from any worker
(``recv`` from any source on the request tag); in asynchronous mode a thread per worker receives its requests and
takes turns under a lock (:mod:`.async_serving`), so that a worker that dies is noticed. Synchronous
mode (staleness 0) sums the pushes of a step and steps once every live worker has pushed, then answers them all
with the new parameters: the step of one process over the global batch. When the pushes carry a max norm, the
mean gradient of the step is clipped to it first, as one process would clip it: each server adds up the squares of
its part (dense and rows), the servers sum those over their own group, and every server scales its part alike
(the norm goes back to the workers in the answer).

With staleness tau > 0 each push is applied as it arrives (clipped by its worker, if at all) and answered at once,
unless the parameters it was computed on are more than tau updates old: such a push is dropped (counted) and the
worker gets the current parameters. The bound is on the age of what is applied, not on how far a worker runs ahead,
so a slow worker never holds the others back (bounding the clock difference between workers instead, as
stale-synchronous schemes do, makes every worker wait for the slowest once it is tau steps behind). Replies go out
with ``isend`` so a slow reader never holds the server up.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .clipping import clip_coefficient, squared_norm
from .holdings import Holdings
from .messages import (
    BACKGROUND,
    DONE,
    FOLDER_KINDS,
    HEADER_WORDS,
    OK,
    PAYLOAD_TAG,
    PULL_DENSE,
    PULL_ROWS,
    PUSH_DENSE,
    PUSH_ROWS,
    REFUSED,
    REPLY_TAG,
    REQUEST_TAG,
    SAVE,
    SAVED,
    TRAILER,
    Header,
    Refused,
    Schema,
    float_word,
    parse,
    unpack,
)
from .peers import job_peer
from .shards import ServerShards
from .snapshot import ShardStore, load_shard_state, shard_state


class Departed(RuntimeError):
    """A worker's connection closed in the middle of its request (its process died)."""


@dataclass
class ServerStats:
    """What a server did, for the report and the tests."""

    requests: int = 0
    dropped: int = 0
    """Asynchronous pushes computed on parameters more than ``staleness`` updates old (not applied)."""
    max_staleness: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    refused: list[str] = field(default_factory=list)
    busy_s: float = 0.0


class Server:
    def __init__(
        self,
        shards: ServerShards,
        layout: Holdings,
        rank: int,
        staleness: int,
        max_rows: int,
        store: ShardStore | None = None,
        servers: dist.ProcessGroup | None = None,
    ) -> None:
        """``servers``: the servers' own group, over which a synchronous step's clipping norm adds up (None: this
        server is the only one)."""
        self.shards, self.layout, self.rank, self.staleness, self.store = shards, layout, rank, staleness, store
        self.servers = servers
        self.index = layout.servers.index(rank)
        self.schema = Schema(
            dense_numel=layout.dense_numel(self.index),
            dense_dtype=layout.dtype,
            tables=tuple(t.bounds[self.index] for t in layout.tables),
            max_rows=max_rows,
            groups=shards.group_count,
        )
        self.buffer = torch.zeros(self.schema.max_payload, dtype=torch.uint8)
        self.clock = {w: 0 for w in layout.workers}
        """Pushes per worker."""
        self.version = 0
        """Optimizer steps this server has taken: a pull's parameters are of this version."""
        self.training = set(layout.workers)
        self.finished: set[int] = set()  # workers that said they are done
        self.reports: dict[int, torch.Tensor] = {}  # their numbers for the closing table (REPORT_WORDS each)
        self.peers = {w: job_peer(w) for w in layout.workers}
        self.banned: set[int] = set()
        self.pushed: set[int] = set()  # sync: workers whose push of this step is in
        self.max_norm = 0.0  # sync: what this step's pushes clip to (0: no clipping)
        self.norm = 0.0  # sync: the last step's gradient norm before clipping (when it clipped)
        self.rows: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {w: [] for w in layout.workers}
        self.waiting: list[int] = []  # workers whose answer to a push is held back
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []
        self.writing: tuple[str, Callable[[], None]] | None = None
        """A shard being written in the background: its folder, and the wait for it (raises if it failed)."""
        self.stats = ServerStats()

    def serve(self) -> ServerStats:
        """Answer requests, from any worker in turn, until every worker has said it is done."""
        words = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        while self.training:
            words.zero_()
            src = dist.recv(words, src=None, tag=REQUEST_TAG)
            self.serve_one(src, words)
        self.finish_sends()
        return self.stats

    def serve_one(self, src: int, words: torch.Tensor) -> None:
        """Read the rest of the request whose header ``src`` sent into ``words``, and answer it (or refuse it)."""
        start = time.perf_counter()
        self.stats.requests += 1
        try:
            if src in self.banned:
                raise Refused(9, "no longer served", drain=False)
            if src not in self.clock:
                raise Refused(2, "a request from a server rank", drain=False)
            header = parse(words)
            try:
                self.schema.check(header)
            except Refused as r:
                if r.drain and header.payload_bytes:
                    self._receive(src, header)
                raise
            payload = self._receive(src, header) if header.payload_bytes else ()
            self._handle(src, header, payload)
        except Refused as r:
            self._refuse(src, r)
        self._reap()
        self.stats.busy_s += time.perf_counter() - start

    def finish_sends(self) -> None:
        """Wait for the answers still in flight (those to a worker that has gone fail, and are dropped) and for a
        shard still being written."""
        for work, _ in self.sends:
            try:
                work.wait()
            except RuntimeError:
                pass
        self.sends = []
        self._settle()

    # ----------------------------------------------------------------- requests
    def _receive(self, src: int, h: Header) -> tuple[torch.Tensor, ...]:
        n = h.payload_bytes
        self.buffer[n - TRAILER.numel() : n].zero_()
        try:
            self.peers[src].recv(self.buffer, PAYLOAD_TAG)
        except RuntimeError as err:
            raise Departed(str(err)) from None
        self.stats.bytes_in += n
        try:
            return unpack(self.buffer, h)
        except RuntimeError as err:  # a view the bytes cannot make (never from a well-formed header)
            raise Refused(1, str(err).splitlines()[0], drain=False) from None

    def _handle(self, src: int, h: Header, payload: tuple[torch.Tensor, ...]) -> None:
        if h.kind == PULL_DENSE:
            self._reply(
                src,
                Header(OK, self.version, table=self.clock[src], count=self.shards.flat.numel()),
                self.shards.flat.clone(),
            )
        elif h.kind == PULL_ROWS:
            (ids,) = payload
            shard = self._rows_of(h.table, ids)
            self._reply(
                src, Header(OK, h.step, h.table, ids.numel(), shard.table.dim), shard.weight.detach()[ids - shard.lo]
            )
        elif h.kind == PUSH_ROWS:
            ids, grads = payload
            self._rows_of(h.table, ids)
            self.rows[src].append((h.table, ids.clone(), grads.clone()))
        elif h.kind == PUSH_DENSE:
            grad, lrs, max_norm = payload
            clip = float(max_norm[0])
            if not (math.isfinite(clip) and clip >= 0) or (clip and self.staleness):
                raise Refused(1, f"max norm {clip} (a finite norm >= 0, and 0 when asynchronous)", drain=True)
            self.shards.set_learning_rates(lrs.tolist())
            self.clock[src] += 1
            if self.staleness == 0:
                self.shards.grad.add_(grad)
                self.max_norm = clip
                self.pushed.add(src)
                self.waiting.append(src)
                self._step_if_all_in()
                return
            stale = self.version - h.step  # updates applied since the parameters this gradient was computed on
            dropped = stale > self.staleness
            if dropped:
                self.rows[src].clear()
                self.stats.dropped += 1
            else:
                self.shards.grad.add_(grad)
                self._apply(src, scale=1.0)
            self.stats.max_staleness = max(self.stats.max_staleness, stale)
            params = self.shards.flat.clone()
            self._reply(src, Header(OK, self.version, int(dropped), params.numel(), stale), params)
        elif h.kind in FOLDER_KINDS:
            self._checkpoint(src, h, payload[0])
        elif h.kind == DONE:  # answered with this server's load so far
            self.training.discard(src)
            self.finished.add(src)
            self.reports[src] = payload[0].clone()
            st = self.stats
            self._reply(src, Header(OK, st.requests, st.dropped, st.bytes_in, st.bytes_out, int(1e3 * st.busy_s)))
            if self.staleness == 0:
                self._step_if_all_in()

    def _checkpoint(self, src: int, h: Header, name: torch.Tensor) -> None:
        """Write this server's shard into the folder a worker named, or read it back from there (a worker sends
        it between steps, when nothing of a step is pending here); answered when done. A SAVE marked
        ``BACKGROUND`` is answered once the shard is staged (copied), and the SAVED of that folder once it is
        written."""
        try:
            folder = bytes(name.tolist()).decode()
        except UnicodeDecodeError:
            raise Refused(1, "a folder name that is not UTF-8", drain=True) from None
        if h.kind == SAVED:
            self._written(folder)
        elif self.store is None or self.pushed or any(self.rows.values()):
            raise Refused(10, "a checkpoint in the middle of a step (or with no store)", drain=True)
        else:
            self._settle()  # one write in flight at most
            _refusing(folder, lambda: self._save_or_load(h, folder))
        self._reply(src, Header(OK, self.version))

    def _save_or_load(self, h: Header, folder: str) -> None:
        if h.kind != SAVE:
            self.version = load_shard_state(self.shards, self.store.read(folder))
        elif h.table == BACKGROUND:
            self.writing = folder, self.store.start_write(shard_state(self.shards, self.version), folder)
        else:
            self.store.write(shard_state(self.shards, self.version), folder)

    def _written(self, folder: str) -> None:
        """Wait for the background write into ``folder``; refuse if it failed, or if none was started there."""
        if self.writing is None or self.writing[0] != folder:
            raise Refused(10, f"{folder}: no shard is being written there", drain=True)
        _, wait = self.writing
        self.writing = None
        _refusing(folder, wait)

    def _settle(self) -> None:
        """Wait for a background write no worker asked after (its save was given up): it must not run on beside
        the next one, nor past the end of serving."""
        if self.writing is not None:
            _, wait = self.writing
            self.writing = None
            try:
                wait()
            except Exception:  # nobody publishes that folder
                pass

    def _rows_of(self, table: int, ids: torch.Tensor):
        shard = self.shards.tables[table]
        if ids.numel() and (int(ids.min()) < shard.lo or int(ids.max()) >= shard.lo + shard.weight.shape[0]):
            raise Refused(
                7,
                f"table {table} rows {int(ids.min())}..{int(ids.max())}, this server holds "
                f"{shard.lo}..{shard.lo + shard.weight.shape[0] - 1}",
                drain=False,
            )
        return shard

    def _apply(self, src: int | None, scale: float, max_norm: float = 0.0) -> None:
        """One optimizer step: the dense gradient sum and the row gradients of ``src`` (None: of every worker),
        times ``scale``; with ``max_norm``, first clipped to it by the norm over every server (collective: every
        server steps with the same ``max_norm``)."""
        sources = self.rows if src is None else {src: self.rows[src]}
        pushed = [push for pushes in sources.values() for push in pushes]
        if max_norm:
            self.norm = self._global_norm(pushed) * scale
            scale *= clip_coefficient(self.norm, max_norm)
        self.shards.step_dense(scale)
        per_table: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        for table, ids, grads in pushed:
            per_table.setdefault(table, []).append((ids, grads))
        for pushes in sources.values():
            pushes.clear()
        for table, parts in per_table.items():
            self.shards.tables[table].apply(torch.cat([i for i, _ in parts]), torch.cat([g for _, g in parts]), scale)
        self.version += 1

    def _global_norm(self, rows: list[tuple[int, torch.Tensor, torch.Tensor]]) -> float:
        """The 2-norm of the summed gradients of this step over every server: this server's dense sum and
        ``rows``, a row's repeats summed (:mod:`.clipping`), added up over the servers' group."""
        squared = torch.tensor([squared_norm([self.shards.grad], rows)], dtype=torch.float64)
        if self.servers is not None:
            dist.all_reduce(squared, group=self.servers)
        return math.sqrt(float(squared[0]))

    def _step_if_all_in(self) -> None:
        if self.pushed and self.pushed >= self.training:
            self._apply(None, scale=1.0 / len(self.pushed), max_norm=self.max_norm)
            self.pushed.clear()
            self._release()

    def _release(self) -> None:
        """Answer every worker whose push this step took, with the new parameters (and the norm it clipped)."""
        params = self.shards.flat.clone() if self.waiting else None
        norm = float_word(self.norm if self.max_norm else 0.0)
        for w in self.waiting:
            self._reply(w, Header(OK, self.version, count=params.numel(), dtype=norm), params)
        self.waiting = []

    # ----------------------------------------------------------------- replies
    def _reply(self, dst: int, h: Header, payload: torch.Tensor | None = None) -> None:
        words, peer = h.tensor(), self.peers[dst]
        self.sends.append((peer.isend(words, REPLY_TAG), words))
        if payload is not None and payload.numel():
            payload = payload.contiguous()
            self.sends.append((peer.isend(payload, REPLY_TAG), payload))
            self.stats.bytes_out += payload.numel() * payload.element_size()

    def _refuse(self, src: int, r: Refused) -> None:
        if not r.drain:
            self.banned.add(src)
        line = f"paratrain ps: server rank {self.rank} refused a message from rank {src}: {r}; still serving the others"
        self.stats.refused.append(line)
        print(line, file=sys.stderr, flush=True)
        self._reply(src, Header(REFUSED, dtype=r.code))
        if src in self.training and not r.drain:  # it cannot be served any more: do not wait for its pushes
            self.training.discard(src)
            self._step_if_all_in() if self.staleness == 0 else self._release()

    def _reap(self) -> None:
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()]


def _refusing(folder: str, work: Callable[[], None]) -> None:
    """Run ``work`` on ``folder``; a failure refuses the request in one line naming the folder (the folder is the
    worker's choice: a failure refuses this request only)."""
    try:
        work()
    except Exception as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise Refused(10, reason if folder in reason else f"{folder}: {reason}", drain=True) from None
