"""The strategy a job runs and the device mesh it runs on, decided once.

A named strategy is decided at construction. ``auto`` at several processes is not: it is chosen when ``prepare``
first sees the model (:mod:`.auto`), by every rank alike, and only then is the mesh built. Until that moment the
data-parallel view (loaders, ``mean``) has no layout to follow and refuses in one line.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..batch import ModelCall, counted
from ..distributed.mesh import build_mesh
from ..distributed.metrics import reduce_value
from ..distributed.router_loss import balance_globally
from ..env import ClusterEnv
from ..errors import ConfigError
from ..loss.recipes import counted_targets, target_key
from ..model.packed import is_packed, use_packed_attention
from .auto import BEFORE_THE_MODEL, agree_on_strategy
from .base import Runtime, Strategy
from .registry import strategy_for


class ChosenStrategy:
    """``Parallel(strategy=spec, **options)``'s strategy and mesh, with ``auto``'s choice deferred to the model."""

    def __init__(
        self, spec: str | Strategy, env: ClusterEnv, options: dict[str, Any], moe_aux_loss: str = "local"
    ) -> None:
        self.env = env
        self.moe_aux_loss = moe_aux_loss
        """How a mixture of experts' router loss is computed (:mod:`paratrain.distributed.router_loss`)."""
        self.strategy = strategy_for(spec, env, options)
        self.pending = spec == "auto" and env.world_size > 1 and not options
        """True while ``auto`` waits for the model (it stands for ddp until then)."""
        self.strategy.validate(env)
        self.mesh: DeviceMesh | None = None

    def placement(self) -> dict[str, Any]:
        """What the session needs of the strategy to start this rank: whether the job needs a process group,
        whether this rank runs on the host whatever the accelerator (a parameter server), whether the strategy
        sends host tensors of its own (then the group serves them beside the accelerator's), whether this rank
        starts a private group instead of joining the job's (a parameter-server worker that came back), and which
        device it binds given the one its local rank selects (``model_parallel``: its first stage's)."""
        return {
            "needs_group": self.pending or self.strategy.uses_group(self.env),
            "on_host": not self.pending and self.strategy.server.on_host(self.env),
            "host_tensors": self.strategy.host_tensors,
            "alone": not self.pending and self.strategy.server.joins_alone(self.env),
            "device_of": self.process_device,
        }

    def process_device(self, selected: torch.device) -> torch.device:
        """The device this rank binds its group to and makes current, given ``selected``, its local rank's: the
        strategy's choice (``auto`` waiting for the model stays on ``selected``)."""
        return selected if self.pending else self.strategy.process_device(self.env, selected)

    def agreed_values(self) -> dict[str, str]:
        """What every rank must have alike. The mesh, not the processes per node: torchrun lets nodes run different
        numbers of processes, and only a layout built from them (hsdp's shard groups of one node) must then be the
        same everywhere."""
        if self.pending:
            return {"strategy": "auto", "mesh": "auto", "moe_aux_loss": self.moe_aux_loss}
        return {
            "strategy": self.strategy.describe(),
            "mesh": str(self.strategy.dims(self.env).mesh_shape()),
            "moe_aux_loss": self.moe_aux_loss,
        }

    def build_mesh(self, device: torch.device) -> None:
        """The mesh of the decided strategy, when it runs on a process group (none while ``auto`` waits)."""
        if (
            not self.pending
            and self.strategy.uses_group(self.env)
            and dist.is_initialized()
            and dist.get_world_size() == self.env.world_size
        ):  # not on a rank that joined alone
            self.mesh = build_mesh(device, self.strategy.dims(self.env), self.env.world_size)

    def decide(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None,
        loader: Any,
        device: torch.device,
        precision: str,
        say: Callable[[str], None],
    ) -> None:
        """Choose ``auto``'s layout for ``model`` (collective, agreed by every rank), then build its mesh; nothing
        when the strategy was already decided. ``optimizer`` and ``loader`` (if given) are planned with it."""
        if self.pending:
            self.strategy = agree_on_strategy(model, optimizer, self.env, device, precision, say, loader)
            self.pending = False
            self.build_mesh(device)

    def wrap_model(self, model: nn.Module, runtime: Runtime) -> nn.Module:
        """The strategy's wrap of ``model``, its router loss made the global batch's first where
        ``moe_aux_loss="global"`` asks (a hook on the user's module, which every wrapper calls)."""
        if self.moe_aux_loss == "global":
            _, replicas, group = self.data_parallel(runtime)
            balance_globally(model, group, replicas)
        return self.strategy.wrap_model(model, runtime)

    def data_parallel(self, runtime: Runtime) -> tuple[int, int, dist.ProcessGroup | None]:
        """(rank, size, group) of the replicas that read different data."""
        if self.pending:
            raise ConfigError(BEFORE_THE_MODEL)
        return self.strategy.data_parallel(runtime) if dist.is_initialized() else (0, 1, None)

    def pack(self, runtime: Runtime, model: nn.Module, call: ModelCall) -> ModelCall:
        """``call`` as the model runs it when it is a packed micro-batch (documents found from restarting
        ``position_ids`` or ``cu_seq_lens_q``): attention kept within each document, and its loss made the sum over
        its real targets divided by the real targets of the global micro-batch (over the replicas), not its own mean,
        so replicas holding more real tokens weigh more, as in one process that runs every document. A transformers
        loss (``labels=``) is given ``num_items_in_batch``; a ``loss_fn``'s mean over its target's counted elements
        (:func:`~paratrain.batch.counted`) is weighed (:attr:`ModelCall.items`); a model's own ``model(x, y)`` mean
        cannot be, and is refused over several replicas. Other calls pass unchanged."""
        if not is_packed(call.kwargs):
            return call
        dims = self.strategy.dims(runtime.env)
        if dims.cp == 1:  # cp's attention keeps the documents apart itself (distributed/context_parallel)
            use_packed_attention(self.strategy.unwrap(model))
        if call.loss_kwargs.get("num_items_in_batch") is not None:
            return call
        count = counted_targets(call)
        if count is None and call.loss_fn is not None and isinstance(call.target, torch.Tensor):
            count = counted(call.target)
        _, size, group = self.data_parallel(runtime)  # the ranks of a tp group share their replica's batch
        if count is None:
            if size > 1 and call.own_loss and target_key(call) in ("target", "targets"):
                raise ConfigError(
                    f"a packed batch with {type(self.strategy.unwrap(model)).__name__}'s own loss from its "
                    "targets: its mean over one replica's tokens cannot be weighed by the global batch's; give "
                    "forward_backward a loss_fn over the logits (a mean over the targets not below 0), or labels="
                )
            return call
        total = reduce_value(count.to(runtime.device), mean=False, size=size, group=group, device=runtime.device)
        if call.loss_fn is not None:
            return replace(call, items=total / size)
        return replace(call, loss_kwargs={**call.loss_kwargs, "num_items_in_batch": total / size})

    def metrics(self, runtime: Runtime) -> tuple[int, dist.ProcessGroup | None]:
        """(size, group) over which ``par.mean`` and ``par.sum`` reduce."""
        if self.pending:
            raise ConfigError(BEFORE_THE_MODEL)
        return self.strategy.metrics(runtime) if dist.is_initialized() else (1, None)
