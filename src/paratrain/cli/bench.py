"""``paratrain bench``: speedup, efficiency and their causes, per world size and strategy, measured here.

Examples:
  paratrain bench                                          # mlp, 1 and 2 processes, ddp
  paratrain bench --workload mlp --nproc 1,2 --compare torch-ddp --threads --json bench.json
  paratrain bench --workload cnn --nproc 1,2,4 --strategies ddp,zero1,fsdp --scaling strong --batch 256
  paratrain bench --workload recommender --nproc 2,3 --strategies ddp,ps --batch 256   # a big table: ps vs ddp
  paratrain bench --workload mymodels:build_workload --nproc 1,2
  paratrain bench --workload mymodels:deep_gpt --nproc 2 --strategies pipeline --schedules 1f1b,zbv,dualpipev

Each world size is one job of that many processes; the strategies (and the hand-written DDP loop of
--compare) take turns in timed blocks inside it. Weak scaling (default) keeps --batch samples per replica,
strong scaling keeps --batch samples per step. The table gives samples/s, median and p90 step time, speedup and
efficiency against one process, the share of the step spent waiting for gradient communication and for data,
the imbalance between ranks, the bytes a training rank moves per step and the peak memory of the largest rank;
rows that put more ranks (x threads) than there are physical cores or GPUs are marked '*'. A strategy with
servers (ps) runs in a job of its own; its rows time its workers (world minus --ps-servers). --json also writes a PNG
plot beside the JSON. See docs/bench.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "bench",
        help="measure speedup, efficiency, communication and memory per world size",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--workload",
        default="mlp",
        help="mlp, cnn, gpt-tiny, gpt-moe-tiny, recommender, recommender-tiny, or module:factory (default: mlp)",
    )
    p.add_argument(
        "-n",
        "--nproc",
        default=None,
        help="world sizes, comma-separated (default: 1,2 on a CPU, 1,2,4… up to the GPUs)",
    )
    p.add_argument("--strategies", default="ddp", help="comma-separated strategies (default: ddp)")
    p.add_argument(
        "--schedules",
        default="",
        help="pipeline schedules to time pipeline and hybrid under, side by side (e.g. 1f1b,zbv,dualpipev)",
    )
    p.add_argument("--tp", type=int, help="tensor-parallel degree inside ddp, zero2 and zero3 (and the 'tp' strategy)")
    p.add_argument(
        "--ps-servers",
        type=int,
        metavar="S",
        help="serving ranks of the ps strategy (the last S of each world size; default 1)",
    )
    p.add_argument("--scaling", choices=("weak", "strong"), default="weak")
    p.add_argument("--batch", type=int, default=64, help="samples per replica (weak) or per step (strong); default 64")
    p.add_argument("--steps", type=int, default=20, help="timed steps per block (default 20)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each block (default 5)")
    p.add_argument("--rounds", type=int, default=5, help="timed blocks per configuration (default 5)")
    p.add_argument("--compare", choices=("torch-ddp",), help="also time a hand-written DDP loop, interleaved")
    p.add_argument("--threads", action="store_true", help="also run 1 process with the threads of k ranks")
    p.add_argument("--threads-per-rank", type=int, help="threads per rank (default: cores / largest world size)")
    p.add_argument("--accelerator", default="auto", help="auto, cpu or cuda (default: auto)")
    p.add_argument(
        "--no-comm-probe",
        action="store_true",
        help="skip the extra passes that measure communication share and imbalance",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, metavar="PATH", help="write every measurement as JSON (and a PNG beside it)")
    p.add_argument("--csv", type=Path, metavar="PATH", help="write one line per configuration as CSV")
    p.add_argument("--plot", type=Path, metavar="PATH", help="write the PNG plot here (default: beside --json)")
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    p.add_argument(
        "--tf",
        action="store_true",
        help="TensorFlow: a Keras job per world size (MultiWorkerMirroredStrategy), weak scaling",
    )


def execute(args: argparse.Namespace) -> int:
    from ..bench import run_bench_cli

    return run_bench_cli(
        workload=args.workload,
        nproc=args.nproc,
        strategies=args.strategies,
        schedules=tuple(s.strip() for s in args.schedules.split(",") if s.strip()),
        tp=args.tp,
        servers=args.ps_servers,
        scaling=args.scaling,
        batch=args.batch,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        compare=args.compare,
        threads=args.threads,
        threads_per_rank=args.threads_per_rank,
        accelerator=args.accelerator,
        comm_probe=not args.no_comm_probe,
        seed=args.seed,
        json_path=args.json,
        csv_path=args.csv,
        plot_path=args.plot,
        plot=not args.no_plot,
    )
