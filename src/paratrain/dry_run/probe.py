"""A dry run of ``prepare`` at any world size, in one CPU process, in seconds.

The model is built on the meta device and laid out by the strategy's own code (the same ``wrap_model`` and
``wrap_optimizer`` that ``prepare`` calls) as rank ``r`` of a world of ``N``, over PyTorch's fake process group
(``torch.testing._internal.distributed.fake_pg``: every collective returns at once, nothing is allocated). What a
rank holds is then read from the real sharded tensors: parameter, gradient and optimizer-state bytes per rank. Any
layout error a launch would hit (heads not divisible by tp, more stages than blocks, a tie the layout would split)
is raised by the same code, so it shows here in one line instead of after a queue wait on 128 GPUs.

Ranks probed: rank 0, the last rank (uneven shards end there), and the first rank of every pipeline stage.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from ..env import ClusterEnv
from ..errors import ConfigError, ParatrainError
from ..model.facts import ModelFacts
from ..planner.training import OPTIMIZER_STATES

if TYPE_CHECKING:
    from ..planner.inputs import TrainingCall
from ..strategies.base import Runtime


@dataclass(frozen=True)
class RankBytes:
    """What one rank holds across steps, in bytes, read from its tensors."""

    rank: int
    parameters: int
    gradients: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.parameters + self.gradients + self.optimizer_states


@dataclass
class DryRun:
    """The layout of ``strategy`` at ``world`` ranks, rank by rank probed, or the error a launch would hit."""

    strategy: str
    world: int
    layout: str = ""
    ranks: list[RankBytes] = field(default_factory=list)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def busiest(self) -> RankBytes:
        return max(self.ranks, key=lambda r: r.total)

    def as_dict(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "world": self.world,
            "layout": self.layout,
            "error": self.error,
            "notes": self.notes,
            "seconds": round(self.seconds, 3),
            "ranks": [{**asdict(r), "total": r.total} for r in self.ranks],
        }

    def table(self) -> str:
        if self.error is not None:
            return f"dry run of {self.strategy} at world {self.world}: {self.error}"
        gib = 2**30
        lines = [
            f"dry run of {self.layout} at world {self.world} ({self.seconds:.1f} s, fake process group)",
            f"{'rank':>6} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} {'total GiB':>10}",
        ]
        lines += [
            f"{r.rank:>6} {r.parameters / gib:>11.3f} {r.gradients / gib:>10.3f} "
            f"{r.optimizer_states / gib:>10.3f} {r.total / gib:>10.3f}"
            for r in self.ranks
        ]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def dry_run(
    build: Callable[[], nn.Module],
    *,
    world: int,
    strategy: str,
    options: dict[str, Any] | None = None,
    precision: str = "fp32",
    optimizer: str = "adamw",
    per_node: int = 8,
) -> DryRun:
    """Lay ``build()`` (called under ``torch.device("meta")``) out as ``strategy`` over ``world`` ranks of
    ``per_node`` each; see the module's docstring."""
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(f"dry run: optimizer {optimizer!r} unknown; use one of {', '.join(OPTIMIZER_STATES)}")
    if dist.is_available() and dist.is_initialized():
        raise ConfigError("a dry run starts its own fake process group: run it in a process without one")
    out = DryRun(strategy=strategy, world=world)
    start = time.perf_counter()
    todo, done = [0], set()
    try:
        while todo and len(done) < 16:
            rank = todo.pop(0)
            if rank in done:
                continue
            done.add(rank)
            held, more, out.layout, notes = _probe(
                build, rank, world, strategy, options or {}, precision, optimizer, per_node
            )
            out.ranks.append(held)
            out.notes += [n for n in notes if n not in out.notes]
            if rank == 0:
                todo += [r for r in [*more, world - 1] if r not in done]
    except ParatrainError as err:
        out.error = str(err)
    except (RuntimeError, ValueError, AssertionError) as err:  # torch's own refusal of the layout
        out.error = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    out.seconds = time.perf_counter() - start
    out.ranks.sort(key=lambda r: r.rank)
    return out


