"""``paratrain k8s``: a Kubeflow Trainer ``TrainJob`` manifest for a multi-node job.

Kubeflow Trainer (v2, ``trainer.kubeflow.org/v1alpha1``) runs a ``TrainJob`` on a training runtime, by default its
``torch-distributed`` one: one pod per node, each given torchrun's ``PET_*`` variables (node count, processes per
node, node rank, the first pod as master). Every pod runs ``paratrain run …``, which reads them as its flags
(:mod:`paratrain.launcher.kubeflow`), so the manifest names nothing the Trainer already knows. The fields written
are the ones the Trainer reads from ``spec.trainer``: image, command, env, numNodes, numProcPerNode, resourcesPerNode.

Preemption (:mod:`paratrain.preemption`): Kubernetes stops a pod with SIGTERM to its first process, ``paratrain
run``, and kills it ``terminationGracePeriodSeconds`` later. The manifest sets that grace period on the pods of the
runtime's ``node`` job (``spec.runtimePatches``, the one place a TrainJob may change its pods) and has ``paratrain
run`` wait up to 10 s less for its ranks to save, so that it ends, with exit code 75, before the kill.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from ..errors import ConfigError
from ..flags import NO_FLAG, at_least, flag
from .sbatch import DEFAULT_GRACE_S

API_GROUP = "trainer.kubeflow.org"
API_VERSION = f"{API_GROUP}/v1alpha1"
_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
"""RFC 1035 label: what the TrainJob CRD asks of ``metadata.name`` (at most 63 characters)."""
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_WORD = re.compile(r"^\S+$")
_TRAINER_SETS = {
    "--nnodes": "--nodes",
    "--node-rank": None,
    "--node_rank": None,
    "--master-addr": None,
    "--master_addr": None,
    "--master-port": None,
    "--master_port": None,
    "-n": "--nproc-per-node",
    "--nproc": "--nproc-per-node",
    "--nproc-per-node": "--nproc-per-node",
    "--nproc_per_node": "--nproc-per-node",
}
"""``paratrain run`` flags the Trainer gives every pod through ``PET_*``, and the ``paratrain k8s`` flag that sets
each (None: the Trainer alone decides)."""
RUNTIME_JOB = "node"
"""The replicated job of Kubeflow Trainer's ``torch-distributed`` runtime whose pods run the nodes."""
MANAGER = "paratrain"
"""Who owns the manifest's runtime patch (``spec.runtimePatches[].manager``)."""
_LAUNCHER_MARGIN_S = 10
"""Seconds of the grace period left to ``paratrain run`` itself, after its ranks' save, to report and exit."""


