"""``paratrain run``: torchrun with better defaults, delegated to ``torch.distributed.run``.

Flags are torchrun's own (both ``--nproc-per-node`` and ``--nproc_per_node`` forms) plus ``-n`` for the number
of processes per node. What paratrain adds:

* ``-n`` defaults to the visible GPUs, or 2 on a CPU-only machine (torchrun's default is 1);
* single-node jobs rendezvous on loopback on a free port unless ``--master-port``/``--rdzv-endpoint`` is given;
* ``OMP_NUM_THREADS`` = cores / processes per node unless set (torchrun forces 1);
* a rank that fails stops the job within a second, and the report leads with that rank's host, exit code and
  traceback; a rank that allowed leaving (:mod:`paratrain.launcher.leaving`) may die, or be restarted alone, while
  the job goes on (:mod:`paratrain.launcher.agent`);
* bad input (no such script, ``-n 0``, a taken ``--master-port``) is one line, not a traceback;
* multi-node jobs bind gloo to the interface that reaches the master, wait at most ``--rdzv-timeout`` for the
  other nodes and say which address did not answer, and stop when the nodes disagree on ``--nnodes``
  (:mod:`paratrain.launcher.multinode`);
* inside a SLURM ``srun`` step the allocation fills in the flags not given (:mod:`paratrain.launcher.slurm`);
* in a Kubeflow Trainer pod the ``PET_*`` variables are the flags (as for torchrun), checked first, and a node
  waits for the master's name to resolve (:mod:`paratrain.launcher.kubeflow`);
* a process group the script creates without a timeout gets ``--pg-timeout`` (600 s), not torch's 30 min;
* torch's flight recorder is on (``TORCH_FR_BUFFER_SIZE``, unless set): when a collective stalls every live rank
  writes its trace, and a failed job's report says which ranks wait in which collective and which rank never
  entered it (:mod:`paratrain.launcher.hang_report`);
* ``--checkpoint-dir D --checkpoint-every N [--checkpoint-async] [--resume]`` make every ``Parallel`` of the job
  checkpoint itself (in the background) and, with ``--max-restarts K``, resume from the latest checkpoint after a
  failure (see docs/checkpoints.md);
* SIGTERM or SIGUSR1 (a scheduler's warning) is forwarded to the ranks, which save at a step they agree on when they
  have a checkpoint directory; the job then ends ``preempted at step N, saved to …`` with exit code 75
  (:mod:`paratrain.launcher.signals`, :mod:`paratrain.preemption`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from ..env import cpu_count
from ..errors import LaunchError, RankFailedError, describe_exitcode
from ..hang_trace import TRACE_DIR_VAR, recorder_available, recorder_environ
from .agreement import NNODES_VAR
from .failure import collective_failure, from_child_failed
from .hang_report import hang_report
from .kubeflow import check_pet
from .multinode import (
    DEFAULT_RDZV_TIMEOUT_S,
    max_nodes,
    nnodes_range,
    prepare_network,
    rendezvous_error,
    rendezvous_errors,
    set_rendezvous_timeout,
)
from .network import LOOPBACK
from .parent_death import LAUNCHER_PID_VAR
from .pg_timeout import DEFAULT_PG_TIMEOUT_S, PG_TIMEOUT_VAR
from .ports import port_in_use
from .rendezvous_progress import rendezvous_progress
from .signals import stop_signals
from .slurm import read_slurm
from .worker import DEBUG_VAR


def _note(message: str) -> None:
    print(f"paratrain run: {message}", file=sys.stderr, flush=True)


def default_nproc() -> int:
    """Visible GPUs, or 2 processes on a CPU-only machine."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 2


