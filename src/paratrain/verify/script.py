"""``paratrain verify train.py [args]``: an unchanged training script, checked for K optimizer steps, no spec file.

The parallel run launches the script on N processes as ``paratrain run`` does, with
:data:`~paratrain.script_verify.VAR` set; every ``Parallel`` it builds comes here (:func:`take_over_launched`): the
strategy is the command's (else the script's), and its ``prepare(model, optimizer)`` installs the hooks the spec
path uses (:mod:`.record`): initial weights, losses (the model's own), gradient norms before clipping, what every
micro-step inside ``par.step`` fed the prepared model (forwards outside it, such as an evaluation, are not
training), the state after each step. After K steps each rank writes its evidence to the folder the variable names
and the script ends (exit 0).

The reference runs the same script here, in one process, with ``Parallel("single")`` and the script's own
``Parallel`` keywords (strategy options dropped), from rank 0's initial weights: its model calls inside ``par.step``
get the replicas' recorded batches joined (:class:`~.reference.Replay`), so the script's own loader, whatever it
reads, computes on the parallel run's global batch. Reports come from the same evidence as the spec path's.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import runpy
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ..digest import state_digest
from ..env import ClusterEnv
from ..errors import ConfigError
from ..script_verify import VAR, hold
from ..settings import JobConfig
from ..strategies import check_name
from . import check_comparison, fed_feeds
from .distributed import FED_DEFAULT_STEPS, Case, RankEvidence
from .floor import split_like_ranks
from .options import OWN_KEYWORDS
from .record import Record, RecordHooks, watch_steps
from .reference import ORDERS, Replay, ReplayMismatch, global_first, replay_run
from .report import VerifyReport, build_report

NOT_IN_REFERENCE = frozenset({"accumulate", "global_batch", "micro_batch", "accelerator", "env", "monitor", "log_with"})
"""The script's ``Parallel`` keywords the reference sets itself (its accumulation, one process on the CPU) or goes
without (the monitor, trackers: in both runs, verify's numbers are not the script's to log)."""


@dataclass(kw_only=True)
class _Reference:
    """What the reference run here needs from the parallel one, and what it brings back."""

    init_state: dict[str, torch.Tensor]
    steps: int
    accumulate: int
    replay: Replay
    split: int | None = None
    """The parallel run's micro-batch for the noise floor's twin under a 16-bit compute dtype (:mod:`.floor`)."""
    record: Record | None = None
    model: nn.Module | None = None
    """A copy of the script's model at the initial weights, before ``prepare`` (for :func:`global_first`)."""


class _Finished(Exception):
    """Ends the reference's run of the script after its K steps."""