@dataclass(frozen=True, kw_only=True)
class TrainJobSpec:
    """What to ask Kubeflow Trainer for and what every node runs."""

    image: str
    """Container image of every node; it must hold paratrain and the script."""
    nodes: int = field(default=1, metadata=flag("--nodes", "-N"))
    """Nodes (pods); one `paratrain run` runs in each."""
    nproc_per_node: int | None = field(default=None, metadata=flag("--nproc-per-node", "-n"))
    """Processes per node (default: the GPUs per node, else 1)."""
    gpus_per_node: int | None = None
    """GPUs per node, as a resource limit."""
    cpus_per_node: str | None = None
    """CPU cores per node, a Kubernetes quantity (16, 500m)."""
    memory_per_node: str | None = None
    """Memory per node, a Kubernetes quantity (64Gi)."""
    gpu_resource: str = "nvidia.com/gpu"
    """The resource name of the nodes' GPUs (amd.com/gpu …)."""
    name: str | None = field(default=None, metadata=flag("--name", "--job-name"))
    """The TrainJob's name (default: the script's)."""
    namespace: str | None = None
    """Kubernetes namespace (default: kubectl's current one)."""
    runtime: str = "torch-distributed"
    """The ClusterTrainingRuntime to run on: Kubeflow Trainer's PyTorch runtime, or one of your own."""
    run_args: str | None = field(default=None, metadata=flag("--run-args", metavar="FLAGS"))
    """More `paratrain run` flags as one string: --run-args='--max-restarts 3'."""
    module: bool = field(default=False, metadata=flag("-m", "--module"))
    """The target is a module (python -m)."""
    target: str = field(default="", metadata=NO_FLAG)
    """The training script (or module with ``module=True``), as the image sees it."""
    target_args: tuple[str, ...] = field(default=(), metadata=NO_FLAG)
    """Arguments for the script."""
    env: tuple[str, ...] = field(default=(), metadata=NO_FLAG)
    """``KEY=VALUE`` variables for every node's container."""
    grace: int = field(default=DEFAULT_GRACE_S, metadata=flag("--grace", metavar="SECONDS"))
    """Seconds between a pod's SIGTERM and its kill: the ranks save and stop in them (0: leave Kubernetes' 30 s)."""

    def __post_init__(self) -> None:
        at_least(self, {"nodes": 1, "nproc_per_node": 1, "gpus_per_node": 1, "grace": 0})
        if 0 < self.grace <= _LAUNCHER_MARGIN_S:
            raise ConfigError(f"--grace {self.grace} leaves no time to save; give more than {_LAUNCHER_MARGIN_S} s")
        if not self.target:
            raise ConfigError("give the training script (or -m module) to run")
        if self.gpus_per_node and self.nproc_per_node and self.nproc_per_node > self.gpus_per_node:
            raise ConfigError(
                f"--nproc-per-node {self.nproc_per_node} is more than --gpus-per-node "
                f"{self.gpus_per_node}: each process needs a GPU of its own"
            )
        for name in ("image", "gpu_resource", "runtime"):
            if not _WORD.match(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)!r} must be one word")
        for name in ("cpus_per_node", "memory_per_node"):
            value = getattr(self, name)
            if value is not None and not _QUANTITY.match(value):
                raise ConfigError(
                    f"--{name.replace('_', '-')} {value!r} is not a Kubernetes quantity "
                    "(a number, optionally with a suffix: 16, 500m, 64Gi)"
                )
        if len(self.job_name) > 63 or not _LABEL.match(self.job_name):
            raise ConfigError(
                f"--name {self.job_name!r} is not a TrainJob name: lower-case letters, digits and "
                "'-', starting with a letter and ending with a letter or digit, at most 63 characters"
            )
        if self.namespace is not None and (len(self.namespace) > 63 or not _NAMESPACE.match(self.namespace)):
            raise ConfigError(f"--namespace {self.namespace!r} is not a Kubernetes namespace name")
        self.env_vars()
        self.run_argv()

    @property
    def job_name(self) -> str:
        """The TrainJob's name: given, or the script's (module's) made a DNS label (``Train_v2.py`` → train-v2)."""
        if self.name is not None:
            return self.name
        base = self.target.rsplit(".", 1)[-1] if self.module else os.path.basename(self.target.rstrip("/"))
        label = re.sub(r"[^a-z0-9]+", "-", base.removesuffix(".py").lower())
        label = re.sub(r"^[^a-z]+", "", label)[:63].rstrip("-")
        return label or "paratrain"

    @property
    def processes(self) -> int:
        """Processes per node: given, or one per GPU, or one."""
        return self.nproc_per_node or self.gpus_per_node or 1

    def env_vars(self) -> list[dict[str, str]]:
        """``env`` as Kubernetes ``EnvVar``s; a malformed entry, or one of the Trainer's own ``PET_*``, is refused."""
        out = []
        for item in self.env:
            key, eq, value = item.partition("=")
            if not eq or not _ENV_NAME.match(key):
                raise ConfigError(f"--env {item!r} must be KEY=VALUE with KEY a variable name")
            if key.startswith("PET_"):
                raise ConfigError(
                    f"--env {key}: Kubeflow Trainer sets the PET_* variables itself and refuses a "
                    "TrainJob that sets them; use --nodes and --nproc-per-node"
                )
            out.append({"name": key, "value": value})
        return out

    def run_argv(self) -> list[str]:
        """``run_args`` as words; a flag the Trainer already gives every pod is refused, naming ours."""
        try:
            words = shlex.split(self.run_args or "")
        except ValueError as err:
            raise ConfigError(f"--run-args {self.run_args!r} cannot be split into words: {err}") from None
        for word in words:
            given = word.partition("=")[0]
            if given.startswith("-n") and not given.startswith("--"):
                given = "-n"  # -n4
            if given in _TRAINER_SETS:
                ours = _TRAINER_SETS[given]
                raise ConfigError(
                    f"--run-args {word!r}: the Trainer gives every pod that through PET_*; "
                    + (f"use `paratrain k8s {ours}` instead" if ours else "leave it out")
                )
        return words

    def run_command(self) -> list[str]:
        """The ``paratrain run`` command every node's container runs."""
        target = ["-m", self.target] if self.module else [self.target]
        words = self.run_argv()
        if self.grace and not any(w.startswith(("--shutdown-timeout", "--shutdown_timeout")) for w in words):
            words = ["--shutdown-timeout", str(self.grace - _LAUNCHER_MARGIN_S), *words]
        return ["paratrain", "run", *words, *target, *self.target_args]


