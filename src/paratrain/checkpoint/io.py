"""Saving and loading everything an exact resume needs. Both are collective: every rank calls them.

What a checkpoint holds (see :mod:`paratrain.checkpoint.layout` for the files):

* every prepared model and optimizer, through torch.distributed.checkpoint (each rank writes its shard;
  replicated tensors are written once);
* ``train.pt``: the optimizer-step count, the epoch, every LR scheduler's and the grad scaler's state, rank 0's
  data-loader positions;
* ``rank-NNNNN.pt``: that rank's RNG states (Python, NumPy, torch, CUDA) and its loaders' positions and
  generator states;
* ``hf-model/``: a transformers model's ``config.json`` (and ``generation_config.json``), for an export to Hugging
  Face (``hf-model_1/`` for the second model…);
* ``meta.json``: format version, world size, strategy, model and optimizer classes, file sizes.
"""

from __future__ import annotations

import errno
import io
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointError
from . import hf, layout, rng, space
from .safety import SafePlanner, SafeReader, load_file, torch_reason
from .space import out_of_space

FORMAT = 1
TRAIN = "train.pt"
DCP_ERRORS = (Exception, CheckpointException)  # DCP's own error derives from BaseException


@dataclass(frozen=True, kw_only=True)
class Targets:
    """What of a running job a checkpoint saves or restores (``Parallel`` builds it)."""

    strategy: Any
    """The strategy, whose hooks say how its models and optimizers are saved."""
    models: list[nn.Module]
    """Prepared models, in the order ``prepare`` saw them."""
    optimizers: list[tuple[nn.Module, torch.optim.Optimizer]]
    """Prepared optimizers, each with the model it trains."""
    schedulers: list[Any]
    """LR schedulers passed to ``prepare``."""
    loaders: list[Any]
    """Prepared (sharded) data loaders, which know their position."""
    precision: Any
    """The precision plugin (its grad scaler)."""
    step: int
    """Optimizer steps taken."""
    epoch: int | None
    """The epoch in progress (``par.epochs``), or None when the job does not count epochs."""
    rank: int
    world_size: int
    barrier: Callable[[], None]
    """Waits for every rank (no-op in one process)."""
    gather: Callable[[Any], list[Any]]
    """Every rank's value of a small object, in rank order."""
    data: bool = True
    """Restore the loaders' positions on load (False: they read on from where they are, past the batches the
    numerics guard skipped)."""


@dataclass(frozen=True)
class Position:
    """Where a loaded checkpoint puts the job."""

    folder: Path
    step: int
    epoch: int | None
    world_size: int


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def rank0_planner() -> Any:
    """A save planner that writes a tensor every rank holds from rank 0, where torch lets it choose.

    Replicated tensors can differ across ranks: BatchNorm's running statistics are each rank's own (DDP
    broadcasts rank 0's at every forward). DCP writes one rank's copy, by default whichever balances the files; rank
    0's is the one ``full_state_dict`` shows and DDP continues from, so a resumed run matches the uninterrupted one.
    """
    import inspect

    from torch.distributed.checkpoint import DefaultSavePlanner

    if "dedup_save_to_lowest_rank" in inspect.signature(DefaultSavePlanner.__init__).parameters:
        return DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    return DefaultSavePlanner()


def save(t: Targets, root: Path, keep: int) -> Path:
    """Write a checkpoint of the job's current state to ``root/step-<step>``, atomically; return that folder."""
    import torch.distributed.checkpoint as dcp

    tmp = begin_save(t, root)
    state: dict[str, dict[str, Any]] = {}
    try:
        state = tensor_state(t)
        with quiet_single_process():
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(tmp),
                planner=rank0_planner(),
                process_group=t.strategy.server.checkpoint_group(),
            )
        alike(t, lambda: t.strategy.server.save_shards(tmp, t.rank))  # a parameter server's shards
        t.barrier()  # every rank's files are complete
        if t.rank == 0:
            publish(root, tmp, checkpoint_meta(t), keep)
    except DCP_ERRORS as e:
        raise write_failure(root, tmp, e, state_bytes(state), t.rank) from None
    t.barrier()  # nobody reads the folder before it is published
    return root / layout.step_name(t.step)


