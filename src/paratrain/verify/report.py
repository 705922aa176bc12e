"""A verify verdict, built from both runs' evidence, and its text for the terminal."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .diagnose import (
    Divergence,
    Finding,
    batchnorm_finding,
    data_findings,
    fed_findings,
    first_divergence,
    gradient_scale_finding,
    ranks_apart,
    replicas_finding,
    router_loss_finding,
    tie_finding,
    untrained_finding,
)
from .distributed import RankEvidence
from .floor import FloorSummary, Judge, NoiseFloor, Tolerance
from .record import Record

FALLBACK_TOLERANCE = 1e-5
"""The tolerance when no floor could be measured (the reference is not repeatable): fp32 rounding, relative."""
UNREPEATABLE = Finding(
    cause="randomness in the training step",
    evidence="",
    hint="verify with dropout and random augmentation off (p=0, not only model.eval() if the loop calls "
    "model.train()): after prepare each rank draws its own random numbers, so no parallel run can equal one "
    "process; and make the loss independent of the order of the samples in a batch",
)
GENERIC_CAUSES = (
    "randomness that differs per rank: dropout or augmentation draw from per-rank random streams after prepare "
    "(verify with dropout off)",
    "model or loop code that depends on the rank, the world size or the batch size",
    "a loop that steps, zeroes or clips gradients differently from par.step",
    "numerics the noise floor does not hold: the parallel run on a GPU and the reference on the CPU use other "
    "kernels (pass --tolerance)",
)


@dataclass(kw_only=True)
class VerifyReport:
    """PASS or FAIL for one factory and strategy, with where and why."""

    factory: str
    strategy: str
    world: int
    accumulate: int = 1
    options: dict[str, str] = field(default_factory=dict)
    """The ``Parallel`` options the parallel run got besides the strategy and accumulation (``repr`` of each)."""
    steps: int = 0
    """Optimizer steps compared."""
    epochs: float = 0.0
    """How many epochs of the spec's loader those steps span (0 when the loop read from something else)."""
    replayed: bool = False
    """The loop read from something other than the spec's loader: the reference replayed what it fed the model."""
    tolerance: float | None = None
    """The user's fixed tolerance; None: judged against the measured noise floor."""
    floor: FloorSummary | None = None
    """The noise floor measured between two correct one-process runs (None under a fixed tolerance)."""
    passed: bool = False
    divergence: Divergence | None = None
    """The first step where anything differs."""
    parameters_apart: Divergence | None = None
    """The first step after which the parameters differ, and the entry that differs most."""
    findings: list[Finding] = field(default_factory=list)
    """Causes found in the evidence (any makes the check fail)."""
    warnings: list[Finding] = field(default_factory=list)
    """Problems that did not change this run's math (they would under another strategy)."""
    notes: list[str] = field(default_factory=list)
    max_param_diff: float = 0.0
    error: str | None = None
    """The setup could not run (a one-line paratrain error)."""

    @property
    def verdict(self) -> str:
        return "ERROR" if self.error else ("PASS" if self.passed else "FAIL")


