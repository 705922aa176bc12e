"""A server's shard as a checkpoint holds it: flat ``{key: tensor}``, written and read by torch.distributed.checkpoint
in this one process (the server answers a worker's SAVE or LOAD from its serving loop; no other rank takes part).

Keys: ``model.<name>`` for the dense parameters it owns and for its rows of each table (with ``rows.<name>``:
``[lo, hi)``, so the rows of every server can be put back together), ``optim.<name>.<key>`` for each optimizer
state tensor beside them (``optim_int.``/``optim_float.`` for a plain number, such as SparseAdam's step), and
``version``: the optimizer steps this server has taken. Plain tensors only: nothing to unpickle but DCP's metadata.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .shards import ServerShards

StateIO = Callable[[dict[str, torch.Tensor], str], None]
"""``write(state, folder)``; ``read(folder) -> state`` is the other half: how the strategy stores a shard."""


@dataclass(frozen=True)
class ShardStore:
    """How a server writes and reads its shard (the checkpoint layer's safe DCP reader lives above this one)."""

    write: StateIO
    read: Callable[[str], dict[str, torch.Tensor]]
    start_write: Callable[[dict[str, torch.Tensor], str], Callable[[], None]]
    """Stage ``state`` (a copy) and write it into ``folder`` in the background; returns the wait for the write,
    which raises if it failed."""


_KINDS = {"optim": None, "optim_int": int, "optim_float": float}


def shard_state(shards: ServerShards, version: int) -> dict[str, torch.Tensor]:
    """Everything this server holds that a resume needs (views of the live tensors, not copies)."""
    state: dict[str, torch.Tensor] = {"version": torch.tensor(version, dtype=torch.int64)}
    owned = [(name, p, shards.optimizer) for name, p in shards.params.items()]
    for shard in shards.tables:
        name = f"{shard.table.name}.weight"
        state[f"rows.{name}"] = torch.tensor([shard.lo, shard.lo + shard.weight.shape[0]], dtype=torch.int64)
        owned.append((name, shard.weight, shard.optimizer))
    for name, p, optimizer in owned:
        state[f"model.{name}"] = p.detach()
        for key, value in (optimizer.state.get(p, {}) if optimizer is not None else {}).items():
            if torch.is_tensor(value):
                state[f"optim.{name}.{key}"] = value
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                kind = "optim_int" if isinstance(value, int) else "optim_float"
                state[f"{kind}.{name}.{key}"] = torch.tensor(value, dtype=torch.float64)
    return state


def load_shard_state(shards: ServerShards, state: dict[str, torch.Tensor]) -> int:
    """Put ``state`` (read from a checkpoint) into this server's parameters and optimizers, in place; returns its
    version. Raises ValueError when it is not this server's shard (another layout or server count)."""
    owned = {name: (p, shards.optimizer) for name, p in shards.params.items()}
    for shard in shards.tables:
        name = f"{shard.table.name}.weight"
        rows, here = state.get(f"rows.{name}"), [shard.lo, shard.lo + shard.weight.shape[0]]
        if rows is None or rows.tolist() != here:
            raise ValueError(f"it holds rows {None if rows is None else rows.tolist()} of {name}, this server {here}")
        owned[name] = (shard.weight, shard.optimizer)
    for name, (p, _) in owned.items():
        saved = state.get(f"model.{name}")
        if saved is None or saved.shape != p.shape:
            raise ValueError(f"{name} is {'missing' if saved is None else f'of shape {tuple(saved.shape)}'}")
    for name, (p, optimizer) in owned.items():
        with torch.no_grad():
            p.copy_(state[f"model.{name}"])  # in place: dense parameters are views of the flat buffer a pull sends
        if optimizer is not None:
            optimizer.state.pop(p, None)
    for key, value in state.items():
        kind, _, rest = key.partition(".")
        if kind not in _KINDS:
            continue
        name, _, field = rest.rpartition(".")
        if name not in owned or owned[name][1] is None:
            raise ValueError(f"it holds optimizer state for {name}, which this server does not train")
        p, optimizer = owned[name]
        cast = _KINDS[kind]
        optimizer.state.setdefault(p, {})[field] = value.clone() if cast is None else cast(value.item())
    return int(state["version"])
