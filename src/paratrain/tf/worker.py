"""Runs the user's TensorFlow script inside each worker of ``paratrain run --tf``.

The launcher starts ``python -m paratrain.tf.worker [-m] TARGET ARGS…`` with this worker's ``TF_CONFIG`` (and
``TF_USE_LEGACY_KERAS`` when tf-keras is the Keras), so that:

* the worker dies with the launcher, even a SIGKILLed one (:mod:`paratrain.launcher.parent_death`);
* an exception is written to the error file the launcher reads, not printed: the launcher reports the job's root
  cause once;
* a script that imports torch stops at that import with one line: TensorFlow and torch never share a process,
  and a PyTorch script belongs to ``paratrain run`` without ``--tf``;
* a script that ends without ever importing TensorFlow is reported as one (it was not a TensorFlow script);
* the script's end is the worker's end (:func:`paratrain.launcher.finish.leave`), without the interpreter teardown.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import traceback

from ..errors import LaunchError
from ..launcher.finish import exit_code, leave
from ..launcher.parent_death import die_with_parent, launcher_pid
from ..launcher.worker import run_target

ERROR_FILE_VAR = "PARATRAIN_TF_ERROR_FILE"
RANK_VAR = "PARATRAIN_TF_RANK"


class TorchInTFWorker(LaunchError, ImportError):
    """``import torch`` in a TensorFlow worker. Also an ``ImportError``: a library that imports torch only if it can
    (``try: import torch except ImportError``) carries on without it."""


class _NoTorch(importlib.abc.MetaPathFinder):
    """Refuses ``import torch`` in a TensorFlow worker, with the reason."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "torch" or name.startswith("torch."):
            raise TorchInTFWorker(
                "this --tf worker imports torch: TensorFlow and torch never share a process; run a "
                "PyTorch script with `paratrain run` without --tf, and keep TensorFlow scripts "
                "free of torch"
            )
        return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    die_with_parent(launcher_pid())
    sys.meta_path.insert(0, _NoTorch())
    try:
        run_target(argv)
        if "tensorflow" not in sys.modules:
            raise LaunchError(
                f"{argv[1] if argv[0] == '-m' else argv[0]} ended without importing TensorFlow: "
                "`paratrain run --tf` runs TensorFlow scripts; drop --tf for a PyTorch script"
            )
    except SystemExit as e:
        leave(exit_code(e.code))
    except BaseException as e:  # noqa: BLE001 - written for the launcher, which reports it once
        _record(e)
        leave(1)
    leave(0)


def _record(error: BaseException) -> None:
    text = "".join(traceback.format_exception(error))
    path = os.environ.get(ERROR_FILE_VAR)
    if not path:
        sys.stderr.write(text)
        return
    with open(path, "w") as f:
        json.dump({"traceback": text, "own": isinstance(error, LaunchError) and str(error)}, f)


if __name__ == "__main__":
    main()