def begin_save(t: Targets, root: Path) -> Path:
    """Every rank: a fresh ``tmp-step-…`` folder (made by rank 0) holding each rank's RNG states and loader
    positions and rank 0's ``train.pt``; returns it. A failed write on any rank fails every rank alike, before any
    of DCP's collectives."""
    layout.check_root(root)  # every rank, before any waits on the others
    tmp = root / f"{layout.TMP_PREFIX}{layout.step_name(t.step)}"
    if t.rank == 0:
        layout.begin(root, t.step)
    t.barrier()
    try:
        loaders = [loader.state_dict() for loader in t.loaders]
        layout.write_file(tmp / rank_file(t.rank), _serialise({"rng": rng.capture(), "loaders": loaders}))
        if t.rank == 0:
            layout.write_file(
                tmp / TRAIN,
                _serialise(
                    {
                        "step": t.step,
                        "epoch": t.epoch,
                        "loaders": loaders,
                        "schedulers": [s.state_dict() for s in t.schedulers],
                        "precision": t.precision.state_dict(),
                    }
                ),
            )
            for i, model in enumerate(t.models):  # a transformers model's config, for an export to Hugging Face
                hf.write_config(t.strategy.unwrap(model), hf.config_folder(tmp, i))
        written = None
    except OSError as e:
        written = e
    failed = [f for f in t.gather(None if written is None else _why(written)) if f is not None]
    if failed:  # a full disk anywhere is named as one
        full = OSError(errno.ENOSPC, "No space left on device") if _NO_SPACE in failed else None
        raise write_failure(root, tmp, full or written or OSError(failed[0]), 0, t.rank)
    return tmp


def publish(root: Path, tmp: Path, meta: dict[str, Any], keep: int) -> Path:
    """Rank 0, once every rank's files in ``tmp`` are complete: ``meta.json``, the rename, ``latest``, pruning."""
    layout.write_meta(tmp, meta)
    final = layout.commit(root, tmp, meta["step"])
    layout.prune(root, keep)
    return final


def write_failure(root: Path, tmp: Path, err: BaseException, nbytes: int, rank: int) -> CheckpointError:
    """A failed save as one line (a full disk names the disk and what it needs: the last checkpoint's size, else
    ``nbytes``); rank 0 removes the partial folder, so the previous checkpoint and ``latest`` are all that is left."""
    if rank == 0:
        space.remove_partial(tmp)
    if out_of_space(err):
        return CheckpointError(space.no_space_message(root, tmp, nbytes))
    return CheckpointError(f"could not write checkpoint {tmp}: {first_failure(err)}")


def load(t: Targets, path: str | Path) -> Position:
    """Restore the job from the checkpoint at ``path`` (a ``step-…`` folder, or a root: its latest one).

    A job that prepared models but no optimizer (evaluation, inference) gets the models' weights only.
    """
    import torch.distributed.checkpoint as dcp

    folder = layout.checkpoint_folder(path)
    meta = layout.read_meta(folder)
    weights_only = not t.optimizers
    _check_meta(folder, meta, t, weights_only)
    reader = SafeReader(folder)
    saved = reader.read_metadata().state_dict_metadata
    state = tensor_state(t, optimizer=meta["optimizer_state"] and not weights_only)
    _check_fit(folder, saved, state, t)
    t.strategy.server.check_shards(folder)  # a parameter server's: on every rank alike
    train, mine = None, None
    if not weights_only:  # all that can refuse the checkpoint comes before anything is loaded
        train = load_file(folder / TRAIN)
        mine = load_file(folder / rank_file(t.rank)) if t.rank < meta["world_size"] else None
        same_world = meta["world_size"] == t.world_size
        positions = mine["loaders"] if same_world and mine is not None else train["loaders"]
        _check_count(
            folder, "data loader", len(positions), len(t.loaders), "prepare the same loaders in the same order"
        )
        _check_count(
            folder, "LR scheduler", len(train["schedulers"]), len(t.schedulers), "pass the same schedulers to prepare()"
        )
        for loader, position in zip(t.loaders if t.data else [], positions):
            loader.load_state_dict(position, train["epoch"])  # takes effect at the loader's next pass
    try:
        with quiet_single_process():
            dcp.load(
                state, storage_reader=reader, planner=SafePlanner(), process_group=t.strategy.server.checkpoint_group()
            )
    except DCP_ERRORS as e:
        raise load_failure(folder, e) from None
    for i, model in enumerate(t.models):
        t.strategy.load_model_state(model, state[_key("model", i)])
    alike(t, lambda: t.strategy.server.load_shards(folder, t.rank))
    if train is None:
        return Position(folder=folder, step=int(meta["step"]), epoch=None, world_size=meta["world_size"])
    for j, (model, optimizer) in enumerate(t.optimizers if meta["optimizer_state"] else []):
        t.strategy.load_optimizer_state(model, optimizer, state[_key("optim", j)])
    for scheduler, s in zip(t.schedulers, train["schedulers"]):
        scheduler.load_state_dict(s)
    t.precision.load_state_dict(train["precision"])
    if mine is not None:
        rng.restore(mine["rng"])  # last: nothing above may draw from the restored generators
    return Position(folder=folder, step=int(train["step"]), epoch=train["epoch"], world_size=meta["world_size"])


