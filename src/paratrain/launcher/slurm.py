"""SLURM: the allocation this process runs in, read from ``SLURM_*`` variables, as torchrun arguments.

``srun paratrain run train.py`` inside an allocation needs no other flags: one ``paratrain run`` per node
(``--ntasks-per-node=1``) learns the number of nodes, its own node rank, the master (the first node of the
step) and a port derived from the job id, and starts one process per GPU itself. Everything here is a pure
function of a mapping, so it is tested with fake environments.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

from ..errors import LaunchError

_BATCH_STEPS = 0xFFFFFFF0
"""SLURM numbers its special steps (batch, extern, interactive) from here up; srun steps are below."""
PORT_BASE, PORT_SPAN = 20000, 10000
"""The master port is ``PORT_BASE + job id % PORT_SPAN``: below Linux's ephemeral range, different per job."""


@dataclass(frozen=True, kw_only=True)
class SlurmJob:
    """Where this process sits in a SLURM allocation."""

    job_id: str
    """``SLURM_JOB_ID``; also the rendezvous id."""
    hosts: tuple[str, ...]
    """The nodes of the step (or of the job outside a step), in SLURM's order."""
    node_rank: int
    """``SLURM_NODEID``: this node's index in ``hosts``."""
    tasks: int
    """Tasks srun started in this step (all nodes together)."""
    gpus_on_node: int | None
    """``SLURM_GPUS_ON_NODE``, when GPUs were allocated."""
    under_srun: bool
    """True when srun started this process (a job step), False in the batch script or an salloc shell."""

    def __post_init__(self) -> None:
        if not self.hosts:
            raise LaunchError(f"SLURM job {self.job_id}: the node list is empty")
        if not 0 <= self.node_rank < len(self.hosts):
            raise LaunchError(
                f"SLURM job {self.job_id}: SLURM_NODEID={self.node_rank} is outside "
                f"0..{len(self.hosts) - 1} for {len(self.hosts)} nodes"
            )

    @property
    def nnodes(self) -> int:
        return len(self.hosts)

    @property
    def master_port(self) -> int:
        number = int(self.job_id) if self.job_id.isdigit() else zlib.crc32(self.job_id.encode())
        return PORT_BASE + number % PORT_SPAN

    def torchrun_args(self, rdzv_backend: str) -> dict[str, object]:
        """The torchrun arguments this allocation implies; the caller keeps any the user gave explicitly.

        The static rendezvous keeps SLURM's node order as node ranks; with ``--rdzv-backend c10d`` the first
        node hosts the rendezvous instead.
        """
        args: dict[str, object] = {"nnodes": str(self.nnodes), "rdzv_id": self.job_id}
        if rdzv_backend == "static":
            args.update(node_rank=self.node_rank, master_addr=self.hosts[0], master_port=self.master_port)
        else:
            args["rdzv_endpoint"] = f"{self.hosts[0]}:{self.master_port}"
        if self.gpus_on_node:
            args["nproc_per_node"] = self.gpus_on_node
        return args

    def problem(self) -> str | None:
        """Why this allocation cannot be used as it is launched, or None."""
        if self.under_srun and self.tasks > self.nnodes:
            return (
                f"srun started {self.tasks} tasks on {self.nnodes} node(s) of SLURM job {self.job_id}, but "
                "`paratrain run` starts one process per GPU itself: run one task per node "
                "(`srun --ntasks-per-node=1 paratrain run …`, or `paratrain slurm` to write the script)"
            )
        return None

    def warning(self) -> str | None:
        """A note for an allocation of several nodes entered without srun (the job then uses this node only)."""
        if not self.under_srun and self.nnodes > 1:
            return (
                f"SLURM job {self.job_id} has {self.nnodes} nodes but this process was not started by srun, "
                "so the job runs on this node only; use `srun --ntasks-per-node=1 paratrain run …` "
                "to use every node"
            )
        return None


