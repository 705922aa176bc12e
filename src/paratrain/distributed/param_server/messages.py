"""The parameter server's wire format: a fixed header of eight int64 words, then at most one payload of raw bytes.

Nothing a peer sends is unpickled: a request is ``[MAGIC, kind, step, table, count, width, dtype, END]``, and what
follows is bytes whose length the header fixes (the payload ends with an eight-byte trailer, so a truncated one is
seen). The server checks the header against what it serves (:class:`Schema`) before it reads anything else, and
receives every payload into one buffer of the largest legitimate size: gloo ends a process that receives more bytes
than it posted (``op.preamble.length <= op.nbytes``), while fewer are accepted, so a message up to that size is
refused in one line and anything larger is refused without being read.

A push of dense gradients carries, before the gradients, each param group's learning rate and then the max norm the
step clips to (float64 words; 0: no clipping). An answer to a push carries the gradient norm before clipping in its
last word, as the bits of a float64 (:func:`float_word`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from ...errors import ParatrainError

MAGIC, END = 0x5053_7061_7261, 0x454E_4450_5321  # arbitrary words at both ends of a header
HEADER_WORDS = 8
TRAILER = torch.tensor([END], dtype=torch.int64).view(torch.uint8)

REQUEST_TAG, PAYLOAD_TAG, REPLY_TAG = 71, 72, 73
"""Headers from workers, their payloads, and the servers' replies travel on tags of their own, so a payload the
server never reads cannot be taken for the next header."""

PULL_DENSE, PUSH_DENSE, PULL_ROWS, PUSH_ROWS, DONE, SAVE, LOAD, SAVED = 1, 2, 3, 4, 5, 6, 7, 8
OK, REFUSED = 16, 17
KIND_NAMES = {
    PULL_DENSE: "pull of dense parameters",
    PUSH_DENSE: "push of dense gradients",
    PULL_ROWS: "pull of table rows",
    PUSH_ROWS: "push of row gradients",
    DONE: "done",
    SAVE: "checkpoint save",
    LOAD: "checkpoint load",
    SAVED: "wait for a checkpoint write",
    OK: "reply",
    REFUSED: "refusal",
}
BACKGROUND = 1
"""A SAVE's ``table`` word when the server is to stage its shard, answer, and write it in the background; a SAVED
of the same folder then answers once that write is complete."""
FOLDER_KINDS = (SAVE, LOAD, SAVED)
"""Requests whose payload is a folder name."""
REPORT_WORDS = 8
"""A goodbye (DONE) carries the worker's numbers for the closing table as this many float64 words."""
PATH_BYTES = 4096
"""The longest folder name (UTF-8 bytes) a SAVE, LOAD or SAVED may carry: where the server writes or reads its
shard."""

DTYPES = {1: torch.float32, 2: torch.float64, 3: torch.bfloat16, 4: torch.float16, 5: torch.int64}
DTYPE_CODES = {v: k for k, v in DTYPES.items()}

REASONS = {
    1: "malformed header",
    2: "unknown message kind",
    3: "wrong size",
    4: "wrong dtype",
    5: "unknown table",
    6: "oversized message",
    7: "row index out of range",
    8: "truncated payload",
    9: "sender refused earlier (a message that could not be read)",
    10: "checkpoint shard failed",
}


class ProtocolError(ParatrainError):
    """A message that breaks the parameter server's format (its one-line text names the sender)."""


class Refused(Exception):
    """Why a server does not serve one message; ``drain``: the payload it announced can still be read and dropped."""

    def __init__(self, code: int, detail: str, drain: bool) -> None:
        super().__init__(f"{REASONS[code]}: {detail}")
        self.code, self.drain = code, drain


@dataclass(frozen=True)
class Header:
    kind: int
    step: int = 0
    table: int = 0
    count: int = 0
    width: int = 0
    dtype: int = 0

    def tensor(self) -> torch.Tensor:
        return torch.tensor(
            [MAGIC, self.kind, self.step, self.table, self.count, self.width, self.dtype, END], dtype=torch.int64
        )

    @property
    def payload_bytes(self) -> int:
        """Bytes that follow a request (trailer included), from the header alone: 0 for none."""
        item = DTYPES[self.dtype].itemsize if self.dtype in DTYPES else 0
        body = {
            PUSH_DENSE: self.count * item + (self.width + 1) * 8,
            PULL_ROWS: self.count * 8,
            PUSH_ROWS: self.count * 8 + self.count * self.width * item,
            DONE: self.count * item,
            **dict.fromkeys(FOLDER_KINDS, self.count),
        }.get(self.kind, 0)
        return body + TRAILER.numel() if self.kind in (PUSH_DENSE, PULL_ROWS, PUSH_ROWS, DONE, *FOLDER_KINDS) else 0


def parse(words: torch.Tensor) -> Header:
    """The header in ``words`` (zeroed before the receive: a short one leaves its END word 0); raises Refused."""
    w = words.tolist()
    if w[0] != MAGIC or w[7] != END:
        raise Refused(1, "bad marker words (not a parameter-server header, or a truncated one)", drain=False)
    header = Header(*w[1:7])
    if header.kind not in KIND_NAMES:
        raise Refused(2, f"kind {header.kind}", drain=False)
    if min(header.count, header.width) < 0 or (header.dtype and header.dtype not in DTYPES):
        raise Refused(1, f"count {header.count}, width {header.width}, dtype code {header.dtype}", drain=False)
    return header


