"""``TF_CONFIG``: the cluster description every ``tf.distribute`` worker reads, built or checked in one place.

TensorFlow's multi-worker strategies read ``TF_CONFIG`` (JSON: ``{"cluster": {"worker": ["host:port", …]},
"task": {"type": "worker", "index": i}}``) once, when the strategy is created. A wrong one fails late and badly:
an index out of range or a malformed address dies deep inside the strategy, and a worker listed but never started
makes the others wait forever. So the launcher builds it from the same flags as a torch job, and a ``TF_CONFIG``
the user wrote is parsed here before anything starts. Pure Python: no TensorFlow, no torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from ..errors import LaunchError

TF_CONFIG_VAR = "TF_CONFIG"
_TASK_TYPES = ("chief", "worker", "evaluator", "ps")


@dataclass(frozen=True)
class TFConfig:
    """One worker's view of the cluster: every task's address by type, and which task this process is."""

    cluster: dict[str, tuple[str, ...]]
    """Task type -> ``host:port`` of each task of that type, in index order."""
    task_type: str = "worker"
    task_index: int = 0

    @classmethod
    def for_workers(cls, addresses: list[str], index: int) -> TFConfig:
        """The ``TF_CONFIG`` of worker ``index`` among ``addresses`` (what ``paratrain run --tf`` hands out)."""
        return cls(cluster={"worker": tuple(addresses)}, task_type="worker", task_index=index)

    @property
    def num_workers(self) -> int:
        """Tasks that train (chief and workers): the number of replicas' processes."""
        return len(self.cluster.get("chief", ())) + len(self.cluster.get("worker", ()))

    @property
    def address(self) -> str:
        """This task's own ``host:port``."""
        return self.cluster[self.task_type][self.task_index]

    @property
    def rank(self) -> int:
        """This task's position among the training tasks (chief first), as paratrain's reports number them."""
        if self.task_type == "worker":
            return len(self.cluster.get("chief", ())) + self.task_index
        return self.task_index

    def to_json(self) -> str:
        return json.dumps(
            {
                "cluster": {k: list(v) for k, v in self.cluster.items()},
                "task": {"type": self.task_type, "index": self.task_index},
            }
        )


def parse_tf_config(text: str) -> TFConfig:
    """Parse and check a ``TF_CONFIG`` value; a ``LaunchError`` saying what is wrong in one line otherwise."""
    where = "TF_CONFIG"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise LaunchError(
            f"{where} is not valid JSON ({e.msg} at character {e.pos}); it should look like "
            '{"cluster": {"worker": ["host:port", …]}, "task": {"type": "worker", "index": 0}}'
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("cluster"), dict) or not data["cluster"]:
        raise LaunchError(
            f'{where} has no "cluster" mapping of task types to address lists, e.g. '
            '{"cluster": {"worker": ["host:port", …]}, …}'
        )
    cluster: dict[str, tuple[str, ...]] = {}
    for kind, addresses in data["cluster"].items():
        if kind not in _TASK_TYPES:
            raise LaunchError(f"{where}: unknown task type {kind!r} in cluster (known: {', '.join(_TASK_TYPES)})")
        if not isinstance(addresses, list) or not addresses:
            raise LaunchError(f"{where}: cluster[{kind!r}] must be a non-empty list of 'host:port' strings")
        for address in addresses:
            _check_address(address, f"{where}: cluster[{kind!r}]")
        cluster[kind] = tuple(addresses)
    task = data.get("task")
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        raise LaunchError(
            f'{where} has no "task" with a "type" and an "index", e.g. "task": {{"type": "worker", "index": 0}}'
        )
    kind, index = task["type"], task["index"]
    if kind not in cluster:
        raise LaunchError(f"{where}: task type {kind!r} is not in the cluster (it lists {', '.join(cluster)})")
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[kind]):
        raise LaunchError(
            f"{where}: task index {index!r} is out of range: cluster[{kind!r}] has "
            f"{len(cluster[kind])} address(es), so the index is 0 … {len(cluster[kind]) - 1}"
        )
    if len(set(a for v in cluster.values() for a in v)) != sum(len(v) for v in cluster.values()):
        raise LaunchError(f"{where}: two tasks share one address; give every task its own host:port")
    return TFConfig(cluster=cluster, task_type=kind, task_index=index)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _check_address(address: object, where: str) -> None:
    if not isinstance(address, str) or ":" not in address:
        raise LaunchError(f"{where}: {address!r} is not a 'host:port' string")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LaunchError(f"{where}: {address!r} is not a 'host:port' address with a port in 1 … 65535")
