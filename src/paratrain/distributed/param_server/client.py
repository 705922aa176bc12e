"""A worker's side of the parameter server: pull the dense parameters, pull the rows a batch touches, push the
gradients of a step and take the parameters that come back. Every request goes to every server it concerns at
once (``isend``), then the answers are read in turn."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from .holdings import Holdings
from .messages import (
    BACKGROUND,
    DONE,
    DTYPE_CODES,
    HEADER_WORDS,
    KIND_NAMES,
    MAGIC,
    OK,
    PAYLOAD_TAG,
    PULL_DENSE,
    PULL_ROWS,
    PUSH_DENSE,
    PUSH_ROWS,
    REASONS,
    REFUSED,
    REPLY_TAG,
    REPORT_WORDS,
    REQUEST_TAG,
    Header,
    ProtocolError,
    pack,
    word_float,
)
from .peers import Peer, job_peer


@dataclass
class ClientStats:
    """Per worker: time and bytes spent pulling and pushing, and how stale its parameters were."""

    pull_s: float = 0.0
    push_s: float = 0.0
    pull_bytes: int = 0
    push_bytes: int = 0
    steps: int = 0
    staleness: int = 0
    """Updates the servers applied between this worker's pull and its last push (max over servers; 0 in sync)."""
    max_staleness: int = 0
    dropped: int = 0
    """Pushes a server did not apply: computed on parameters older than the staleness bound."""

    def words(self, rank: int) -> torch.Tensor:
        """This worker's row of the closing table, as a goodbye carries it (``REPORT_WORDS`` float64)."""
        return torch.tensor(
            [
                rank,
                self.steps,
                self.pull_s,
                self.push_s,
                self.pull_bytes,
                self.push_bytes,
                self.max_staleness,
                self.dropped,
            ],
            dtype=torch.float64,
        )


@dataclass(frozen=True)
class ServerLoad:
    """One server's work so far, as it answers a worker's goodbye."""

    rank: int
    requests: int
    dropped: int
    bytes_in: int
    bytes_out: int
    busy_s: float