_NO_SPACE = "no space left"


def alike(t: Targets, work: Callable[[], None]) -> None:
    """Run ``work`` (which may fail on some ranks only: one rank talks to the servers), then fail on every rank
    alike with the first rank's one-line reason, or on none."""
    try:
        work()
        mine = None
    except CheckpointError as e:
        mine = str(e)
    failed = [f for f in t.gather(mine) if f is not None]
    if failed:
        raise CheckpointError(failed[0])


def _why(err: OSError) -> str:
    return _NO_SPACE if out_of_space(err) else first_failure(err)


def state_bytes(state: dict[str, dict[str, Any]]) -> int:
    """The bytes of the tensors ``state`` holds."""
    return sum(
        v.numel() * v.element_size() for part in state.values() for v in part.values() if isinstance(v, torch.Tensor)
    )


def _key(kind: str, index: int) -> str:
    return kind if index == 0 else f"{kind}_{index}"


def tensor_state(t: Targets, *, optimizer: bool | None = None) -> dict[str, dict[str, Any]]:
    """Everything DCP saves or loads: ``model``, ``model_1``… and ``optim``, ``optim_1``…, each keyed by parameter
    name; ``optimizer``: with the optimizers' entries (default: once the job has stepped).

    Before the first optimizer step there is no optimizer state to save (building it would step the optimizer).
    """
    if optimizer is None:
        optimizer = t.step > 0
    state = {_key("model", i): t.strategy.model_state(model) for i, model in enumerate(t.models)}
    if optimizer:
        for j, (model, opt) in enumerate(t.optimizers):
            state[_key("optim", j)] = t.strategy.optimizer_state(model, opt)
    return state


def checkpoint_meta(t: Targets) -> dict[str, Any]:
    """What ``meta.json`` says of the job at this save (``layout.write_meta`` adds every file's size)."""
    from ..version import __version__

    return {
        "format": FORMAT,
        "step": t.step,
        "epoch": t.epoch,
        "world_size": t.world_size,
        "strategy": t.strategy.name,
        "models": [type(m).__name__ for m in t.models],
        "optimizers": [_optimizer_class(o) for _, o in t.optimizers],
        "optimizer_state": t.step > 0,
        "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "paratrain": __version__,
        "torch": torch.__version__,
    }


def _optimizer_class(optimizer: torch.optim.Optimizer) -> str:
    inner = getattr(optimizer, "optim", None)  # ZeroRedundancyOptimizer shards an optimizer of the user's class
    return type(inner if isinstance(inner, torch.optim.Optimizer) else optimizer).__name__


