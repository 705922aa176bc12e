"""``paratrain verify --tf``: N TensorFlow workers equal one worker on the same global batch, or the reason why not.

The digits CNN, or the user's ``module:function`` (returning ``(model, x, y[, loss])``), trains K steps of
``model.fit`` (SGD) under ``paratrain run --tf`` twice: one worker (the reference)
and N workers (``MultiWorkerMirroredStrategy``), same seed, same global batch. Their weights must agree within the
tolerance (1e-5: two workers differ from one by the order of the sums, about 3e-8 here). When they do not, the
workers' own records name the usual causes: different initial weights (a seed per worker, or none), data
every worker reads whole (unsharded) or that reaches the job only in part (double-sharded), and a dataset batched
with the per-worker batch instead of the global one (batch not scaled). (A seed per worker is harmless here:
``MultiWorkerMirroredStrategy`` copies worker 0's initial values to the others when the model is built; the
initial weights are still compared, for strategies and loops that do not.)
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError

DEFAULT_TOLERANCE = 1e-5


@dataclass
class TFVerifyResult:
    workers: int
    steps: int
    max_abs_diff: float
    tolerance: float
    causes: list[str] = field(default_factory=list)
    model: str = "digits CNN"

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def report(self) -> str:
        verdict = "PASS" if self.passed else "FAIL"
        lines = [
            f"paratrain verify --tf: {self.model}, model.fit with SGD, {self.steps} steps, 1 worker vs "
            f"{self.workers} workers on the same global batch",
            f"{'workers':>7}  {'max |Δ weight|':>14}  {'tolerance':>9}  verdict",
            f"{self.workers:>7}  {self.max_abs_diff:>14.3g}  {self.tolerance:>9.0e}  {verdict}",
        ]
        lines += [f"  cause: {c}" for c in self.causes]
        if not self.passed and not self.causes:
            lines.append(
                "  cause: none of the usual ones found (unsharded or double-sharded data, batch not scaled, "
                "different initial weights); look for per-worker randomness (dropout, augmentation)"
            )
        return "\n".join(lines)


def verify_tf(
    *,
    nproc: int = 2,
    steps: int = 5,
    batch_size: int = 32,
    tolerance: float = DEFAULT_TOLERANCE,
    mistake: str = "none",
    factory: str | None = None,
) -> TFVerifyResult:
    """Run the reference and the N-worker job, compare them, diagnose a difference."""
    from .launcher import run

    if nproc < 2:
        raise ConfigError(f"verify --tf compares N >= 2 workers with one, got -n {nproc}")
    if steps < 1 or batch_size < nproc or batch_size % nproc:
        raise ConfigError(f"--steps must be >= 1 and the global batch ({batch_size}) a multiple of -n {nproc}")
    with tempfile.TemporaryDirectory(prefix="paratrain-tf-verify-") as tmp:
        job = [
            "-m",
            "paratrain.tf.verify_job",
            "--steps",
            str(steps),
            "--batch-size",
            str(batch_size),
            *(["--factory", factory] if factory else []),
        ]
        run(["-n", "1", *job, "--out", os.path.join(tmp, "ref")])
        run(["-n", str(nproc), *job, "--mistake", mistake, "--out", os.path.join(tmp, "par")])
        ref, ref_weights = _load(os.path.join(tmp, "ref"), 0)
        pars = [_load(os.path.join(tmp, "par"), r) for r in range(nproc)]
    diff = max(float(np.max(np.abs(pars[0][1][k] - ref_weights[k]))) for k in ref_weights)
    result = TFVerifyResult(
        workers=nproc, steps=steps, max_abs_diff=diff, tolerance=tolerance, model=factory or "digits CNN"
    )
    if not result.passed:
        result.causes = diagnose(ref, [p[0] for p in pars])
    return result


def diagnose(ref: dict, workers: list[dict]) -> list[str]:
    """The usual causes, each found in the workers' records (not guessed)."""
    causes = []
    if len({w["initial"] for w in workers}) > 1:
        causes.append(
            "different initial weights: the workers built different models; call "
            "tf.keras.utils.set_random_seed(SEED) with one seed on every worker before building it"
        )
    n = len(workers)
    if any(w["batch"] * n == ref["batch"] for w in workers):
        causes.append(
            f"batch not scaled: each worker's dataset is batched with {workers[0]['batch']}, the per-worker "
            f"share; under tf.distribute the dataset's batch is the global one ({ref['batch']}): "
            "batch with paratrain.tf.global_batch(per_replica, strategy)"
        )
    for step, ref_seen in enumerate(ref["seen"]):
        parts = [set(w["seen"][step]) for w in workers]
        union = set().union(*parts)
        if all(p == parts[0] for p in parts) and n > 1 and parts[0]:
            causes.append(
                f"unsharded data: at step {step + 1} every worker read the same samples; set the dataset's "
                "auto-shard policy (paratrain.tf.auto_shard(dataset, 'DATA')) or split it per worker"
            )
            break
        if sum(len(p) for p in parts) == len(ref_seen) and union != set(ref_seen):
            causes.append(
                f"double-sharded data: at step {step + 1} the workers together read other samples than "
                "one worker does; shard once (dataset.shard by hand and auto-shard OFF, or auto-shard only)"
            )
            break
    return causes


def _load(prefix: str, rank: int) -> tuple[dict, dict[str, np.ndarray]]:
    with open(f"{prefix}.worker{rank}.json") as f:
        record = json.load(f)
    with np.load(f"{prefix}.worker{rank}.npz") as data:
        return record, {k: data[k] for k in data.files}
