"""A bound on every collective of a script started by ``paratrain run``, even one that sets none itself.

``init_process_group()`` without ``timeout=`` waits 30 minutes on gloo (10 on NCCL) for a peer that stopped
answering: a node that lost power or its network leaves the others hanging that long. ``paratrain run``
exports ``--pg-timeout`` and each worker makes it torch's default before the script runs; a script (or
``paratrain.Parallel(timeout_s=…)``) that passes its own timeout keeps it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

PG_TIMEOUT_VAR = "PARATRAIN_PG_TIMEOUT"
DEFAULT_PG_TIMEOUT_S = 600.0
"""NCCL's own default, applied to gloo too: long enough for a slow checkpoint on rank 0, short of 30 min."""


def apply_default_pg_timeout(environ: Mapping[str, str] | None = None) -> None:
    """Make ``PARATRAIN_PG_TIMEOUT`` seconds torch's default process-group timeout in this process."""
    env = os.environ if environ is None else environ
    seconds = env.get(PG_TIMEOUT_VAR)
    if not seconds:
        return
    from torch.distributed import distributed_c10d

    timeout = timedelta(seconds=float(seconds))
    distributed_c10d.default_pg_timeout = timeout  # read by init_process_group/new_group when given none
    if getattr(distributed_c10d, "default_pg_nccl_timeout", None) is not None:
        distributed_c10d.default_pg_nccl_timeout = timeout
