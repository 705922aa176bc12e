"""Ray Train: a script written for ``paratrain run``, as the function every Ray Train worker runs.

Ray Train's ``TorchTrainer`` starts the workers, sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` … in each, and starts
the process group itself before it calls the function it was given. ``Parallel`` joins that group (and leaves ending
it to Ray), so the script needs no change; :func:`ray_train_loop` is the function to give the trainer::

    TorchTrainer(paratrain.ray_train_loop("train.py", "--epochs", "3"),
                 scaling_config=ScalingConfig(num_workers=8, use_gpu=True)).fit()

The script runs as under ``paratrain run``: as ``__main__``, with its own ``sys.argv``, in the directory the driver
ran in (Ray Train moves its workers into a directory of the run's, where the script's relative paths would point
elsewhere). Nothing here imports Ray: it runs inside Ray's workers, which have it.
"""

from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass

import torch.distributed as dist

from ..errors import LaunchError
from .finish import exit_code
from .worker import run_target


@dataclass(frozen=True)
class RayTrainLoop:
    """Runs ``argv`` (``SCRIPT ARGS…`` or ``-m MODULE ARGS…``) in ``cwd`` (None: where Ray Train put the worker).
    Picklable, as Ray needs; made by :func:`ray_train_loop`."""

    argv: tuple[str, ...]
    cwd: str | None

    def __call__(self) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise LaunchError(
                "ray_train_loop is the function a Ray Train worker runs after Ray started the process "
                "group: pass it to TorchTrainer as train_loop_per_worker"
            )
        where = self.cwd or os.getcwd()
        if not os.path.isdir(where):
            raise LaunchError(
                f"the driver's directory {where} does not exist on {socket.gethostname()}: pass "
                "ray_train_loop(cwd=…) a directory every node has, or cwd=None for Ray Train's own"
            )
        script = os.path.join(where, self.argv[0])
        if self.argv[0] != "-m" and not os.path.isfile(script):
            raise LaunchError(f"script {script} not found on {socket.gethostname()}")
        saved = list(sys.argv), list(sys.path), os.getcwd()
        os.chdir(where)
        try:
            run_target(list(self.argv))
        except SystemExit as e:
            if exit_code(e.code):
                raise LaunchError(f"{' '.join(self.argv)} exited with status {exit_code(e.code)}") from None
        finally:
            sys.argv[:], sys.path[:] = saved[0], saved[1]
            os.chdir(saved[2])


def ray_train_loop(target: str, *args: str, module: bool = False, cwd: str | os.PathLike | None = ".") -> RayTrainLoop:
    """The ``train_loop_per_worker`` for Ray Train's ``TorchTrainer`` that runs ``target`` (a script, or a module
    with ``module=True``) with ``args`` on every worker, as ``paratrain run target args…`` would on every rank.

    ``cwd``: where the script runs, resolved here in the driver (default: the driver's directory, which a single
    machine, a shared file system or Ray's ``runtime_env`` working directory gives every node); None: the directory
    Ray Train gives each worker. A script path is resolved against it.
    """
    where = None if cwd is None else os.path.abspath(cwd)
    script = target if module or where is None else os.path.join(where, target)
    return RayTrainLoop(argv=("-m", target, *args) if module else (script, *args), cwd=where)
