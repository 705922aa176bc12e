"""Who holds what (a job's :class:`Holdings`): the server ranks, the dense parameters each owns (balanced by size)
and the rows of each table each holds. A pure function of the model and the options, so every rank computes the same
holdings without talking.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ...errors import ConfigError
from ...model.tables import TABLE_TYPES, auto_tables, unsupported, weight_owners
from .config import PSConfig
from .messages import TableBounds


@dataclass(frozen=True)
class DenseSlot:
    name: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclass(frozen=True)
class Table:
    index: int
    name: str
    """The module's name in the model."""
    rows: int
    dim: int
    bounds: tuple[TableBounds, ...]
    """Each server's rows (a contiguous chunk, as ``torch.chunk`` cuts)."""

    def owner(self, ids: torch.Tensor) -> torch.Tensor:
        """The server index holding each row id."""
        return torch.div(ids, self.bounds[0].hi - self.bounds[0].lo, rounding_mode="floor")


@dataclass(frozen=True)
class Holdings:
    servers: tuple[int, ...]
    workers: tuple[int, ...]
    dense: tuple[tuple[DenseSlot, ...], ...]
    """Per server, the dense parameters it owns, in the model's order, packed back to back."""
    tables: tuple[Table, ...]
    dtype: torch.dtype

    def dense_numel(self, server: int) -> int:
        return sum(s.numel for s in self.dense[server])

    @property
    def table_names(self) -> frozenset[str]:
        return frozenset(t.name for t in self.tables)


def plan_holdings(model: nn.Module, world_size: int, config: PSConfig) -> Holdings:
    """The layout of ``model`` over ``world_size`` ranks (the last ``config.servers`` serve)."""
    config.check_world(world_size)
    servers = tuple(range(world_size - config.servers, world_size))
    tables = _tables(model, config, len(servers))
    table_weights = {f"{t.name}.weight" if t.name else "weight" for t in tables}
    dense = [(n, p) for n, p in model.named_parameters() if n not in table_weights and p.requires_grad]
    dtypes = {p.dtype for _, p in dense}
    if len(dtypes) > 1:
        raise ConfigError(
            f"ps moves dense parameters of one dtype, the model has {sorted(map(str, dtypes))}; "
            "cast it to one (precision='bf16-mixed' keeps fp32 parameters)"
        )
    for n, p in dense:
        if p.is_meta:
            raise ConfigError(
                f"dense parameter {n!r} is on the meta device; only the tables the servers hold may be "
                "built there (ps tables=...)"
            )
    loads, owned = [0] * len(servers), [[] for _ in servers]  # biggest first onto the least loaded server
    for i, (_, p) in sorted(enumerate(dense), key=lambda e: (-e[1][1].numel(), e[0])):
        s = loads.index(min(loads))
        loads[s] += p.numel()
        owned[s].append(i)
    slots = []
    for indices in owned:
        offset, mine = 0, []
        for i in sorted(indices):
            n, p = dense[i]
            mine.append(DenseSlot(n, tuple(p.shape), offset))
            offset += p.numel()
        slots.append(tuple(mine))
    dtype = dtypes.pop() if dtypes else torch.float32
    return Holdings(
        servers=servers,
        workers=tuple(range(world_size - config.servers)),
        dense=tuple(slots),
        tables=tables,
        dtype=dtype,
    )


def _tables(model: nn.Module, config: PSConfig, servers: int) -> tuple[Table, ...]:
    """The embeddings the servers hold, by the ``tables`` option."""
    if config.tables is None:
        return ()
    named = dict(model.named_modules())
    owners = weight_owners(model)
    if config.tables == "auto":
        chosen = auto_tables(model, config.table_min_numel)
    else:
        chosen = list(config.tables)
        for n in chosen:
            m = named.get(n)
            if not isinstance(m, TABLE_TYPES):
                raise ConfigError(
                    f"ps table {n!r} is not an nn.Embedding or nn.EmbeddingBag of the model; name one "
                    f"of: {', '.join(k for k, v in named.items() if isinstance(v, TABLE_TYPES)) or '-'}"
                )
            if len(owners[id(m.weight)]) > 1:
                raise ConfigError(
                    f"ps table {n!r} shares its weight with {owners[id(m.weight)][1:]} (a tied head "
                    "reads every row): leave it dense"
                )
            if unsupported(m):
                raise ConfigError(f"ps table {n!r} uses {unsupported(m)}, which needs every row; leave it dense")
    out = []
    for i, n in enumerate(chosen):
        m = named[n]
        rows, dim = m.weight.shape
        per = -(-rows // servers)
        bounds = tuple(TableBounds(min(s * per, rows), min((s + 1) * per, rows), dim) for s in range(servers))
        out.append(Table(i, n, rows, dim, bounds))
    return tuple(out)