def read_slurm(environ: Mapping[str, str]) -> SlurmJob | None:
    """The allocation described by ``environ``, or None outside SLURM."""
    job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
    if not job_id:
        return None
    step = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))
    under_srun = step.isdigit() and int(step) < _BATCH_STEPS
    prefix = "SLURM_STEP_" if under_srun else "SLURM_JOB_"
    nodelist = (
        environ.get(f"{prefix}NODELIST")
        or environ.get("SLURM_JOB_NODELIST")
        or environ.get("SLURM_NODELIST")
        or environ.get("SLURMD_NODENAME", "")
    )
    hosts = tuple(expand_hostlist(nodelist)) if nodelist else ()
    count = environ.get(f"{prefix}NUM_NODES") or environ.get("SLURM_JOB_NUM_NODES") or environ.get("SLURM_NNODES")
    if count is not None and _int(environ, count, "number of nodes") != len(hosts):
        raise LaunchError(
            f"SLURM job {job_id}: the node list {nodelist!r} has {len(hosts)} nodes but the job reports {count}"
        )
    tasks = environ.get("SLURM_STEP_NUM_TASKS") or environ.get("SLURM_NTASKS") or str(len(hosts))
    gpus = environ.get("SLURM_GPUS_ON_NODE")
    return SlurmJob(
        job_id=job_id,
        hosts=hosts,
        node_rank=_int(environ, environ.get("SLURM_NODEID", "0"), "SLURM_NODEID"),
        tasks=_int(environ, tasks, "number of tasks"),
        gpus_on_node=_int(environ, gpus, "SLURM_GPUS_ON_NODE") if gpus else None,
        under_srun=under_srun,
    )


def _int(environ: Mapping[str, str], raw: str, what: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"SLURM job {environ.get('SLURM_JOB_ID')}: {what} {raw!r} is not a number") from None


_GROUP = re.compile(r"\[([^\[\]]*)\]")


def expand_hostlist(hostlist: str) -> list[str]:
    """SLURM's compressed host list as names: ``node[01-03,07]`` → node01, node02, node03, node07.

    Commas inside brackets separate ranges, outside they separate names; several bracket groups in one name
    (``rack[1-2]-gpu[1-2]``) expand like SLURM's, the last group fastest. Zero padding follows the range's
    first number (``[08-10]`` → 08, 09, 10).
    """
    names: list[str] = []
    for item in _split_top_level(hostlist):
        parts = _GROUP.split(item)  # literal, ranges, literal, ranges, …, literal
        literals, groups = parts[0::2], parts[1::2]
        if any("[" in lit or "]" in lit for lit in literals):
            raise LaunchError(f"cannot parse SLURM host list {hostlist!r}: unbalanced brackets in {item!r}")
        choices = [_expand_ranges(group, hostlist) for group in groups]
        for combo in product(*choices):
            names.append("".join(lit + num for lit, num in zip(literals, (*combo, ""))))
    return names


def _split_top_level(hostlist: str) -> list[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(hostlist):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        elif ch == "," and depth == 0:
            items.append(hostlist[start:i])
            start = i + 1
        if depth not in (0, 1):
            raise LaunchError(f"cannot parse SLURM host list {hostlist!r}: unbalanced brackets")
    if depth != 0:
        raise LaunchError(f"cannot parse SLURM host list {hostlist!r}: unbalanced brackets")
    items.append(hostlist[start:])
    if any(not item.strip() for item in items):
        raise LaunchError(f"cannot parse SLURM host list {hostlist!r}: empty name")
    return [item.strip() for item in items]


def _expand_ranges(group: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for part in group.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise LaunchError(f"cannot parse SLURM host list {hostlist!r}: bad range {part!r} (expected N or N-M)")
        hi = hi if sep else lo
        if int(hi) < int(lo):
            raise LaunchError(f"cannot parse SLURM host list {hostlist!r}: range {part!r} runs backwards")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out
