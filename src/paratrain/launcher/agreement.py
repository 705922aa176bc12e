"""Every node of a job must have been started with the same ``--nnodes``; check it before the script runs.

torchrun does not compare the nodes' settings: with the static rendezvous a node started with
``--nnodes 3`` joins a 2-node job and trains in it while its agent expects a third node, and the job then
hangs at exit. The launcher exports its ``--nnodes`` to the workers; after the rendezvous, through the store
the nodes already share, each node publishes it and compares it with the others', and a mismatch ends the
job at once on every node with a one-line error.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta

from ..errors import LaunchError

NNODES_VAR = "PARATRAIN_NNODES"
"""``MIN:MAX`` as this node's launcher was given it; set for multi-node jobs only."""
CHECK_TIMEOUT_S = 300.0
"""How long a node waits for the others to publish their setting (they start within seconds of each other)."""


def check_same_nnodes(environ: Mapping[str, str] | None = None, timeout_s: float = CHECK_TIMEOUT_S) -> None:
    """Raise ``LaunchError`` when the nodes of this job were started with different ``--nnodes``.

    Runs in every worker of a multi-node job before the user's code; needs the agent's store
    (``TORCHELASTIC_USE_AGENT_STORE``), which torchrun shares by default, and does nothing without it.
    """
    env = os.environ if environ is None else environ
    mine = env.get(NNODES_VAR)
    if not mine or env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    from torch.distributed import PrefixStore, TCPStore

    node, nodes = int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"])
    client = TCPStore(
        env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=timeout_s)
    )
    # A new attempt, or a new membership round with another world size, must not read the last one's keys.
    attempt = f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/{env.get('WORLD_SIZE', '')}"
    store = PrefixStore(f"paratrain/nnodes/{attempt}", client)
    if env.get("LOCAL_RANK") == "0":
        store.set(str(node), mine)
    # Node 0 compares every node with itself; the others compare themselves with node 0.
    others = range(1, nodes) if node == 0 else [0]
    for other in others:
        theirs = store.get(str(other)).decode()
        if theirs != mine:
            raise LaunchError(
                f"node {other} was started with --nnodes {_show(theirs)} but node {node} (this one) "
                f"with --nnodes {_show(mine)}; start every node with the same --nnodes"
            )


def _show(spec: str) -> str:
    lo, _, hi = spec.partition(":")
    return lo if lo == hi else spec
