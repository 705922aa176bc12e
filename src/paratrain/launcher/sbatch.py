"""``paratrain slurm``: a ready sbatch script for a multi-node job.

The script asks for one task per node and runs ``srun paratrain run …``: each node's ``paratrain run`` reads
the allocation (:mod:`paratrain.launcher.slurm`) and starts one process per GPU itself. Several tasks per
node would each start a full set of processes, so the script never asks for that.

Preemption (:mod:`paratrain.preemption`): ``--signal=USR1@GRACE`` has SLURM send SIGUSR1 to every process of the
step ``GRACE`` seconds before the time limit; ``paratrain run`` waits up to ``--shutdown-timeout GRACE`` for its
ranks to save, and ends with exit code 75, on which the script requeues the job (``--requeue``; the log is appended
to, ``--open-mode=append``); or when the first node's ``paratrain run`` marked the file ``PARATRAIN_PREEMPTED_MARK``
names, since srun's own exit code may be that of a node ``--kill-on-bad-exit`` killed just after the first ended
with 75. The requeued job resumes from the latest checkpoint (``SLURM_RESTART_COUNT`` > 0).
"""

from __future__ import annotations

import os
import re
import shlex
from dataclasses import dataclass

from ..errors import PREEMPTED_EXIT_CODE, ConfigError
from .signals import MARK_VAR

_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")
_WORD = re.compile(r"^[^\s'\"\\]+$")
DEFAULT_GRACE_S = 120
"""Seconds between SLURM's warning and the time limit: some steps and a save, with room to spare."""


