"""``paratrain run --tf``: a Keras ``tf.distribute`` job on N workers, from the same flags as a torch job.

``paratrain run --tf -n 2 train.py`` starts two workers on this machine, each with its own ``TF_CONFIG`` (free
loopback ports); ``--nnodes/--node-rank/--master-addr/--master-port`` and SLURM steps work as for torch
(:mod:`paratrain.tf.cluster`). A ``TF_CONFIG`` already in the environment is checked and respected: this machine
then runs the one task it describes. torchrun's agent is not used here, because TensorFlow's workers break its
assumptions, and the launcher covers each (measured on TensorFlow 2.21, CPU):

* a ``MultiWorkerMirroredStrategy`` worker **ignores SIGTERM** (its preemption notifier catches it and trains on):
  workers are stopped with SIGINT, then SIGKILL after ``STOP_GRACE_S``;
* a worker whose partner never starts **waits forever**: once one worker's server listens, every other must
  listen within ``--rdzv-timeout`` seconds, or the job stops and names the silent one;
* a worker that dies leaves its partners blocked in a collective for 2–10 s: the first failure stops every
  worker at once, and the report names it (rank, exit code, traceback);
* TensorFlow's C++ start-up noise (``TF_CPP_MIN_LOG_LEVEL`` leaves several lines per worker) is kept out of the
  terminal and shown with the report of a worker that failed (all of it with ``paratrain --debug run``).

``--max-restarts K --checkpoint-dir D`` restarts every worker (new ports, ``PARATRAIN_RESTART_COUNT``) after a
failure; a script whose ``BackupAndRestore`` keeps its state in :func:`paratrain.tf.backup_dir` resumes at the
epoch it lost. Ctrl-C stops every worker and prints one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..env import cpu_count
from ..errors import LaunchError, RankFailedError
from ..launcher.failure import failure_cause
from ..launcher.multinode import DEFAULT_RDZV_TIMEOUT_S, max_nodes
from ..launcher.parent_death import LAUNCHER_PID_VAR
from ..launcher.ports import port_in_use
from ..launcher.signals import StopRequest, caught_stop_signals
from .cluster import NodeSlots, multi_node, single_node
from .config import TF_CONFIG_VAR, TFConfig, parse_tf_config, split_address
from .install import apply_keras_choice, require_tensorflow
from .runtime import CHECKPOINT_DIR_VAR, RESTART_VAR
from .worker import ERROR_FILE_VAR, RANK_VAR

STOP_GRACE_S = 2.0
"""SIGINT, then SIGKILL this much later: a worker blocked in a collective only sees SIGINT when it returns."""
_NOISE = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog|[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] "
    r"|Additional GRPC error information from remote target|:UNKNOWN:Error received from peer)"
)
"""TensorFlow's C++ log lines (absl format), absl's preamble, and the coordination service's heartbeat errors a
worker logs when its partner has finished first."""
_HARMLESS = re.compile(r"absl::InitializeLog|\] oneDNN custom operations|cudart_stub\.cc|cuInit")
"""Start-up lines every worker logs on a CPU machine: left out of a failed worker's report too."""
_TAIL_LINES = 40


def note(message: str) -> None:
    print(f"paratrain run --tf: {message}", file=sys.stderr, flush=True)


@dataclass
class TFJob:
    """What to start on this node, decided before anything starts."""

    target: list[str]
    """``[-m] TARGET ARGS…`` as the worker runs it."""
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    startup_timeout_s: float = DEFAULT_RDZV_TIMEOUT_S
    max_restarts: int = 0
    checkpoint_dir: str | None = None
    user_config: TFConfig | None = None
    """The ``TF_CONFIG`` the user exported: this node runs that one task, as written."""
    debug: bool = False


def run(argv: Sequence[str], *, debug: bool = False) -> None:
    """Launch the TensorFlow job ``argv`` describes (``paratrain run`` flags, ``--tf`` implied): how the demo,
    bench and verify start theirs."""
    from ..launcher.torchrun import parse_args

    launch(parse_args(argv), debug=debug)


def launch(args: argparse.Namespace, *, debug: bool = False) -> None:
    """Launch the TensorFlow job of ``paratrain run``'s parsed flags; restart it up to ``--max-restarts`` times."""
    job = plan(args, debug=debug)
    require_tensorflow()
    choice = apply_keras_choice()
    message = choice.note(job.user_config.num_workers if job.user_config else job.nproc * job.nnodes)
    if message:
        note(message)
    for attempt in range(job.max_restarts + 1):
        try:
            run_attempt(job, attempt)
            return
        except RankFailedError as err:
            if attempt == job.max_restarts:
                raise
            note(
                f"rank {err.rank} failed ({failure_cause(err.exitcode, err.traceback)}); "
                f"restarting all workers (restart {attempt + 1} of {job.max_restarts})"
            )