def _probe(
    build: Callable[[], nn.Module],
    rank: int,
    world: int,
    strategy: str,
    options: dict[str, Any],
    precision: str,
    optimizer: str,
    per_node: int,
) -> tuple[RankBytes, list[int], str, list[str]]:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..parallel import Parallel
    from ..settings import JobConfig

    local = min(per_node, world)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        env = ClusterEnv(rank=rank, local_rank=rank % local, world_size=world, local_world_size=local, launched=True)
        par = Parallel(
            strategy, job=JobConfig(env=env), accelerator="cpu", precision=precision, monitor=False, **options
        )
        with torch.device("meta"):
            model = build()
        opt = torch.optim.AdamW(model.parameters()) if any(p.requires_grad for p in model.parameters()) else None
        facts = ModelFacts.of(model)
        rt = Runtime(env=env, device=par.device, mesh=par.mesh, precision=par.precision, facts=facts)
        wrapped = par.strategy.wrap_model(model, rt)  # what prepare runs, materialization left out
        inner = par.strategy.unwrap(wrapped)
        facts.check_ties(inner, par.strategy.name)
        prepared = par.strategy.wrap_optimizer(opt, wrapped, rt) if opt is not None else None
        held = _held(inner, prepared, OPTIMIZER_STATES[optimizer], rank)
        return held, _stage_heads(par), par.strategy.describe(), _uneven_tp(inner)
    finally:
        dist.destroy_process_group()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(t: torch.Tensor) -> int:
    local = _local(t)
    return local.numel() * local.element_size()


def _held(model: nn.Module, optimizer: torch.optim.Optimizer | None, states: int, rank: int) -> RankBytes:
    params = {id(p): p for p in model.parameters()}.values()
    local_optim = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer: this rank's partition
    trained = {id(p): p for g in (local_optim.param_groups if local_optim is not None else []) for p in g["params"]}
    return RankBytes(
        rank=rank,
        parameters=sum(_bytes(p) for p in params),
        gradients=sum(_bytes(p) for p in params if p.requires_grad),
        optimizer_states=states * sum(_bytes(p) for p in trained.values()),
    )


def _uneven_tp(model: nn.Module) -> list[str]:
    """A note per tensor-parallel weight whose split dimension does not divide by tp (GPT-2's vocabulary of 50257
    over tp=8): DTensor shards it unevenly, as ``torch.chunk`` does, and it trains (tests/distributed/test_tp_auto.py,
    vocabulary 65 over tp=2 and 4); the last ranks hold fewer rows and wait on the first."""
    notes = []
    for name, p in model.named_parameters():
        names = getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ()
        if "tp" not in names:
            continue
        tp, placement = p.device_mesh["tp"].size(), p.placements[names.index("tp")]
        dim = getattr(placement, "dim", None)
        if placement.is_shard() and dim is not None and p.shape[dim] % tp:
            rows = p.shape[dim]
            notes.append(
                f"{name} (dimension {dim} of {rows}) splits unevenly over tp={tp}: {-(-rows // tp)} "
                f"rows per rank, fewer on the last; it runs (DTensor shards unevenly), a vocabulary padded "
                f"to a multiple of {tp} would balance it"
            )
    return notes


def _stage_heads(par: Any) -> list[int]:
    """The first rank of every pipeline stage (none without stages)."""
    mesh = par.mesh
    names = mesh.mesh_dim_names or () if mesh is not None else ()
    if "pp" not in names:
        return []
    grid = mesh.mesh.movedim(names.index("pp"), 0).reshape(mesh["pp"].size(), -1)
    return [int(r) for r in grid[:, 0]]


def model_builder(model: str | None, model_config: str | None) -> Callable[[], nn.Module]:
    """What ``paratrain dry-run`` builds: a transformers model from a local ``config.json``
    (``--model-config``, the real class: GPT-2, Llama, …), or a built-in model or ``module:factory`` (``--model``)."""
    if model_config is not None:
        from transformers import AutoModelForCausalLM

        config = _config(model_config)
        return lambda: AutoModelForCausalLM.from_config(config)
    if model is None:
        raise ConfigError("a dry run builds the model: give --model (a built-in or module:factory) or --model-config")
    if ":" in model:
        from ..factory import load_callable

        return load_callable(model, "--model")
    from ..workloads.model_names import model_input

    return model_input(model)[0]


def model_sample(model: str | None, model_config: str | None, input_spec: str | None, seq_len: int) -> TrainingCall:
    """How ``--step`` calls the model :func:`model_builder` builds: on ``input_spec`` (``--input``) when given, else
    a built-in's own input, else ``seq_len`` token ids (below a transformers config's vocabulary)."""
    from ..planner.inputs import InputSpec, TrainingCall

    if input_spec is not None:
        return TrainingCall.of(InputSpec.parse(input_spec))
    if model is not None and ":" not in model:
        from ..workloads.model_names import model_input

        return TrainingCall.of(model_input(model)[1])
    vocab = getattr(_config(model_config), "vocab_size", None) if model_config is not None else None
    return TrainingCall.of(InputSpec(shape=(seq_len,), dtype=torch.long, high=vocab))


def _config(model_config: str) -> Any:
    """The transformers config at ``--model-config`` (a config.json or its folder)."""
    from pathlib import Path

    path = Path(model_config)
    folder = path.parent if path.name == "config.json" else path
    if not (folder / "config.json").exists():
        raise ConfigError(f"--model-config {model_config}: no config.json there")
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder), local_files_only=True)
