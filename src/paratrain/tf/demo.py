"""``paratrain demo --tf``: the TensorFlow demo job (:mod:`paratrain.tf.demo_job`) on N workers through
``paratrain run --tf``, then a summary table: per worker its optimizer steps and median step time, and the job's
accuracy, wall time and throughput."""
from __future__ import annotations

import argparse
import glob
import json
import os
import tempfile

from ..errors import ConfigError


def run_demo(args: argparse.Namespace) -> None:
    from .launcher import run

    for name in ("epochs", "batch_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    with tempfile.TemporaryDirectory(prefix="paratrain-tf-demo-") as tmp:
        out = os.path.join(tmp, "summary.json")
        launch = ["--tf", "-n", args.nproc or "2", "--max-restarts", str(args.max_restarts)]
        if args.checkpoint_dir:
            launch += ["--checkpoint-dir", args.checkpoint_dir]
        job = ["--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--lr", str(args.lr),
               "--seed", str(args.seed), "--out", out]
        if args.fail_at_step is not None:
            job += ["--fail-at-epoch", str(args.fail_at_step), "--fail-rank", str(args.fail_rank)]
        run([*launch, "-m", "paratrain.tf.demo_job", *job])
        print(summary_table(out))


def summary_table(out: str) -> str:
    """The end-of-run table from the files the workers wrote next to ``out``."""
    with open(out) as f:
        job = json.load(f)
    rows = []
    for path in sorted(glob.glob(f"{out}.worker*")):
        with open(path) as f:
            rows.append(json.load(f))
    lines = [f"paratrain demo --tf: {job['workers']} worker(s), {job['replicas']} replica(s), {job['strategy']}, "
             f"tf.keras = {job['keras']} (medians over each worker's steps of this attempt)",
             f"{'worker':>6}  {'steps':>6}  {'step ms':>8}"]
    lines += [f"{r['rank']:>6}  {r['steps']:>6}  {r['step_ms']:>8.1f}" for r in sorted(rows, key=lambda r: r["rank"])]
    resumed = f", resumed at epoch {job['first_epoch']} after {job['restart']} restart(s)" if job["restart"] else ""
    lines.append(f"test acc {job['test_acc']:.2%}  wall {job['wall_s']:.1f} s  {job['samples_per_s']:,.0f} samples/s"
                 f"{resumed}")
    return "\n".join(lines)