def plan(args: argparse.Namespace, *, debug: bool = False) -> TFJob:
    """Check the flags (and a user's ``TF_CONFIG``) and decide the job, before any process starts."""
    from ..launcher.torchrun import _check_layout, _check_target, _nproc, apply_slurm

    apply_slurm(args, note)
    if args.no_python:
        raise LaunchError("--tf runs Python TensorFlow scripts; --no-python cannot be combined with it")
    _check_target(args)
    if args.nproc_per_node is None:
        args.nproc_per_node = "2" if _gpus() == 0 else "1"  # one worker drives all of its node's GPUs
    nproc = _nproc(args.nproc_per_node)
    if not isinstance(nproc, int):
        raise LaunchError(f"--tf needs a number of workers per node (-n N), got {args.nproc_per_node!r}")
    _check_layout(args)
    nnodes = max_nodes(args.nnodes)
    if args.max_restarts < 0:
        raise LaunchError(f"--max-restarts must be >= 0, got {args.max_restarts}")
    if args.rdzv_timeout is not None and args.rdzv_timeout < 1:
        raise LaunchError(f"--rdzv-timeout must be at least 1 second, got {args.rdzv_timeout}")
    if args.max_restarts and nnodes > 1:
        raise LaunchError(
            "--max-restarts with --tf restarts the workers of one node; on several nodes, restart "
            "the job (every node) and let BackupAndRestore resume it"
        )
    target = (["-m", args.training_script] if args.module else [args.training_script]) + args.training_script_args
    job = TFJob(
        target=target,
        nproc=nproc,
        nnodes=nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        max_restarts=args.max_restarts,
        checkpoint_dir=args.checkpoint_dir,
        startup_timeout_s=args.rdzv_timeout or DEFAULT_RDZV_TIMEOUT_S,
        debug=debug,
    )
    text = os.environ.get(TF_CONFIG_VAR, "").strip()
    if text:
        job.user_config = _check_user_config(text, nproc, nnodes, args)
    return job


def _check_user_config(text: str, nproc: int, nnodes: int, args: argparse.Namespace) -> TFConfig:
    config = parse_tf_config(text)
    if nproc != 1 or nnodes != 1 or args.explicit & {"nnodes", "node_rank"}:
        raise LaunchError(
            "TF_CONFIG is set and describes this process's one task: run `paratrain run --tf -n 1 …` "
            "on each machine, or unset TF_CONFIG and let paratrain build it from -n/--nnodes"
        )
    host, port = split_address(config.address)
    if _is_own(host) and port_in_use("0.0.0.0", port):
        raise LaunchError(
            f"TF_CONFIG gives this task {config.address}, but port {port} is already in use here "
            "(TensorFlow's server binds it on every interface); pick a free port"
        )
    return config


def run_attempt(job: TFJob, attempt: int) -> None:
    """Start this node's workers once and supervise them to the end: success, a failure, or a stop signal."""
    if job.user_config is not None:
        slots, configs = None, [job.user_config]
    else:
        slots = _slots(job, attempt)
        configs = [TFConfig.for_workers(slots.addresses, i) for i in slots.indices]
    with tempfile.TemporaryDirectory(prefix="paratrain-tf-") as tmp, caught_stop_signals() as stop:
        workers = [_start(job, config, attempt, os.path.join(tmp, f"error-{config.rank}.json")) for config in configs]
        try:
            _supervise(job, workers, configs, stop)
        finally:
            _stop(workers)
            for w in workers:
                w.pump.join(timeout=2)
    del slots  # node 0's store stays up until this node's workers have ended


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen
    error_file: str
    tail: deque = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))
    quiet: threading.Event = field(default_factory=threading.Event)
    pump: threading.Thread | None = None


def _slots(job: TFJob, attempt: int) -> NodeSlots:
    if job.nnodes == 1:
        return single_node(job.nproc)
    return multi_node(
        nproc=job.nproc,
        nnodes=job.nnodes,
        node_rank=job.node_rank,
        master_addr=job.master_addr,
        master_port=job.master_port,
        timeout_s=job.startup_timeout_s,
        attempt=attempt,
    )


