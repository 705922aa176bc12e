"""``paratrain demo``: the digits CNN trained on N processes through ``paratrain run``."""
from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="train a CNN on the bundled handwritten digits",
                       description="Train a small CNN on scikit-learn's digits across N processes (2 on CPU, "
                                   "every GPU when present) and report accuracy, time and throughput.")
    p.add_argument("-n", "--nproc", type=str, default=None, help="processes (default: GPUs, or 2 on CPU)")
    p.add_argument("--strategy", default="auto", help="parallel strategy (default: auto)")
    p.add_argument("--tp", type=int, default=None,
                   help="tensor-parallel degree inside ddp/zero2/zero3 (the CNN's linear layers split over it)")
    p.add_argument("--staleness", type=int, default=None,
                   help="with --strategy ps: asynchronous updates at most this many versions old (a worker may then "
                        "die, and come back with --max-restarts, while the others train on)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=64,
                   help="global batch per optimizer step (split over processes and accumulation steps)")
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (and resume from them)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", action="store_true", help="start from the latest checkpoint in --checkpoint-dir")
    p.add_argument("--max-restarts", type=int, default=0,
                   help="restart the job this many times after a failure (it resumes from the latest checkpoint)")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="fault injection: SIGKILL --fail-rank after this optimizer step, on the first attempt only")
    p.add_argument("--fail-rank", type=int, default=0, help="the rank --fail-at-step kills (default 0)")
    p.add_argument("--monitor-csv", metavar="PATH", help="log the training monitor's per-rank figures to this CSV")
    p.add_argument("--tf", action="store_true",
                   help="the TensorFlow demo: a Keras CNN under MultiWorkerMirroredStrategy (needs paratrain[tf]; "
                        "--fail-at-step then counts epochs)")


def execute(args: argparse.Namespace) -> int:
    if args.tf:
        from ..tf.demo import run_demo

        run_demo(args)
        return 0
    from ..demo import check_args
    from ..launch.torchrun import default_nproc, run

    if args.nproc is None and args.strategy == "dp":
        args.nproc = "1"  # nn.DataParallel drives every GPU from one process
    check_args(args, int(args.nproc) if args.nproc and args.nproc.isdigit() else default_nproc())
    if args.max_restarts < 0:
        from ..errors import ConfigError

        raise ConfigError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    nproc = [] if args.nproc is None else ["--nproc-per-node", args.nproc]
    optional = [f"--{name.replace('_', '-')}={getattr(args, name)}"
                for name in ("tp", "staleness", "checkpoint_dir", "checkpoint_every", "fail_at_step", "monitor_csv")
                if getattr(args, name) is not None]
    if args.fail_at_step is not None:
        optional.append(f"--fail-rank={args.fail_rank}")
    if args.resume:
        optional.append("--resume")
    run([*nproc, "--max-restarts", str(args.max_restarts), "-m", "paratrain.demo", "--strategy", args.strategy,
         "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--accumulate", str(args.accumulate),
         "--lr", str(args.lr), "--seed", str(args.seed), *optional])
    return 0