def _check_meta(folder: Path, meta: dict[str, Any], t: Targets, weights_only: bool) -> None:
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {folder} has format {meta.get('format')!r}; this paratrain reads format {FORMAT}"
        )
    _check_count(folder, "model", len(meta["models"]), len(t.models), "prepare the same models")
    if weights_only:
        return
    _check_count(folder, "optimizer", len(meta["optimizers"]), len(t.optimizers), "prepare the same optimizers")
    here = [_optimizer_class(o) for _, o in t.optimizers]
    if meta["optimizers"] != here:
        raise CheckpointError(
            f"checkpoint {folder} was saved with optimizer(s) {', '.join(meta['optimizers'])}; "
            f"this job uses {', '.join(here)}"
        )
    if not meta["optimizer_state"] and t.step > 0:
        raise CheckpointError(
            f"checkpoint {folder} was saved before the first optimizer step and holds no optimizer "
            "state; load it before training, not into a job that has stepped"
        )


def _check_count(folder: Path, what: str, saved: int, here: int, fix: str) -> None:
    if saved != here:
        raise CheckpointError(f"checkpoint {folder} holds {saved} {what}(s), this job prepared {here}; {fix}")


def _check_fit(folder: Path, saved: dict[str, Any], state: dict[str, dict[str, Any]], t: Targets) -> None:
    """Refuse, on every rank alike, a checkpoint whose entries do not match what this job would load.

    The models are compared first: when they differ, the optimizer entries of the differing parameters would
    only repeat it.
    """
    missing, shapes = [], []
    for top, part in state.items():
        for name, value in part.items():
            key = f"{top}.{name}"
            if key not in saved:
                missing.append(key)
            elif isinstance(value, torch.Tensor) and tuple(getattr(saved[key], "size", value.shape)) != tuple(
                value.shape
            ):
                shapes.append(f"{key} (saved {tuple(saved[key].size)}, here {tuple(value.shape)})")
    model_keys = [f"{top}.{name}" for top, part in state.items() if top.startswith("model") for name in part]
    gathered = t.gather((model_keys, missing, shapes))  # a rank may hold only part of the model
    wanted = {k for keys, _, _ in gathered for k in keys}
    extra = sorted(k for k in saved if k.startswith("model") and k not in wanted)
    missing = sorted({k for _, m, _ in gathered for k in m})
    shapes = sorted({s for _, _, ss in gathered for s in ss})
    for part in ("model", "optim"):
        problems = []
        if any(k.startswith(part) for k in missing):
            some = [k for k in missing if k.startswith(part)]
            problems.append(f"{len(some)} entr{'y' if len(some) == 1 else 'ies'} missing from it ({_few(some)})")
        if part == "model" and extra:
            problems.append(f"{len(extra)} this job lacks ({_few(extra)})")
        if any(k.startswith(part) for k in shapes):
            problems.append(f"different shapes: {_few([k for k in shapes if k.startswith(part)])}")
        if problems:
            raise CheckpointError(
                f"checkpoint {folder} does not fit this job's "
                f"{part if part == 'model' else 'optimizer'}"
                f": {'; '.join(problems)}; load it into the model and optimizer it was saved from"
            )


def _few(items: list[str], n: int = 3) -> str:
    return ", ".join(items[:n]) + (f", … ({len(items) - n} more)" if len(items) > n else "")


def _serialise(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


@contextmanager
def quiet_single_process() -> Iterator[None]:
    """Without a process group DCP works in one process, as intended here; it need not warn about it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def quiet_background() -> None:
    """``quiet_single_process`` for a write in DCP's background thread, which a context manager here cannot reach:
    that one note is ignored in this process from now on."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def first_failure(err: BaseException) -> str:
    """The first rank's error inside DCP's ``CheckpointException``, in one line (without torch's advice)."""
    return str(_inner(err)) if isinstance(_inner(err), CheckpointError) else torch_reason(_inner(err))


def load_failure(folder: Path, err: BaseException) -> CheckpointError:
    """A failed DCP read: a refusal as it is, anything else (bytes that do not unpickle) as a damaged folder."""
    if isinstance(_inner(err), CheckpointError):
        return CheckpointError(f"could not load checkpoint {folder}: {_inner(err)}")
    return CheckpointError(
        f"checkpoint {folder} is damaged or unsafe: a tensor file cannot be read "
        f"({first_failure(err)}); load an older checkpoint (delete this folder)"
    )


def _inner(err: BaseException) -> BaseException:
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        return first[0] if isinstance(first, tuple) else first
    return err