def trainjob(spec: TrainJobSpec) -> dict[str, Any]:
    """The TrainJob for ``spec``, as the object ``kubectl apply`` reads."""
    trainer: dict[str, Any] = {
        "image": spec.image,
        "command": spec.run_command(),
        "numNodes": spec.nodes,
        "numProcPerNode": spec.processes,
    }
    limits = {
        key: value
        for key, value in (
            (spec.gpu_resource, spec.gpus_per_node),
            ("cpu", spec.cpus_per_node),
            ("memory", spec.memory_per_node),
        )
        if value is not None
    }
    if limits:  # requests default to the limits
        trainer["resourcesPerNode"] = {"limits": limits}
    if spec.env:
        trainer["env"] = spec.env_vars()
    metadata = {"name": spec.job_name, **({"namespace": spec.namespace} if spec.namespace else {})}
    job_spec: dict[str, Any] = {
        "runtimeRef": {"apiGroup": API_GROUP, "kind": "ClusterTrainingRuntime", "name": spec.runtime},
        "trainer": trainer,
    }
    if spec.grace:
        job_spec["runtimePatches"] = [_grace_patch(spec.grace)]
    return {"apiVersion": API_VERSION, "kind": "TrainJob", "metadata": metadata, "spec": job_spec}


def _grace_patch(seconds: int) -> dict[str, Any]:
    """The runtime patch that gives the pods of the runtime's node job ``seconds`` between SIGTERM and the kill."""
    pods = {"spec": {"template": {"spec": {"terminationGracePeriodSeconds": seconds}}}}
    jobs = [{"name": RUNTIME_JOB, "template": pods}]
    return {"manager": MANAGER, "trainingRuntimeSpec": {"template": {"spec": {"replicatedJobs": jobs}}}}


def render_trainjob(spec: TrainJobSpec, *, as_json: bool = False) -> str:
    """The manifest as YAML with a header saying how to submit it (or as JSON, which kubectl reads too)."""
    job = trainjob(spec)
    if as_json:
        return json.dumps(job, indent=2) + "\n"
    header = [
        f"# Written by `paratrain k8s`: a Kubeflow Trainer TrainJob, {spec.nodes} node(s) x {spec.processes} "
        "process(es).",
        "# Submit with: kubectl apply -f THIS_FILE. Each node runs `paratrain run`, which reads the PET_*",
        "# variables the Trainer sets (node count, node rank, master address and port, processes per node).",
    ]
    return "\n".join([*header, *_yaml(job), ""])


def write_trainjob(spec: TrainJobSpec, path: str | None) -> None:
    """Check the ``paratrain run`` line with ``paratrain run``'s own parser (a mistyped flag fails here, not in the
    cluster), then print the manifest, or write it to ``path`` (JSON when ``path`` ends in ``.json``)."""
    import sys

    from .torchrun import parse_args

    parse_args(spec.run_command()[2:])
    text = render_trainjob(spec, as_json=path is not None and path.endswith(".json"))
    if path is None:
        sys.stdout.write(text)
        return
    with open(path, "w") as f:
        f.write(text)
    print(f"paratrain k8s: wrote {path}; submit it with `kubectl apply -f {shlex.quote(path)}`", file=sys.stderr)


def _yaml(value: Any, depth: int = 0) -> list[str]:
    """Block-style YAML lines for nested dicts and lists; every string double-quoted (a JSON string is a YAML one),
    so no value can be read as a number, a boolean or a comment."""
    pad, lines = "  " * depth, []
    items = value.items() if isinstance(value, dict) else ((None, v) for v in value)
    for key, item in items:
        lead = f"{pad}{key}:" if key is not None else f"{pad}-"
        if isinstance(item, (dict, list)) and item:
            nested = _yaml(item, depth + 1)
            if key is None and isinstance(item, dict):  # "- first: …" then the rest beneath it
                lines += [f"{lead} {nested[0].lstrip()}", *nested[1:]]
            else:
                lines += [lead, *nested]
        else:
            lines.append(f"{lead} {json.dumps(item, ensure_ascii=False)}")
    return lines
