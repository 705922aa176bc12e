"""``paratrain run``: torchrun with better defaults, delegated to ``torch.distributed.run``.

Flags are torchrun's own (both ``--nproc-per-node`` and ``--nproc_per_node`` forms) plus ``-n`` for the number
of processes per node. What paratrain adds:

* ``-n`` defaults to the visible GPUs, or 2 on a CPU-only machine (torchrun's default is 1);
* single-node jobs rendezvous on loopback on a free port unless ``--master-port``/``--rdzv-endpoint`` is given;
* ``OMP_NUM_THREADS`` = cores / processes per node unless set (torchrun forces 1);
* a rank that fails stops the job within a second, and the report leads with that rank's host, exit code and
  traceback;
* bad input (no such script, ``-n 0``, a taken ``--master-port``) is one line, not a traceback.
"""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
from collections.abc import Sequence

from ..env import cpu_count
from ..errors import LaunchError
from .failure import from_child_failed
from .ports import port_in_use

LOOPBACK = "127.0.0.1"


def default_nproc() -> int:
    """Visible GPUs, or 2 processes on a CPU-only machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's own parser, plus ``-n``; errors become one-line ``LaunchError``s."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = "paratrain run"
    parser.add_argument("-n", "--nproc", dest="nproc_per_node", type=str,
                        help="processes per node (default: visible GPUs, or 2 on CPU)")
    if "PET_NPROC_PER_NODE" not in os.environ:
        parser.set_defaults(nproc_per_node=None)

    def error(message: str) -> None:
        raise LaunchError(f"paratrain run: {message} (see `paratrain run --help`)")

    parser.error = error  # type: ignore[method-assign]
    return parser.parse_args(list(argv))


def resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Validate and fill in paratrain's defaults; sets ``OMP_NUM_THREADS`` in this process's environment."""
    args.nproc_per_node = _nproc(args.nproc_per_node)
    _check_target(args)
    single_node = _max_nodes(args.nnodes) == 1
    if single_node and not args.rdzv_endpoint and args.rdzv_backend == "static" and args.master_port is None:
        # torchrun then uses a c10d rendezvous on localhost:0 (a free port); keep the workers on loopback too.
        args.local_addr = args.local_addr or LOOPBACK
    if args.master_port is not None and args.rdzv_backend == "static" and args.node_rank == 0:
        if _is_local(args.master_addr) and port_in_use(args.master_addr, args.master_port):
            raise LaunchError(
                f"--master-port {args.master_port} is already in use on {args.master_addr}; "
                "pick another port or omit --master-port to get a free one"
            )
    if isinstance(args.nproc_per_node, int) and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cpu_count() // args.nproc_per_node))
    if args.max_restarts > 0:
        # Restarted gloo workers can reconnect to the previous attempt's store address (a torchrun trap);
        # a store of their own per attempt avoids it. Not by default: rank 0 then starts that store and the
        # other ranks wait for it, which costs about a second at every launch.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if not args.no_python and not args.run_path:
        target = ["-m", args.training_script] if args.module else [args.training_script]
        args.training_script_args = [*target, *args.training_script_args]
        args.training_script = "paratrain.launch.worker"
        args.module = True
    return args


def run(argv: Sequence[str], *, quiet_agent: bool = True) -> None:
    """Launch the job described by torchrun-style ``argv``; raise ``RankFailedError`` when a rank fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    args = resolve(parse_args(argv))
    if quiet_agent:  # our own report replaces the agent's warnings and its long exception dump
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    try:
        torchrun(args)
    except ChildFailedError as err:
        raise from_child_failed(err) from None


def _nproc(value: str | None) -> int | str:
    if value is None:
        return default_nproc()
    if value in ("cpu", "gpu", "auto"):
        return value
    try:
        n = int(value)
    except ValueError:
        raise LaunchError(f"-n/--nproc-per-node must be a number or cpu/gpu/auto, got {value!r}") from None
    if n < 1:
        raise LaunchError(f"-n/--nproc-per-node must be at least 1, got {n}")
    return n


def _check_target(args: argparse.Namespace) -> None:
    target = args.training_script
    if args.no_python:
        return
    if args.module:
        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise LaunchError(f"module {target!r} not found; check the name and that its package is importable")
    elif not os.path.isfile(target):
        raise LaunchError(f"script {target!r} not found (working directory {os.getcwd()})")


def _max_nodes(nnodes: str) -> int:
    try:
        return int(str(nnodes).split(":")[-1])
    except ValueError:
        raise LaunchError(f"--nnodes must be N or MIN:MAX, got {nnodes!r}") from None


def _is_local(host: str) -> bool:
    import socket

    if host in ("localhost", LOOPBACK, "::1", "0.0.0.0"):
        return True
    try:
        return socket.gethostbyname(host) in (LOOPBACK, socket.gethostbyname(socket.gethostname()))
    except OSError:
        return False