@dataclass(frozen=True, kw_only=True)
class SbatchSpec:
    """What to ask SLURM for and what to run."""

    target: str
    """The training script (or module with ``module=True``)."""
    target_args: tuple[str, ...] = ()
    """Arguments for the script."""
    module: bool = False
    """Run ``target`` as a module (``python -m``)."""
    nodes: int = 1
    """Nodes to allocate; one ``paratrain run`` runs on each."""
    gpus_per_node: int | None = None
    """GPUs per node (``--gpus-per-node``); also the processes per node unless ``nproc_per_node`` is given."""
    nproc_per_node: int | None = None
    """Processes per node; default: the GPUs per node, or ``paratrain run``'s own default."""
    cpus_per_task: int | None = None
    """CPU cores for each node's task, which is every process of that node together."""
    time: str | None = None
    """Time limit, in any form sbatch accepts (``90``, ``1:30:00``, ``2-00``)."""
    partition: str | None = None
    """SLURM partition."""
    account: str | None = None
    """Account to charge."""
    job_name: str | None = None
    """Job name; default: the script's name."""
    log: str = "%x-%j.out"
    """sbatch's ``--output``: where stdout and stderr of the job go (``%x`` job name, ``%j`` job id)."""
    setup: tuple[str, ...] = ()
    """Shell lines run before srun on the first node (``module load …``, ``source .venv/bin/activate``)."""
    run_args: tuple[str, ...] = ()
    """Further ``paratrain run`` flags (``--max-restarts 3``, ``--rdzv-timeout 900``)."""
    grace: int = DEFAULT_GRACE_S
    """Seconds before the time limit at which the ranks are told to save and stop (``--signal=USR1@grace``); the
    job requeues itself once they have. 0: neither."""

    def __post_init__(self) -> None:
        if not isinstance(self.grace, int) or self.grace < 0:
            raise ConfigError(f"--grace must be a whole number of seconds >= 0, got {self.grace!r}")
        for name in ("nodes", "gpus_per_node", "nproc_per_node", "cpus_per_task"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ConfigError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {value!r}")
        if self.time is not None and not _TIME.match(self.time):
            raise ConfigError(f"--time {self.time!r} is not a SLURM time limit; use MINUTES, HH:MM:SS or D-HH")
        for name in ("partition", "account", "job_name", "log"):
            value = getattr(self, name)
            if value is not None and not _WORD.match(value):
                raise ConfigError(f"--{name.replace('_', '-')} {value!r} must be one word without quotes")
        if any("\n" in line for line in self.setup):
            raise ConfigError("--setup takes one shell line at a time; repeat it for several lines")
        if not self.target:
            raise ConfigError("give the training script (or -m module) to run")

    @property
    def name(self) -> str:
        """The job name: given, or the script's (module's) name."""
        base = self.target.rsplit(".", 1)[-1] if self.module else os.path.basename(self.target.rstrip("/"))
        return self.job_name or re.sub(r"[^\w.-]", "_", base.removesuffix(".py")) or "paratrain"

    def run_command(self) -> list[str]:
        """The ``paratrain run`` command each node executes."""
        cmd = ["paratrain", "run"]
        nproc = self.nproc_per_node or self.gpus_per_node
        if nproc:
            cmd += ["--nproc-per-node", str(nproc)]
        if self.grace and not any(a.startswith(("--shutdown-timeout", "--shutdown_timeout")) for a in self.run_args):
            cmd += ["--shutdown-timeout", str(self.grace)]  # how long the launcher waits for its ranks to save
        cmd += list(self.run_args)
        cmd += ["-m", self.target] if self.module else [self.target]
        return cmd + list(self.target_args)


def render_sbatch(spec: SbatchSpec) -> str:
    """The sbatch script for ``spec``."""
    directives = [f"--job-name={spec.name}", f"--nodes={spec.nodes}", "--ntasks-per-node=1"]
    if spec.gpus_per_node:
        directives.append(f"--gpus-per-node={spec.gpus_per_node}")
    if spec.cpus_per_task:
        directives.append(f"--cpus-per-task={spec.cpus_per_task}")
    directives += [
        f"--{flag}={value}"
        for flag, value in (("time", spec.time), ("partition", spec.partition), ("account", spec.account))
        if value
    ]
    directives.append(f"--output={spec.log}")
    if spec.grace:
        directives += [f"--signal=USR1@{spec.grace}", "--requeue", "--open-mode=append"]
    srun = ["srun", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if spec.cpus_per_task:
        srun.append('--cpus-per-task="$SLURM_CPUS_PER_TASK"')  # srun does not inherit it from sbatch
    nproc = spec.nproc_per_node or spec.gpus_per_node
    lines = [
        "#!/bin/bash",
        f"# Written by `paratrain slurm`: {spec.nodes} node(s)"
        + (f" x {nproc} process(es)" if nproc else "")
        + ". Submit with: sbatch THIS_FILE",
        *(f"#SBATCH {d}" for d in directives),
        "",
        "set -euo pipefail",
        *spec.setup,
        "",
        "# One task per node: each node's `paratrain run` reads the allocation (node count, SLURM_NODEID as",
        "# node rank, the first node as master, a port derived from the job id) and starts its processes.",
        *(_requeued(srun, spec) if spec.grace else [" ".join([*srun, shlex.join(spec.run_command())])]),
        "",
    ]
    return "\n".join(lines)


def _requeued(srun: list[str], spec: SbatchSpec) -> list[str]:
    """The srun line, and the requeue when the ranks saved on SLURM's warning (or a preemption's SIGTERM): on exit
    code 75, or when this node's ``paratrain run`` left its mark (srun may end with another node's code)."""
    return [
        f"# SIGUSR1 {spec.grace} s before the time limit: every rank saves at a step they agree on, and paratrain run",
        f"# ends with exit code {PREEMPTED_EXIT_CODE}; the job then goes back into the queue and resumes from there.",
        f'export {MARK_VAR}="${{TMPDIR:-/tmp}}/paratrain-preempted-$SLURM_JOB_ID"',
        f'rm -f "${MARK_VAR}"',
        "status=0",
        " ".join([*srun, shlex.join(spec.run_command()), "|| status=$?"]),
        f'if [ "$status" -eq {PREEMPTED_EXIT_CODE} ] || [ -e "${MARK_VAR}" ]; then',
        f'    rm -f "${MARK_VAR}"',
        '    scontrol requeue "$SLURM_JOB_ID"',
        "fi",
        'exit "$status"',
    ]


def write_sbatch(spec: SbatchSpec, path: str | None) -> None:
    """Check the ``paratrain run`` line with ``paratrain run``'s own parser (a mistyped flag fails here, not
    hours later in the queue), then print the script, or write it (executable) to ``path``."""
    import sys

    from .torchrun import parse_args

    parse_args(spec.run_command()[2:])
    if not spec.module and not os.path.isfile(spec.target):
        print(
            f"paratrain slurm: warning: {spec.target} does not exist in {os.getcwd()}; the job runs it from the "
            "directory you submit from",
            file=sys.stderr,
        )
    text = render_sbatch(spec)
    if path is None:
        sys.stdout.write(text)
        return
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o755)
    print(f"paratrain slurm: wrote {path}; submit it with `sbatch {shlex.quote(path)}`", file=sys.stderr)