def take_over_launched(init: Callable[..., None], par: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """Build ``par`` on a rank of the launched script, with the strategy :data:`VAR` names, and hook it."""
    plan = json.loads(os.environ[VAR])
    strategy = args[0] if args else kwargs.pop("strategy", "auto")
    kwargs = {k: v for k, v in kwargs.items() if k != "log_with"} | {**plan.get("options", {}), "monitor": False}
    init(par, plan.get("strategy") or strategy, **kwargs)
    _Hooks(par, _RankSide(par, plan))


def _take_over_here(ref: _Reference, init: Callable[..., None], par: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """Build ``par`` for the reference: one process, the script's own ``Parallel`` keywords, no strategy options."""
    own = {k: v for k, v in kwargs.items() if k in OWN_KEYWORDS and k not in NOT_IN_REFERENCE}
    job = replace(own.pop("job", None) or JobConfig(), env=ClusterEnv())  # one process, whatever the script's
    init(par, "single", **{**own, "accelerator": "cpu", "accumulate": ref.accumulate, "job": job, "monitor": False})
    _Hooks(par, _ReferenceSide(par, ref))


class _Side:
    """What differs between the parallel run and the reference around the shared hooks."""

    keep_states: bool
    steps: int

    def before(self, model: nn.Module) -> None: ...

    def after(self, prepared: nn.Module, recorder: RecordHooks, inside: Callable[[], bool]) -> None: ...

    def done(self, prepared: nn.Module, recorder: RecordHooks) -> None: ...


class _Hooks:
    """Replaces ``par.prepare`` and ``par.step`` on this one object: the first model prepared with an optimizer
    is recorded; only calls inside ``par.step`` are training."""

    def __init__(self, par: Any, side: _Side) -> None:
        self.par, self.side = par, side
        self.depth = 0
        self.recorder: RecordHooks | None = None
        self._prepare, self._step = par.prepare, par.step
        par.prepare, par.step = self.prepare, self.step

    def inside(self) -> bool:
        return self.depth > 0

    def prepare(self, *objects: Any) -> Any:
        models = [i for i, o in enumerate(objects) if isinstance(o, nn.Module)]
        optimizers = [i for i, o in enumerate(objects) if isinstance(o, torch.optim.Optimizer)]
        if self.recorder is not None or not models or not optimizers:
            return self._prepare(*objects)
        model = objects[models[0]]
        self.side.before(model)
        recorder = self.recorder = RecordHooks(model, own_loss=True)
        recorder.recording = self.inside
        out = self._prepare(*objects)
        prepared, optimizer = out[models[0]], out[optimizers[0]]
        self.side.after(prepared, recorder, self.inside)
        recorder.watch_inputs(prepared)
        side = self.side
        watch_steps(
            self.par,
            prepared,
            optimizer,
            recorder,
            lambda: side.steps,
            keep_states=side.keep_states,
            done=lambda: side.done(prepared, recorder),
        )
        return out

    @contextlib.contextmanager
    def step(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> Iterator[Any]:
        with self._step(model, optimizer) as info:
            self.depth += 1
            try:
                yield info
            finally:
                self.depth -= 1


class _RankSide(_Side):
    """A rank of the launched script: records, then writes its evidence and ends the script."""

    def __init__(self, par: Any, plan: dict[str, Any]) -> None:
        self.par, self.plan = par, plan
        self.steps = int(plan["steps"])
        self.keep_states = par.rank == 0
        self.evidence = RankEvidence(
            case=Case(factory=plan["label"], strategy="", steps=self.steps),
            options={k: repr(v) for k, v in plan.get("options", {}).items()},
            steps=self.steps,
        )

    def before(self, model: nn.Module) -> None:
        self.evidence.init_digest = state_digest(model)
        if self.par.rank == 0:
            self.evidence.init_state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    def done(self, prepared: nn.Module, recorder: RecordHooks) -> None:
        par, ev = self.par, self.evidence
        ev.case = replace(ev.case, strategy=par.strategy.name)  # what ran: the command's, else the script's
        ev.record, ev.replica, ev.replicas, ev.accumulate = recorder.record, *_layout(par)
        ev.final_digest = state_digest(par.full_state_dict(prepared, rank0_only=False))
        torch.save(ev, Path(self.plan["dir"]) / f"rank{par.rank}.pt")
        par.close()
        raise SystemExit(0)


def _layout(par: Any) -> tuple[int, int, int]:
    return par.data_parallel_rank, par.data_parallel_size, par.accumulate


class _ReferenceSide(_Side):
    """The reference here: rank 0's initial weights, the parallel run's batches replayed."""

    keep_states = True

    def __init__(self, par: Any, ref: _Reference) -> None:
        self.par, self.ref, self.steps = par, ref, ref.steps

    def before(self, model: nn.Module) -> None:
        model.load_state_dict(self.ref.init_state)
        self.ref.model = copy.deepcopy(model)

    def after(self, prepared: nn.Module, recorder: RecordHooks, inside: Callable[[], bool]) -> None:
        split_like_ranks(prepared, self.ref.split, self.par.precision)
        self.ref.replay.replaying = inside
        self.ref.replay.attach(prepared, recorder.record)

    def done(self, prepared: nn.Module, recorder: RecordHooks) -> None:
        self.ref.record = recorder.record
        self.par.close()
        raise _Finished


def verify_script(
    script: str,
    argv: Sequence[str],
    strategies: Sequence[str | None],
    nprocs: int,
    *,
    steps: int | None = None,
    options: dict[str, Any] | None = None,
    tolerance: float | None = None,
    timeout_s: float = 300.0,
) -> list[VerifyReport]:
    """Check the unchanged ``script`` (run with ``argv``) under each of ``strategies`` (None: the script's own) on
    ``nprocs`` processes, ``steps`` optimizer steps each, against one process on the same global batches."""
    if not script.endswith(".py") or not Path(script).is_file():
        raise ConfigError(f"verify: no script {script!r}; give a training script (train.py) or module:function")
    check_comparison(nprocs, tolerance)
    for strategy in strategies:
        if strategy is not None:
            check_name(strategy)
    steps = FED_DEFAULT_STEPS if steps is None else steps
    if steps < 1:
        raise ConfigError(f"steps must be >= 1, got {steps}")
    label = " ".join([script, *argv])
    reports = []
    for strategy in strategies:
        plan = {"label": label, "strategy": strategy, "options": options or {}, "steps": steps}
        evidence = _launch(script, argv, nprocs, plan, timeout_s)
        ref = _reference_of(script, argv, evidence, "global")
        twin = _reference_of(script, argv, evidence, "shards") if tolerance is None else None
        reports.append(build_report(evidence, ref, twin, world=nprocs, tolerance=tolerance))
    return reports


def _launch(script: str, argv: Sequence[str], nprocs: int, plan: dict[str, Any], timeout_s: float) -> list:
    """The script on ``nprocs`` processes under ``paratrain run``; each rank's evidence."""
    with tempfile.TemporaryDirectory(prefix="paratrain-verify-") as folder:
        env = {**os.environ, VAR: json.dumps({**plan, "dir": folder})}
        cmd = [sys.executable, "-m", "paratrain", "run", "-n", str(nprocs), script, *argv]
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"verify: {script} did not reach {plan['steps']} steps within {timeout_s:g} s") from None
        files = [Path(folder) / f"rank{r}.pt" for r in range(nprocs)]
        if done.returncode != 0 or not all(f.is_file() for f in files):
            raise ConfigError(
                f"verify: {script} under {plan['strategy'] or 'its own strategy'} ended before {plan['steps']} "
                f"optimizer steps of a model and optimizer given to par.prepare (exit {done.returncode}: "
                f"{_why(done.stderr)}); lower --steps, or see `paratrain run` on the script"
            )
        return [torch.load(f, weights_only=False) for f in files]


def _why(stderr: str) -> str:
    """The launcher's line naming the failed rank, after the script's own last line before it (its error)."""
    lines = [line.strip() for line in stderr.strip().splitlines() if line.strip()]
    said = next((i for i, line in enumerate(lines) if line.startswith("paratrain: ")), None)
    if said is None:
        return lines[-1] if lines else "no output"
    return "; ".join(lines[max(0, said - 1) : said + 1])


def _reference_of(script: str, argv: Sequence[str], ranks: list[RankEvidence], order: str) -> Record:
    """The script here in one process on the replayed global batches, in ``order`` (:data:`.reference.ORDERS`)."""
    assert order in ORDERS
    main = ranks[0]
    feeds = fed_feeds(ranks)
    assert main.init_state is not None, "rank 0 keeps the initial weights"
    init_state = main.init_state
    model: list[nn.Module] = []
    split = feeds.micro_batch() if order != ORDERS[0] else None

    def train(group: int, replay: Replay) -> Record:
        ref = _Reference(
            init_state=init_state,
            steps=main.record.steps,
            accumulate=main.accumulate // group,
            replay=replay,
            split=split,
        )
        _run_here(script, argv, ref)
        model[:] = [ref.model] if ref.model is not None else []
        assert ref.record is not None
        return ref.record

    def first() -> tuple[float, float]:
        return global_first(SimpleNamespace(model=model[0], loss=None), init_state, feeds)  # type: ignore[arg-type]

    return replay_run(train, feeds, main.accumulate, order, first)


def _run_here(script: str, argv: Sequence[str], ref: _Reference) -> None:
    """Run ``script`` as ``__main__`` in this process until :class:`_Finished`; its prints go to stderr."""
    saved = sys.argv, list(sys.path)
    sys.argv = [script, *argv]
    sys.path.insert(0, str(Path(script).resolve().parent))
    held = hold(functools.partial(_take_over_here, ref))
    try:
        with contextlib.redirect_stdout(sys.stderr):
            runpy.run_path(script, run_name="__main__")
    except _Finished:
        pass
    except ReplayMismatch:
        raise
    except Exception as err:  # the script's own: one line; --debug shows where
        first = str(err).splitlines()[0] if str(err) else ""
        raise ConfigError(
            f"verify: {script} raised {type(err).__name__} in one process: {first} (run it alone, or "
            "paratrain --debug verify, for its traceback)"
        ) from err
    finally:
        hold(held)
        sys.argv, sys.path[:] = saved
    if ref.record is None:
        raise ConfigError(
            f"verify: {script} in one process ended before {ref.steps} optimizer steps (the parallel run took them)"
        )
