"""A one-line progress bar for rank 0: redrawn in place on a terminal, silent in logs."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total, "epoch 1") as bar: bar.update()``; draws only when ``enabled`` and on a TTY."""

    def __init__(
        self, total: int, label: str, *, enabled: bool = True, stream: TextIO | None = None, width: int = 30
    ) -> None:
        self.total, self.label, self.width = max(total, 1), label, width
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and self.stream.isatty()
        self.done = 0
        self._last = 0.0

    def update(self, n: int = 1, **fields: float) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            filled = int(self.width * min(self.done, self.total) / self.total)
            extra = " ".join(f"{k} {v:.4g}" for k, v in fields.items())
            bar = "#" * filled + "-" * (self.width - filled)
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {extra}")
            self.stream.flush()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self.stream.write("\r" + " " * (len(self.label) + self.width + 40) + "\r")
            self.stream.flush()
