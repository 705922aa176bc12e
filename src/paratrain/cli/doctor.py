"""``paratrain doctor``: check this machine (and the way to a multi-node master) before training on it.

Prints one table — check, status (ok / warn / fail), evidence, fix — and the bandwidth of a live all-reduce
(gloo on 2 CPU processes, or NCCL on every GPU when there are 2 or more). Exit code 0 when nothing failed,
1 when a check failed. ``--json`` prints the same as JSON. See docs/doctor.md for every check and threshold.
"""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    return sub.add_parser(
        "doctor",
        help="check GPUs, topology, memory, limits, NCCL env and live all-reduce speed",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--skip-bandwidth", action="store_true", help="leave out the live all-reduce")
    p.add_argument(
        "--master-addr",
        metavar="HOST[:PORT]",
        help="multi-node master to resolve and dial once (port 29500 by default)",
    )
    p.add_argument("--max-mb", type=int, default=64, help="largest all-reduce buffer in MiB (default: 64)")
    p.add_argument("-n", "--nproc", type=int, default=2, help="CPU processes for the all-reduce (default: 2)")
    p.add_argument("--skip-tf", action="store_true", help="leave out the TensorFlow section")
    p.add_argument(
        "--script",
        action="append",
        default=[],
        metavar="PATH",
        help="a training script to read (not run) for imports that will hurt: torch.distributed.rpc, "
        "torch and TensorFlow together",
    )


def execute(args: argparse.Namespace) -> int:
    import shutil

    from ..doctor import DoctorOptions, run_doctor
    from ..doctor.report import render_json, render_text

    options = DoctorOptions(
        master_addr=args.master_addr,
        skip_bandwidth=args.skip_bandwidth,
        max_bytes=args.max_mb * 1024 * 1024,
        nproc=args.nproc,
        tensorflow=not args.skip_tf,
        scripts=tuple(args.script),
    )
    report = run_doctor(options)
    print(render_json(report) if args.json else render_text(report, shutil.get_terminal_size((100, 40)).columns))
    return report.exit_code
