"""Kubeflow Trainer: the ``PET_*`` variables its torch runtime sets in every pod, checked before torchrun reads them.

Kubeflow Trainer (v2, the ``TrainJob`` API) starts one container per node and sets ``PET_NNODES``,
``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and ``PET_MASTER_PORT`` in it. torchrun's parser,
which ``paratrain run`` uses, reads any ``PET_<FLAG>`` as the default of ``--<flag>``, so ``paratrain run train.py``
in such a pod needs no flags. What this module adds: a malformed value is one line naming the variable (torchrun's
parser would name a flag the pod's command never gave). In a pod the master's name resolves only once the master's
pod runs: :func:`paratrain.launcher.multinode.prepare_network` waits for it there. Checking is a pure function of a
mapping, so it is tested with fake environments.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import LaunchError
from .multinode import nnodes_range

PET_FLAGS = {
    "PET_NNODES": "--nnodes",
    "PET_NPROC_PER_NODE": "--nproc-per-node",
    "PET_NODE_RANK": "--node-rank",
    "PET_MASTER_ADDR": "--master-addr",
    "PET_MASTER_PORT": "--master-port",
}
"""The variables Kubeflow Trainer's torch runtime sets, and the ``paratrain run`` flag each stands for."""
_NPROC_WORDS = ("auto", "cpu", "gpu")


def check_pet(environ: Mapping[str, str]) -> None:
    """A one-line ``LaunchError`` for the first ``PET_*`` variable whose value no launch can use."""
    for name in PET_FLAGS:
        value = environ.get(name)
        if value is not None and (problem := _problem(name, value, environ)):
            raise LaunchError(
                f"{name}={value!r} {problem}; torchrun and `paratrain run` read PET_* variables "
                "(Kubeflow Trainer sets them in each pod) as their flags, this one as "
                f"{PET_FLAGS[name]}: correct it or unset it"
            )


def _problem(name: str, value: str, environ: Mapping[str, str]) -> str | None:
    if name == "PET_NNODES":
        try:
            nnodes_range(value)
        except LaunchError:
            return "is not a node count N or MIN:MAX with 0 < MIN <= MAX"
    elif name == "PET_NPROC_PER_NODE":
        if value not in _NPROC_WORDS and not (value.isdigit() and int(value) >= 1):
            return "is not a number of processes >= 1 (or auto, cpu, gpu)"
    elif name == "PET_NODE_RANK":
        if not value.isdigit():
            return "is not a node rank (a whole number >= 0)"
        nodes = _fixed_nodes(environ.get("PET_NNODES", ""))
        if nodes is not None and int(value) >= nodes:
            return f"is outside a job of PET_NNODES={nodes} (node ranks are 0 … {nodes - 1})"
    elif name == "PET_MASTER_ADDR":
        if not value.strip():
            return "is empty: give the master node's name or address"
    elif not (value.isdigit() and 0 < int(value) < 65536):
        return "is not a TCP port (1 … 65535)"
    return None


def _fixed_nodes(nnodes: str) -> int | None:
    """``PET_NNODES`` as one node count, or None when it is a range or not a number."""
    return int(nnodes) if nnodes.isdigit() and int(nnodes) > 0 else None