def build_report(
    ranks: list[RankEvidence], ref: Record | None, twin: Record | None, *, world: int, tolerance: float | None
) -> VerifyReport:
    """The verdict on one case: ``ref`` is the reference run, ``twin`` the same in another summation order (the
    noise floor; None with a fixed ``tolerance``)."""
    main = ranks[0]
    report = VerifyReport(
        factory=main.case.factory,
        strategy=main.case.strategy,
        world=world,
        accumulate=main.accumulate,
        options=main.options,
        tolerance=tolerance,
    )
    if main.error is not None or ref is None or (twin is None and tolerance is None):
        report.error = main.error or "the parallel run recorded nothing"
        return report
    if ref.error is not None:
        report.error = f"the one-process run could not replay the parallel run's batches: {ref.error}"
        return report
    if main.record.steps == 0:
        report.error = (
            "the training loop ended before its first optimizer step; give it more data or fewer accumulation steps"
        )
        return report
    report.steps = min(main.record.steps, ref.steps)
    report.replayed = ref.replayed
    if main.data is not None and not ref.replayed:
        report.epochs = report.steps / max(main.data.steps_per_epoch(main.accumulate), 1e-9)
    if main.record.steps < main.steps:
        report.notes.append(f"the training loop ended after {main.record.steps} of {main.steps} steps")
    judge: Judge = Tolerance(tolerance or FALLBACK_TOLERANCE)
    if tolerance is None:
        floor = NoiseFloor(ref, twin, rounding=main.rounding, start=main.init_state)
        report.floor = floor.summary()
        unrepeatable = floor.unrepeatable(ref)
        if unrepeatable is None:
            judge = floor
        else:  # the floor measured the randomness, not rounding: judge by fp32's tolerance, name the cause
            report.findings.append(replace(UNREPEATABLE, evidence=unrepeatable))
            report.tolerance = FALLBACK_TOLERANCE
    report.divergence, report.parameters_apart, report.max_param_diff = first_divergence(ranks, ref, judge)
    data, notes = fed_findings(ranks) if ref.replayed or main.data is None else data_findings(ranks, main.data)
    report.notes += notes
    report.findings += data
    apart = ranks_apart(ranks)
    if apart is not None:  # prepare started every rank from rank 0's weights: worth knowing, no fault
        report.notes.append(
            f"the model {apart} built differs from rank 0's before prepare; every rank started from "
            "rank 0's weights, as the reference did"
        )
    if not data:  # the first step saw the reference's weights and samples
        for finding in (
            gradient_scale_finding(ranks, ref, main.accumulate, main.replicas),
            batchnorm_finding(ranks, ref, max(tolerance or 0.0, 1e-4), ref.window),
        ):
            if finding is not None:
                report.findings.append(finding)
    routed = router_loss_finding(ranks, main.replicas) if report.divergence is not None else None
    for finding in (tie_finding(ranks, ref), untrained_finding(ranks, ref), routed):
        if finding is not None:
            report.findings.append(finding)
    drift = replicas_finding(ranks)
    if drift is not None and not report.findings:
        report.findings.append(drift)
    report.passed = report.divergence is None and not report.findings
    return report


def format_report(report: VerifyReport) -> str:
    options = "".join(f", {k}={v}" for k, v in report.options.items())
    head = (
        f"paratrain verify {report.factory}: strategy {report.strategy}{options}, {report.world} processes, "
        f"accumulate {report.accumulate}"
    )
    if report.error:
        return f"{head}\nERROR: {report.error}"
    span = "on the batches the loop fed" if report.replayed else f"({report.epochs:.1f} epochs)"
    lines = [f"{head}, {report.steps} steps {span} against one process on the global batch"]
    d = report.divergence
    if report.passed:
        lines.append(
            f"PASS: losses, gradient norms and parameters equal the single-process run at every step "
            f"(max |parameter diff| {report.max_param_diff:.2g}, {_judged(report)})"
        )
    elif d is None:
        lines.append("FAIL: the numbers agree within what is allowed, but the run is not equivalent:")
    elif d.what == "parameters":
        lines.append(
            f"FAIL: diverges at step {d.step}: after the update, parameter '{d.parameter}' differs by "
            f"{d.max_diff:.3g} ({_allowed(d)})"
        )
    else:
        p = report.parameters_apart
        apart = (
            f"first parameter apart: '{p.parameter}' after step {p.step} (|diff| {p.max_diff:.3g})"
            if p
            else "the parameters stay within what is allowed"
        )
        lines.append(
            f"FAIL: diverges at step {d.step}: {d.what} {d.parallel:.6g} in parallel vs {d.reference:.6g} in "
            f"one process (|diff| {d.max_diff:.3g}, {_allowed(d)}); {apart}"
        )
    if report.findings:
        lines.append("likely cause" + ("s:" if len(report.findings) > 1 else ":"))
        for f in report.findings:
            lines += [f"  - {f.cause}: {f.evidence}", f"    fix: {f.hint}"]
    elif not report.passed:
        matched = "gradient scale, BatchNorm statistics, initial weights"
        checked = (
            f"each replica fed the model batches of its own; {matched} match"
            if report.replayed
            else f"samples read, {matched} all match"
        )
        lines.append(f"no cause found in the evidence ({checked}); other likely causes:")
        lines += [f"  - {c}" for c in GENERIC_CAUSES]
    for w in report.warnings:
        lines += [f"warning: {w.cause}: {w.evidence}", f"    fix: {w.hint}"]
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def _judged(report: VerifyReport) -> str:
    """How the verdict was judged, for the PASS line."""
    if report.floor is None:
        return f"tolerance {report.tolerance:g}"
    return (
        f"noise floor {report.floor.parameters:.2g}: two correct one-process runs summing in other orders "
        f"differ by that much; allowed {report.floor.margin:g}x the floor"
    )


def _allowed(d: Divergence) -> str:
    if d.floor is None:
        return f"allowed {d.allowed:.3g} by the fixed tolerance"
    return f"allowed {d.allowed:.3g}: noise floor {d.floor:.3g} there"