_UNSET = object()
_SLURM_FILLED = ("nnodes", "node_rank", "master_addr", "master_port", "rdzv_endpoint", "rdzv_id")
"""Flags a SLURM allocation fills in when the user did not give them (``nproc_per_node`` too, via None)."""


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """torchrun's own parser, plus ``-n``, ``--rdzv-timeout`` and ``--pg-timeout``; errors become one-line
    ``LaunchError``s.

    ``args.explicit`` holds the SLURM-fillable flags the user gave (on the command line or as ``PET_*``, the
    variables Kubeflow Trainer sets: :mod:`paratrain.launcher.kubeflow`).
    """
    from torch.distributed.run import get_args_parser

    check_pet(os.environ)
    parser = get_args_parser()
    parser.prog = "paratrain run"
    parser.add_argument(
        "-n", "--nproc", dest="nproc_per_node", type=str, help="processes per node (default: visible GPUs, or 2 on CPU)"
    )
    parser.add_argument(
        "--rdzv-timeout",
        "--rdzv_timeout",
        dest="rdzv_timeout",
        type=int,
        default=None,
        help=f"seconds to wait for the other nodes (default {DEFAULT_RDZV_TIMEOUT_S})",
    )
    parser.add_argument(
        "--pg-timeout",
        "--pg_timeout",
        dest="pg_timeout",
        type=float,
        default=DEFAULT_PG_TIMEOUT_S,
        help="default timeout in seconds of process groups the script creates without one "
        f"(default {DEFAULT_PG_TIMEOUT_S:g}; torch's own is 30 min for gloo)",
    )
    if "PET_NPROC_PER_NODE" not in os.environ:
        parser.set_defaults(nproc_per_node=None)
    defaults = {dest: parser.get_default(dest) for dest in _SLURM_FILLED if f"PET_{dest.upper()}" not in os.environ}
    parser.set_defaults(**dict.fromkeys(defaults, _UNSET))
    parser.add_argument(
        "--checkpoint-dir",
        "--checkpoint_dir",
        dest="checkpoint_dir",
        default=None,
        help="paratrain: where Parallel saves checkpoints and resumes from",
    )
    parser.add_argument(
        "--checkpoint-every",
        "--checkpoint_every",
        dest="checkpoint_every",
        type=int,
        default=None,
        help="paratrain: checkpoint every N optimizer steps",
    )
    parser.add_argument(
        "--checkpoint-async",
        "--checkpoint_async",
        dest="checkpoint_async",
        action="store_true",
        help="paratrain: write the automatic checkpoints in the background while training goes on",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="paratrain: start from the latest checkpoint in --checkpoint-dir (restarts always do)",
    )
    parser.add_argument(
        "--tf",
        action="store_true",
        help="paratrain: a TensorFlow (Keras tf.distribute) script: each worker gets a TF_CONFIG (docs/tensorflow.md)",
    )

    def error(message: str) -> None:
        raise LaunchError(f"paratrain run: {message} (see `paratrain run --help`)")

    parser.error = error  # type: ignore[method-assign]
    args = parser.parse_args(list(argv))
    _check_one_nproc(list(argv), args)
    args.explicit = {dest for dest in _SLURM_FILLED if getattr(args, dest) is not _UNSET}
    for dest, default in defaults.items():
        if getattr(args, dest) is _UNSET:
            setattr(args, dest, default)
    return args


_NPROC_FLAGS = ("-n", "--nproc", "--nproc-per-node", "--nproc_per_node")


def _check_one_nproc(argv: list[str], args: argparse.Namespace) -> None:
    """``-n 2 --nproc-per-node 3``: argparse would silently keep the last; refuse differing values instead."""
    end = len(argv)
    if args.training_script in argv:  # the script's own arguments may reuse the flags
        end = argv.index(args.training_script)
    seen: list[tuple[str, str]] = []
    i = 0
    while i < end:
        item = argv[i]
        flag, eq, value = item.partition("=")
        if flag in _NPROC_FLAGS and eq:
            seen.append((flag, value))
        elif item in _NPROC_FLAGS and i + 1 < end:
            seen.append((item, argv[i + 1]))
            i += 1
        elif item.startswith("-n") and not item.startswith("--") and len(item) > 2:
            seen.append(("-n", item[2:]))
        i += 1
    if len({value for _, value in seen}) > 1:
        given = " and ".join(f"{flag} {value}" for flag, value in seen)
        raise LaunchError(f"paratrain run: {given} disagree on the number of processes per node; give it once")


