"""The options of the ``ps`` strategy, checked before anything starts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...model.tables import TABLE_MIN_NUMEL

TABLE_OPTIMIZERS = ("sgd", "adagrad", "adam")
"""Optimizers that update only the rows a step touched (``adam`` is ``torch.optim.SparseAdam``)."""


@dataclass(frozen=True, kw_only=True)
class PSConfig:
    servers: int = 1
    """Ranks that serve (the last ``servers`` ranks); the others train."""
    staleness: int = 0
    """0: synchronous (every step is the mean of every worker's gradient); tau > 0: each push is applied as it
    arrives, unless it was computed on parameters more than tau updates old (then it is dropped and counted)."""
    tables: str | Sequence[str] | None = "auto"
    """Embeddings held row-sharded on the servers: module names, ``"auto"`` (those built on the meta device or of
    at least ``table_min_numel`` elements, untied), or None (every parameter is dense)."""
    table_min_numel: int = TABLE_MIN_NUMEL
    """``"auto"`` makes an untied ``nn.Embedding``/``nn.EmbeddingBag`` this large (16 MiB in fp32) a table."""
    table_optimizer: str | None = None
    """How the servers update table rows when the training optimizer updates every row each step (Adam, AdamW):
    ``"sgd"``, ``"adagrad"`` or ``"adam"`` (SparseAdam), with the hyper-parameters of the table's group."""
    max_rows: int = 1 << 16
    """Rows per message; a batch touching more rows of one server sends several."""

    def __post_init__(self) -> None:
        if not isinstance(self.servers, int) or self.servers < 1:
            raise ConfigError(f"ps needs servers >= 1, got {self.servers!r}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise ConfigError(f"ps staleness must be an integer >= 0 (0: synchronous), got {self.staleness!r}")
        if self.table_optimizer is not None and self.table_optimizer not in TABLE_OPTIMIZERS:
            raise ConfigError(
                f"ps table_optimizer must be one of {', '.join(TABLE_OPTIMIZERS)}, got {self.table_optimizer!r}"
            )
        if self.max_rows < 1:
            raise ConfigError(f"ps max_rows must be >= 1, got {self.max_rows}")
        if isinstance(self.tables, str) and self.tables != "auto":
            raise ConfigError(f"ps tables must be 'auto', None or a list of module names, got {self.tables!r}")

    def check_world(self, world_size: int) -> None:
        if self.servers >= world_size:
            raise ConfigError(
                f"ps with servers={self.servers} leaves no worker among {world_size} processes; "
                f"launch more (-n {self.servers + 1} or more) or use fewer servers"
            )

    @property
    def synchronous(self) -> bool:
        return self.staleness == 0