@dataclass(frozen=True)
class TableBounds:
    """The rows ``[lo, hi)`` of a table one server holds, each ``dim`` wide."""

    lo: int
    hi: int
    dim: int


@dataclass(frozen=True)
class Schema:
    """What one server accepts: its dense part's size and dtype, its rows of each table, the rows per message."""

    dense_numel: int
    dense_dtype: torch.dtype
    tables: tuple[TableBounds, ...]
    max_rows: int
    groups: int
    """The training optimizer's param groups: a push carries each one's learning rate (a schedule runs on the
    workers), then the max norm its step clips to."""

    @property
    def max_payload(self) -> int:
        """The largest legitimate payload in bytes (trailer included): the size of the server's receive buffer."""
        item = self.dense_dtype.itemsize
        rows = max((self.max_rows * (8 + t.dim * item) for t in self.tables), default=0)
        return max(self.dense_numel * item + (self.groups + 1) * 8, rows, PATH_BYTES) + TRAILER.numel()

    def check(self, h: Header) -> None:
        """Raise Refused unless this server serves ``h`` as it stands."""
        if h.payload_bytes > self.max_payload:
            raise Refused(6, f"{h.payload_bytes} bytes announced, at most {self.max_payload} accepted", drain=False)
        if h.kind == PUSH_DENSE:
            if h.dtype != DTYPE_CODES[self.dense_dtype]:
                raise Refused(4, f"{_dtype_name(h.dtype)} gradients, expected {self.dense_dtype}", drain=True)
            if h.count != self.dense_numel or h.width != self.groups:
                raise Refused(
                    3,
                    f"{h.count} values and {h.width} learning rates pushed, this server holds "
                    f"{self.dense_numel} in {self.groups} group(s)",
                    drain=True,
                )
        elif h.kind in (PULL_ROWS, PUSH_ROWS):
            if not 0 <= h.table < len(self.tables):
                raise Refused(5, f"table {h.table} (there are {len(self.tables)})", drain=True)
            if h.count > self.max_rows:
                raise Refused(6, f"{h.count} rows, at most {self.max_rows} per message", drain=True)
            if h.kind == PUSH_ROWS:
                dim = self.tables[h.table].dim
                if h.dtype != DTYPE_CODES[self.dense_dtype]:
                    raise Refused(4, f"{_dtype_name(h.dtype)} row gradients, expected {self.dense_dtype}", drain=True)
                if h.width != dim:
                    raise Refused(3, f"rows {h.width} wide, table {h.table} has {dim} columns", drain=True)
        elif h.kind in FOLDER_KINDS:
            if not 0 < h.count <= PATH_BYTES:
                raise Refused(6, f"a folder name of {h.count} bytes, at most {PATH_BYTES}", drain=False)
        elif h.kind == DONE:
            if (h.count, h.dtype) != (REPORT_WORDS, DTYPE_CODES[torch.float64]):
                raise Refused(
                    3,
                    f"a goodbye of {h.count} {_dtype_name(h.dtype)} words, expected {REPORT_WORDS} float64",
                    drain=True,
                )
        elif h.kind != PULL_DENSE:
            raise Refused(2, f"{KIND_NAMES[h.kind]} is not a request", drain=True)


def pack(*parts: torch.Tensor) -> torch.Tensor:
    """One payload: the parts' bytes back to back, then the trailer."""
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts] + [TRAILER])


def unpack(buffer: torch.Tensor, h: Header) -> tuple[torch.Tensor, ...]:
    """The typed parts of a payload received into ``buffer`` (views); raises Refused when it was cut short."""
    n = h.payload_bytes
    if not torch.equal(buffer[n - TRAILER.numel() : n], TRAILER):
        raise Refused(8, f"{n} bytes announced, fewer arrived", drain=False)
    body = buffer[: n - TRAILER.numel()]
    if h.kind == PUSH_DENSE:  # (gradients, learning rates, max norm); the float64 words first keep every part aligned
        words = body[: (h.width + 1) * 8].view(torch.float64)
        return body[(h.width + 1) * 8 :].view(DTYPES[h.dtype]), words[: h.width], words[h.width :]
    if h.kind in FOLDER_KINDS:
        return (body,)
    if h.kind == DONE:
        return (body.view(torch.float64),)
    ids = body[: h.count * 8].view(torch.int64)
    if h.kind == PULL_ROWS:
        return (ids,)
    return ids, body[h.count * 8 :].view(DTYPES[h.dtype]).view(h.count, h.width)


def float_word(x: float) -> int:
    """A float64 as the int64 header word holding its bits (an answer's gradient norm)."""
    return struct.unpack("<q", struct.pack("<d", x))[0]


def word_float(w: int) -> float:
    """The float64 whose bits :func:`float_word` put into a header word."""
    return struct.unpack("<d", struct.pack("<q", w))[0]


def _dtype_name(code: int) -> str:
    return str(DTYPES[code]) if code in DTYPES else f"dtype code {code}"