def resolve(args: argparse.Namespace, note: Callable[[str], None] = _note) -> argparse.Namespace:
    """Validate and fill in paratrain's defaults; sets ``OMP_NUM_THREADS`` (and for multi-node jobs
    ``GLOO_SOCKET_IFNAME``) in this process's environment, which the workers inherit."""
    apply_slurm(args, note)
    args.nproc_per_node = _nproc(args.nproc_per_node)
    _check_target(args)
    _check_layout(args)
    single_node = max_nodes(args.nnodes) == 1
    if single_node and not args.rdzv_endpoint and args.rdzv_backend == "static" and args.master_port is None:
        # torchrun then uses a c10d rendezvous on localhost:0 (a free port); keep the workers on loopback too.
        args.local_addr = args.local_addr or LOOPBACK
    if args.master_port is not None and args.rdzv_backend == "static" and args.node_rank == 0:
        if _is_local(args.master_addr) and port_in_use(args.master_addr, args.master_port):
            raise LaunchError(
                f"--master-port {args.master_port} is already in use on {args.master_addr}; "
                "pick another port or omit --master-port to get a free one"
            )
    if args.rdzv_timeout is not None:
        if args.rdzv_timeout < 1:
            raise LaunchError(f"--rdzv-timeout must be at least 1 second, got {args.rdzv_timeout}")
        set_rendezvous_timeout(args, args.rdzv_timeout)
    if args.pg_timeout <= 0:
        raise LaunchError(f"--pg-timeout must be > 0 seconds, got {args.pg_timeout:g}")
    os.environ[PG_TIMEOUT_VAR] = f"{args.pg_timeout:g}"
    if single_node:
        os.environ.pop(NNODES_VAR, None)
    else:
        prepare_network(args, note)
        os.environ[NNODES_VAR] = "{}:{}".format(*nnodes_range(args.nnodes))
    if isinstance(args.nproc_per_node, int) and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, cpu_count() // args.nproc_per_node))
    _export_checkpointing(args)
    if args.max_restarts > 0:
        # Restarted gloo workers can reconnect to the previous attempt's store address (a torchrun trap);
        # a store of their own per attempt avoids it. Not by default: rank 0 then starts that store and the
        # other ranks wait for it, which costs about a second at every launch.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if args.no_python:  # a program of its own: the worker asks to die with the launcher, then becomes that program
        args.training_script_args = [
            "-m",
            "paratrain.launcher.worker",
            "--exec",
            args.training_script,
            *args.training_script_args,
        ]
        args.training_script = sys.executable
    else:  # --run-path runs the script as the worker does anyway (runpy.run_path)
        target = ["-m", args.training_script] if args.module else [args.training_script]
        args.training_script_args = [*target, *args.training_script_args]
        args.training_script = "paratrain.launcher.worker"
        args.module, args.run_path = True, False
    return args


def run(argv: Sequence[str], *, quiet_agent: bool = True) -> None:
    """Launch the job described by torchrun-style ``argv``; raise ``RankFailedError`` when a rank fails and
    ``JobInterrupted`` on SIGINT/SIGTERM (every rank stopped)."""
    launch(parse_launch(argv, quiet_agent=quiet_agent), quiet_agent=quiet_agent)


def parse_launch(argv: Sequence[str], *, quiet_agent: bool = True) -> argparse.Namespace:
    """``parse_args``, torch first imported with its C++ log level at FATAL when ``quiet_agent`` (the store's
    warnings and stack dumps: the launcher's report is one line)."""
    _import_torch(quiet=quiet_agent)
    return parse_args(argv)


def launch(args: argparse.Namespace, *, quiet_agent: bool = True) -> None:
    """Launch the job of ``paratrain run``'s parsed flags (``parse_launch``); see ``run``. A failed job's
    flight-recorder report (when a collective stalled) is printed before the failure is raised."""
    args = resolve(args)
    with flight_recorder() as traces:
        try:
            _launch_resolved(args, quiet_agent=quiet_agent)
        except RankFailedError as err:
            ended = {err.rank: describe_exitcode(err.exitcode)}
            stalled = collective_failure(err.exitcode, err.traceback)  # a user's own error: no traces
            if traces.folder is not None and stalled and (report := hang_report(traces.folder, ended)):
                print(report, file=sys.stderr, flush=True)
                traces.keep = True
            raise


