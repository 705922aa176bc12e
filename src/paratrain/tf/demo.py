"""``paratrain demo --tf``: the TensorFlow demo job (:mod:`paratrain.tf.demo_job`) on N workers through
``paratrain run --tf``, then a summary table: per worker its optimizer steps and median step time, and the job's
accuracy, wall time and throughput. Its options are the torch demo's (``DemoConfig``), those TensorFlow's job has."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import tempfile

from ..demo.config import DemoConfig
from ..errors import ConfigError
from ..flags import flag_name, to_argv

JOB_FIELDS = ("epochs", "batch_size", "lr", "seed", "fail_at_step", "fail_rank")
"""The options each worker reads (``--fail-at-step`` counts epochs there)."""
LAUNCH_FIELDS = ("nproc", "max_restarts", "checkpoint_dir")
"""The options the launcher reads (the checkpoint directory keeps ``BackupAndRestore``'s state)."""


def run_demo(config: DemoConfig) -> int:
    """Launch the job, print its summary; the exit code."""
    from .launcher import run

    _check_tf_options(config)
    with tempfile.TemporaryDirectory(prefix="paratrain-tf-demo-") as tmp:
        out = os.path.join(tmp, "summary.json")
        launch = ["-n", str(config.nproc or 2), "--max-restarts", str(config.max_restarts)]
        if config.checkpoint_dir:
            launch += ["--checkpoint-dir", config.checkpoint_dir]
        run([*launch, "-m", "paratrain.tf.demo_job", *to_argv(config, only=JOB_FIELDS), "--out", out])
        print(summary_table(out))
    return 0


def _check_tf_options(config: DemoConfig) -> None:
    """An option of the torch demo alone is one line here, not silently dropped."""
    default = DemoConfig()
    for f in dataclasses.fields(DemoConfig):
        if f.name not in (*JOB_FIELDS, *LAUNCH_FIELDS) and getattr(config, f.name) != getattr(default, f.name):
            raise ConfigError(f"{flag_name(DemoConfig, f.name)} is an option of the torch demo; drop it with --tf")


def summary_table(out: str) -> str:
    """The end-of-run table from the files the workers wrote next to ``out``."""
    with open(out) as f:
        job = json.load(f)
    rows = []
    for path in sorted(glob.glob(f"{out}.worker*")):
        with open(path) as f:
            rows.append(json.load(f))
    lines = [
        f"paratrain demo --tf: {job['workers']} worker(s), {job['replicas']} replica(s), {job['strategy']}, "
        f"tf.keras = {job['keras']} (medians over each worker's steps of this attempt)",
        f"{'worker':>6}  {'steps':>6}  {'step ms':>8}",
    ]
    lines += [f"{r['rank']:>6}  {r['steps']:>6}  {r['step_ms']:>8.1f}" for r in sorted(rows, key=lambda r: r["rank"])]
    resumed = f", resumed at epoch {job['first_epoch']} after {job['restart']} restart(s)" if job["restart"] else ""
    lines.append(
        f"test acc {job['test_acc']:.2%}  wall {job['wall_s']:.1f} s  {job['samples_per_s']:,.0f} samples/s{resumed}"
    )
    return "\n".join(lines)
