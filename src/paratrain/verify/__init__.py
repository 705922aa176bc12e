"""``paratrain verify``: does training in parallel compute what one process computes on the global batch?

The user's factory (``module:function`` returning a :class:`VerifySpec`) is built on every rank of a job of
``nprocs`` processes and trained with a strategy for K optimizer steps; the same setup is then trained in this
process on the global batches, from rank 0's initial weights. Losses, gradient norms and parameters are
compared step by step, against the noise floor that the reference measures by training a second time with
its sums in another order (or a fixed ``tolerance``). The verdict is PASS, or FAIL with the first diverging step
and parameter and the causes the evidence points at. See docs/verify.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..launcher.spawn import launch
from ..strategies import check_every_rank_trains, check_name, check_world
from .distributed import Case, RankEvidence, case_options, run_cases
from .record import Record
from .reference import Feeds, reference_run
from .report import VerifyReport, build_report, format_report
from .spec import VerifySpec, build_spec, paratrain_loop

__all__ = ["Case", "VerifyReport", "VerifySpec", "format_report", "paratrain_loop", "verify", "verify_cases"]


def verify(
    factory: str,
    strategies: str | Sequence[str] = "ddp",
    nprocs: int = 2,
    *,
    steps: int | None = None,
    options: dict[str, Any] | None = None,
    tolerance: float | None = None,
    timeout_s: float = 300.0,
    accelerator: str = "auto",
) -> list[VerifyReport]:
    """Check ``factory``'s setup under each of ``strategies`` on ``nprocs`` processes (one job for all).
    ``options``: strategy options besides the spec's own ``options`` (as the command's ``--tp`` gives)."""
    names = [strategies] if isinstance(strategies, str) else list(strategies)
    cases = [Case(factory=factory, strategy=name, options=dict(options or {}), steps=steps) for name in names]
    return verify_cases(cases, nprocs, tolerance=tolerance, timeout_s=timeout_s, accelerator=accelerator)


def verify_cases(
    cases: Sequence[Case],
    nprocs: int,
    *,
    tolerance: float | None = None,
    timeout_s: float = 300.0,
    accelerator: str = "auto",
) -> list[VerifyReport]:
    """Run every case in one job of ``nprocs`` processes, then each reference here (on the CPU); one report per
    case. ``accelerator``: where the parallel run trains (``auto``: one GPU per process when there are enough).
    ``tolerance``: judge with this fixed tolerance instead of the measured noise floor (no second reference)."""
    from ..devices import ACCELERATORS
    from ..errors import ConfigError

    if accelerator not in ACCELERATORS:
        raise ConfigError(f"unknown accelerator {accelerator!r}; choose one of {', '.join(ACCELERATORS)}")
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if accelerator == "auto":
        accelerator = "cuda" if gpus >= nprocs else "cpu"
    elif accelerator == "cuda" and gpus < nprocs:
        raise ConfigError(
            f"{nprocs} processes on the GPU need {nprocs} GPUs, {gpus} visible; use fewer processes or "
            "--accelerator cpu"
        )

    check_comparison(nprocs, tolerance)
    _check_cases(cases, nprocs)
    ranks = launch(run_cases, nprocs, args=(list(cases), timeout_s, accelerator), timeout_s=timeout_s)
    references: dict[tuple, Record] = {}
    reports = []
    for i in range(len(cases)):
        evidence = [rank[i] for rank in ranks]
        ref = _reference(evidence, references, "global")
        twin = _reference(evidence, references, "shards") if tolerance is None else None
        reports.append(build_report(evidence, ref, twin, world=nprocs, tolerance=tolerance))
    return reports


def check_comparison(nprocs: int, tolerance: float | None) -> None:
    """One line for a comparison verify cannot make: fewer than 2 processes, or a tolerance that is not positive
    (a spec's cases and an unchanged script alike)."""
    from ..errors import ConfigError

    if tolerance is not None and tolerance <= 0:
        raise ConfigError(f"tolerance must be > 0, got {tolerance}")
    if nprocs < 2:
        raise ConfigError(f"verify compares a parallel run with one process: use 2 or more processes, got {nprocs}")


def _check_cases(cases: Sequence[Case], nprocs: int) -> None:
    """One line, before anything starts, for a factory that cannot be imported or built, a strategy that cannot
    run with its options (the spec's and the command's together) on ``nprocs`` processes, or a bad step count."""
    from ..errors import ConfigError

    for case in cases:  # names first: cheap, and the likelier mistake
        check_name(case.strategy)
    specs = {factory: build_spec(factory) for factory in dict.fromkeys(c.factory for c in cases)}
    for case in cases:
        spec = specs[case.factory]
        options = case_options(case, spec)
        try:
            check_world(case.strategy, nprocs, **options)
            check_every_rank_trains(case.strategy, **options)
        except ConfigError as err:
            if not spec.run_options.strategy:
                raise
            given = ", ".join(sorted(spec.run_options.strategy))
            raise ConfigError(
                f"{err} (the strategy got {given} from VerifySpec.options: keywords that are not "
                "Parallel's own go to the strategy)"
            ) from None
        if case.steps is not None and case.steps < 1:
            raise ConfigError(f"steps must be >= 1, got {case.steps}")


def _reference(ranks: list[RankEvidence], cache: dict[tuple, Record], order: str) -> Record | None:
    """The single-process run matching the parallel run's setup, its global batches in ``order`` (shared by
    strategies with the same data split): the spec's loader's samples when the loop read through it, else the
    batches the parallel run fed its model, replayed."""
    main = ranks[0]
    if main.error is not None or main.init_state is None:
        return None
    d = main.data
    feeds = None if d is not None and any(r.fetched for r in ranks) else fed_feeds(ranks)
    split = (d.seed, d.shuffle, d.drop_last, d.micro_batch) if feeds is None else (feeds.digest(),)
    key = (main.case.factory, main.init_digest, main.replicas, *split, main.accumulate, main.record.steps, order)
    if key not in cache:
        cache[key] = reference_run(
            main.case.factory, main.init_state, d, main.accumulate, main.record.steps, order, feeds
        )
    return cache[key]


def fed_feeds(ranks: list[RankEvidence]) -> Feeds:
    """What each data-parallel replica fed its model and loss (its first rank's record)."""
    first = {}
    for r in ranks:
        first.setdefault(r.replica, r.record)
    replicas = [first[k] for k in sorted(first)]
    return Feeds(
        inputs=[r.inputs for r in replicas],
        targets=[r.targets for r in replicas],
        first_call=replicas[0].first_call,
        first_targets=replicas[0].first_targets,
    )