def _launch_resolved(args: argparse.Namespace, *, quiet_agent: bool) -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torchrun

    from .agent import leaving_agent

    os.environ[LAUNCHER_PID_VAR] = str(os.getpid())  # each worker dies with this process
    if quiet_agent:  # our own report replaces the agent's warnings, its "failed (exitcode …)" line and its dump
        for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
            if name.startswith("torch.distributed.elastic"):  # each has a level of its own
                logging.getLogger(name).setLevel(logging.CRITICAL)
        os.environ.pop(DEBUG_VAR, None)
    else:
        os.environ[DEBUG_VAR] = "1"  # every rank prints its own traceback too
    try:
        with stop_signals(args), rendezvous_progress(args, _note), leaving_agent() as leaves:
            try:
                torchrun(args)
            finally:
                if leaves is not None and (left := leaves.summary()):
                    _note(left)
    except ChildFailedError as err:
        raise from_child_failed(err) from None
    except rendezvous_errors() as err:
        raise rendezvous_error(args, err) from None


@dataclass
class TraceFolder:
    """Where the workers write their flight-recorder traces (None: this torch cannot dump them)."""

    folder: str | None
    keep: bool = False
    """A report points at it (or the user named it): not removed at the end."""


@contextlib.contextmanager
def flight_recorder() -> Iterator[TraceFolder]:
    """The workers' flight recorder on, their traces in a folder of this job's: ``PARATRAIN_TRACE_DIR`` when the
    user names one, otherwise a temporary one, removed at the end unless a report points at it."""
    if not recorder_available():
        yield TraceFolder(None)
        return
    given = os.environ.get(TRACE_DIR_VAR)
    traces = TraceFolder(given or tempfile.mkdtemp(prefix="paratrain-trace-"), keep=bool(given))
    assert traces.folder is not None
    os.makedirs(traces.folder, exist_ok=True)
    env = recorder_environ(traces.folder, os.environ)
    saved = {var: os.environ.get(var) for var in env}
    os.environ.update(env)
    try:
        yield traces
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value
        if not traces.keep:
            shutil.rmtree(traces.folder, ignore_errors=True)


def _import_torch(*, quiet: bool) -> None:
    """Import torch, when ``quiet`` with its C++ log level at FATAL in this process only (torch reads it once, at
    import); the workers inherit the environment as the user set it."""
    if not quiet or "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "FATAL"
    try:
        import torch  # noqa: F401
    finally:
        del os.environ["TORCH_CPP_LOG_LEVEL"]


def _export_checkpointing(args: argparse.Namespace) -> None:
    """Hand the checkpoint options to every rank through the environment (``Parallel`` reads them)."""
    from ..checkpoint.config import CheckpointConfig
    from ..errors import ConfigError

    try:
        config = CheckpointConfig(
            dir=args.checkpoint_dir,
            every=args.checkpoint_every,
            resume=True if args.resume else None,
            async_save=args.checkpoint_async,
        ).checked()
    except ConfigError as e:
        raise LaunchError(f"paratrain run: {e}") from None
    os.environ.update(config.environ())


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


def _check_layout(args: argparse.Namespace) -> None:
    """Refuse at once what no rendezvous can satisfy (it would otherwise wait for its whole timeout)."""
    lo, hi = nnodes_range(args.nnodes)
    if args.node_rank < 0 or (lo == hi and args.node_rank >= hi):
        raise LaunchError(
            f"--node-rank {args.node_rank} is outside a job of "
            f"--nnodes {lo if lo == hi else args.nnodes} "
            f"(node ranks are 0 … {hi - 1}); give each node its own rank below --nnodes"
        )
    if args.master_port is not None and not 0 < args.master_port < 65536:
        raise LaunchError(
            f"--master-port {args.master_port} is not a TCP port (1 … 65535); omit it to get a free "
            "one on a single node"
        )


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


def apply_slurm(args: argparse.Namespace, note: Callable[[str], None]) -> None:
    """Inside a SLURM job step, fill in the flags the user left out (``args.explicit``) from the allocation;
    refuse several tasks per node; note an allocation of several nodes entered without srun."""
    job = read_slurm(os.environ)
    if job is None:
        return
    if job.problem():
        raise LaunchError(job.problem())
    if job.warning():
        note(job.warning())
    if not job.under_srun or args.standalone:
        return
    for dest, value in job.torchrun_args(args.rdzv_backend).items():
        if dest not in args.explicit and not (dest == "nproc_per_node" and args.nproc_per_node is not None):
            setattr(args, dest, value)


def _is_local(host: str) -> bool:
    import socket

    if host in ("localhost", LOOPBACK, "::1", "0.0.0.0"):
        return True
    try:
        return socket.gethostbyname(host) in (LOOPBACK, socket.gethostbyname(socket.gethostname()))
    except OSError:
        return False