def _start(job: TFJob, config: TFConfig, attempt: int, error_file: str) -> _Worker:
    env = dict(os.environ)
    env.update(
        {
            TF_CONFIG_VAR: config.to_json(),
            RANK_VAR: str(config.rank),
            ERROR_FILE_VAR: error_file,
            RESTART_VAR: str(attempt),
            LAUNCHER_PID_VAR: str(os.getpid()),
        }
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    threads = str(max(1, cpu_count() // job.nproc))
    for var in ("OMP_NUM_THREADS", "TF_NUM_INTRAOP_THREADS"):
        env.setdefault(var, threads)
    if job.checkpoint_dir:
        env[CHECKPOINT_DIR_VAR] = os.path.abspath(job.checkpoint_dir)
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which stops the workers itself.
    process = subprocess.Popen(
        [sys.executable, "-m", "paratrain.tf.worker", *job.target],
        env=env,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    worker = _Worker(rank=config.rank, process=process, error_file=error_file)
    worker.pump = threading.Thread(target=_pump, args=(worker, job.debug), daemon=True)
    worker.pump.start()
    return worker


def _pump(worker: _Worker, debug: bool) -> None:
    """Copy a worker's stderr to ours, less TensorFlow's C++ noise (kept for the report); nothing once stopped."""
    assert worker.process.stderr is not None
    for raw in worker.process.stderr:
        line = raw.decode(errors="replace")
        if debug or not _HARMLESS.search(line):
            worker.tail.append(line.rstrip("\n"))
        if worker.quiet.is_set() or (not debug and _NOISE.match(line)):
            continue
        sys.stderr.write(line)
        sys.stderr.flush()


def _supervise(job: TFJob, workers: list[_Worker], configs: list[TFConfig], stop: StopRequest) -> None:
    addresses = [a for v in configs[0].cluster.values() for a in v]
    watch = _StartupWatch(addresses, job.startup_timeout_s) if len(addresses) > 1 else None
    while True:
        if stop.signal is not None:
            _stop(workers)
            raise stop.interrupted()
        codes = [w.process.poll() for w in workers]
        failed = [w for w, code in zip(workers, codes) if code not in (None, 0)]
        if failed:
            _stop(workers)
            raise _failure(failed[0], [w for w in workers if w is not failed[0]])
        if all(code == 0 for code in codes):
            return
        if watch is not None and watch.check():
            _stop(workers)
            raise LaunchError(watch.message())
        time.sleep(0.1)


def _failure(worker: _Worker, others: list[_Worker]) -> RankFailedError:
    worker.pump.join(timeout=2)  # type: ignore[union-attr]
    trace = None
    with contextlib.suppress(OSError, ValueError):
        with open(worker.error_file) as f:
            data = json.load(f)
        trace = data["traceback"]
        if data.get("own"):  # a paratrain error: the one line is the report
            trace = f"paratrain.errors.LaunchError: {data['own']}"
    if trace is None and worker.tail:
        trace = "\n".join(worker.tail)
    code = worker.process.returncode
    stopped = tuple(w.rank for w in others if w.process.returncode not in (0,))
    return RankFailedError(
        rank=worker.rank,
        exitcode=code,
        host=socket.gethostname(),
        pid=worker.process.pid,
        traceback=trace,
        stopped=stopped,
        stopped_by=f"SIGINT, SIGKILL after {STOP_GRACE_S:g} s",
    )


def _stop(workers: list[_Worker]) -> None:
    """SIGINT every running worker (SIGTERM would be ignored), SIGKILL what still runs ``STOP_GRACE_S`` later."""
    running = [w for w in workers if w.process.poll() is None]
    for w in running:
        w.quiet.set()
        with contextlib.suppress(ProcessLookupError):
            w.process.send_signal(signal.SIGINT)
    deadline = time.monotonic() + STOP_GRACE_S
    for w in running:
        try:
            w.process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.process.kill()
            w.process.wait()


class _StartupWatch:
    """Once one worker's server listens, every other must within ``timeout_s`` (TensorFlow would wait forever)."""

    def __init__(self, addresses: list[str], timeout_s: float) -> None:
        self.addresses, self.timeout_s = addresses, timeout_s
        self.up: set[str] = set()
        self.first: float | None = None
        self.next_probe = 0.0

    def check(self) -> bool:
        now = time.monotonic()
        if len(self.up) == len(self.addresses) or now < self.next_probe:
            return False
        self.next_probe = now + 0.5
        for address in self.addresses:
            if address not in self.up and _listening(address):
                self.up.add(address)
                self.first = self.first or now
        return self.first is not None and len(self.up) < len(self.addresses) and now - self.first > self.timeout_s

    def message(self) -> str:
        silent = [f"{i} ({a})" for i, a in enumerate(self.addresses) if a not in self.up]
        return (
            f"worker {', '.join(silent)} of the TF_CONFIG cluster never started its TensorFlow server within "
            f"{self.timeout_s:g} s of the first (TensorFlow would wait for it forever); start every worker the "
            "cluster lists, or raise --rdzv-timeout"
        )


def _listening(address: str) -> bool:
    host, port = split_address(address)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _is_own(host: str) -> bool:
    from ..launcher.network import address_of, is_own_address

    address = address_of(host)
    return address is not None and is_own_address(address)