class Client:
    def __init__(
        self,
        layout: Holdings,
        rank: int,
        params: dict[str, nn.Parameter],
        max_rows: int,
        peers: list[Peer] | None = None,
    ) -> None:
        """``peers``: how to reach each server (default: in the job's group; a worker back after it died has a
        group of its own with them)."""
        self.layout, self.rank, self.max_rows = layout, rank, max_rows
        self.peers = peers if peers is not None else [job_peer(r) for r in layout.servers]
        self.params = [[params[s.name] for s in slots] for slots in layout.dense]
        self.step_no = 0
        self.versions = [0] * len(layout.servers)
        """Each server's version of the parameters this worker holds (sent with a push: its age is checked)."""
        self.done = False
        self.grad_norm = 0.0
        """The gradient norm before clipping that the servers' answer to the last push carried (0: not clipped
        there)."""
        self.stats = ClientStats()
        self.steps_before = 0
        """The pushes the servers had taken from this worker's rank before its first pull (a worker back after it
        died continues from there)."""

    # ----------------------------------------------------------------- dense
    def pull_dense(self) -> None:
        start = time.perf_counter()
        works = [w for s in range(len(self.layout.servers)) for w in self._request(s, Header(PULL_DENSE))]
        self._answers(works, PULL_DENSE)
        self.stats.pull_s += time.perf_counter() - start

    def push(
        self, rows: list[list[tuple[int, torch.Tensor, torch.Tensor]]], lrs: list[float], max_norm: float = 0.0
    ) -> None:
        """Push this step's gradients (dense, and ``rows[server]``'s (table, ids, grads)), each param group's
        learning rate ``lrs`` and the norm synchronous servers clip the step's mean gradient to (0: none); take the
        new parameters."""
        start = time.perf_counter()
        self.step_no += 1
        dtype = DTYPE_CODES[self.layout.dtype]
        works = []
        for s, params in enumerate(self.params):
            for table, ids, grads in rows[s]:
                for i in range(0, ids.numel(), self.max_rows):
                    part, g = ids[i : i + self.max_rows], grads[i : i + self.max_rows]
                    works += self._request(
                        s,
                        Header(PUSH_ROWS, self.step_no, table, part.numel(), g.shape[1], dtype),
                        pack(part, g.to(self.layout.dtype)),
                    )
            flat = (
                torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]).cpu()
                if params
                else torch.empty(0, dtype=self.layout.dtype)
            )
            works += self._request(
                s,
                Header(PUSH_DENSE, self.versions[s], count=flat.numel(), width=len(lrs), dtype=dtype),
                pack(torch.tensor([*lrs, max_norm], dtype=torch.float64), flat),
            )
        self.stats.push_s += time.perf_counter() - start
        start = time.perf_counter()
        self._answers(works, PUSH_DENSE)
        self.stats.pull_s += time.perf_counter() - start
        self.stats.steps = self.step_no

    def _answers(self, works: list, kind: int) -> None:
        for s, params in enumerate(self.params):
            h = self._answer(s, kind)
            self.versions[s] = h.step
            if kind == PUSH_DENSE:
                self.stats.staleness = h.width if s == 0 else max(self.stats.staleness, h.width)
                self.stats.dropped += h.table
                if s == 0:  # every server clipped by the same norm
                    self.grad_norm = word_float(h.dtype)
            elif s == 0:  # a pull's answer: the pushes taken from this rank so far
                self.steps_before = h.table
            if h.count:
                flat = torch.empty(h.count, dtype=self.layout.dtype)
                self.peers[s].recv(flat, REPLY_TAG)
                self.stats.pull_bytes += flat.numel() * flat.element_size()
                with torch.no_grad():  # copied in place: the parameters keep their storage (and device)
                    for p, part in zip(params, flat.split([p.numel() for p in params])):
                        p.copy_(part.view_as(p))
        self.stats.max_staleness = max(self.stats.max_staleness, self.stats.staleness)
        for w in works:
            w.wait()

    # ----------------------------------------------------------------- rows
    def pull_rows(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """The current rows ``ids`` (unique, sorted) of ``table``, in that order."""
        start = time.perf_counter()
        spec = self.layout.tables[table]
        owner = spec.owner(ids)
        out = torch.empty(ids.numel(), spec.dim, dtype=self.layout.dtype)
        plan, works = [], []
        for s in range(len(self.layout.servers)):
            where = (owner == s).nonzero().flatten()
            for i in range(0, where.numel(), self.max_rows):
                part = where[i : i + self.max_rows]
                works += self._request(s, Header(PULL_ROWS, self.step_no, table, part.numel()), pack(ids[part]))
                plan.append((s, part))
        for s, part in plan:
            h = self._answer(s, PULL_ROWS)
            rows = torch.empty(h.count, h.width, dtype=self.layout.dtype)
            self.peers[s].recv(rows, REPLY_TAG)
            out[part] = rows
            self.stats.pull_bytes += rows.numel() * rows.element_size()
        for w in works:
            w.wait()
        self.stats.pull_s += time.perf_counter() - start
        return out

    # ----------------------------------------------------------------- checkpoints
    def checkpoint(self, folders: list[str], kind: int, background: bool = False) -> None:
        """Have server ``s`` write its shard into ``folders[s]`` (``kind`` SAVE; ``background``: answer once it is
        staged), read it from there (LOAD), or answer once its background write there is complete (SAVED); returns
        when every server has answered. Raises ProtocolError when one could not."""
        works = []
        for s, folder in enumerate(folders):
            name = torch.frombuffer(bytearray(folder.encode()), dtype=torch.uint8)
            header = Header(kind, self.step_no, table=BACKGROUND if background else 0, count=name.numel())
            works += self._request(s, header, pack(name))
        errors = []
        for s in range(len(folders)):
            try:
                self._answer(s, kind)
            except ProtocolError as err:
                errors.append(str(err))
        for w in works:
            w.wait()
        if errors:
            raise ProtocolError(errors[0])

    # ----------------------------------------------------------------- the end
    def finish(self) -> list[ServerLoad]:
        """Tell every server this worker is done (once); returns their load as they answer."""
        if self.done:
            return []
        self.done = True
        words = self.stats.words(self.rank)
        works = [
            w
            for s in range(len(self.layout.servers))
            for w in self._request(
                s, Header(DONE, self.step_no, count=REPORT_WORDS, dtype=DTYPE_CODES[torch.float64]), pack(words)
            )
        ]
        loads = []
        for s, rank in enumerate(self.layout.servers):
            h = self._answer(s, DONE)
            loads.append(
                ServerLoad(
                    rank, requests=h.step, dropped=h.table, bytes_in=h.count, bytes_out=h.width, busy_s=h.dtype / 1e3
                )
            )
        for w in works:
            w.wait()
        return loads

    # ----------------------------------------------------------------- wire
    def _request(self, server: int, h: Header, payload: torch.Tensor | None = None) -> list:
        peer = self.peers[server]
        words = h.tensor()
        works = [_Kept(peer.isend(words, REQUEST_TAG), words)]
        if payload is not None:
            works.append(_Kept(peer.isend(payload, PAYLOAD_TAG), payload))
            self.stats.push_bytes += payload.numel()
        return works

    def _answer(self, server: int, kind: int) -> Header:
        words = torch.zeros(HEADER_WORDS, dtype=torch.int64)
        src = self.layout.servers[server]
        self.peers[server].recv(words, REPLY_TAG)
        w = words.tolist()
        if w[0] != MAGIC or w[1] not in (OK, REFUSED):
            raise ProtocolError(f"rank {self.rank} got a malformed answer from server rank {src}")
        if w[1] == REFUSED:
            raise ProtocolError(
                f"server rank {src} refused rank {self.rank}'s {KIND_NAMES[kind]}: "
                f"{REASONS.get(w[6], 'unknown reason')} (its log has the details)"
            )
        return Header(*w[1:7])


class _Kept:
    """A send in flight and the tensor it reads, kept alive until it is done."""

    def __init__(self, work: dist.Work, tensor: torch.Tensor) -> None:
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()
