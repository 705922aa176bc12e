"""What a strategy is: a thin object that wraps a model and optimizer for one way of parallelising.

The real work lives in free functions over a model and a ``DeviceMesh`` (:mod:`paratrain.distributed`) so hybrid
strategies compose them instead of copying them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn

from ..batch import ModelCall
from ..dims import ParallelDims
from ..distributed.context_parallel.part import WholeSequences
from ..distributed.expert_parallel.part import WholeExperts
from ..distributed.runtime import Runtime
from ..distributed.tensor_parallel.part import WholeLayers
from ..env import ClusterEnv
from ..model.materialize import Materializer
from .serving import NoServer

if TYPE_CHECKING:
    from ..options import EPConfig, TPConfig


class Strategy(ABC):
    """Base class of every registered strategy."""

    name: ClassVar[str]
    tp: WholeLayers = WholeLayers()
    """The part that splits layers over ranks (``tp=``: :mod:`paratrain.distributed.tensor_parallel`); by default
    none, whose hooks give the strategy's own answers back (stateless, so one serves every strategy)."""
    cp: WholeSequences = WholeSequences()
    """The part that splits sequences over ranks (``cp=``: :mod:`paratrain.distributed.context_parallel`); by
    default none."""
    server: NoServer = NoServer()
    """The part where some ranks serve the others instead of training (parameter servers:
    :class:`~paratrain.strategies.param_server.ServerRole`); by default none, every rank training."""

    @property
    def host_tensors(self) -> bool:
        """The strategy sends host tensors through the job's group (a parameter server's messages, CPU-offloaded
        shards): on CUDA the group is then gloo beside NCCL (:func:`~paratrain.devices.job_backend`)."""
        return False

    def process_device(self, env: ClusterEnv, device: torch.device) -> torch.device:
        """The device this rank of ``env`` binds its process group to and makes current, given ``device``, the one
        its local rank selects (:func:`paratrain.devices.select_device`): that one, for a process on one device."""
        return device

    def uses_group(self, env: ClusterEnv) -> bool:
        """Whether this strategy needs a process group and a mesh in ``env`` (one process gets a private group)."""
        return True

    def dims(self, env: ClusterEnv) -> ParallelDims:
        """This strategy's degrees over ``env``'s ranks; the default replicates over every rank (or every tp
        group)."""
        tp = self.tp_degree(env)
        return ParallelDims(dp_replicate=env.world_size // tp, tp=tp)

    def tp_degree(self, env: ClusterEnv) -> int:
        """Ranks that split each layer (1 without tp); a degree that does not divide the processes is refused,
        naming the layouts that fit."""
        return self.tp.degree(self.name, env.world_size)

    def validate(self, env: ClusterEnv) -> None:
        """Raise a ConfigError when this strategy cannot run in ``env``."""
        self.dims(env)

    def materializer(self, model: nn.Module, device: torch.device, init_fn: Any) -> Materializer | None:
        """How a model built on the meta device gets its tensors (None when it is not on meta): by default the
        composition path's materialize step, each rank allocating what it holds."""
        return Materializer.of(model, device, init_fn)

    @abstractmethod
    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        """Place and wrap ``model``; return the module to train."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` (for sharded optimizers); the default keeps it."""
        return optimizer

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context in which backward accumulates gradients without communicating."""
        return nullcontext()

    def output_device(self, rt: Runtime) -> torch.device:
        """Where the prepared model's outputs land, and so where targets belong."""
        return rt.device

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``wrap_model`` added."""
        return model

    def data_parallel(self, rt: Runtime) -> tuple[int, int, dist.ProcessGroup | None]:
        """(rank, size, group) among the replicas that read different data; metrics are reduced over it.

        Every rank for data-parallel strategies; pipeline ranks of one replica read the same batch, and so do
        the ranks of one tensor-parallel group.
        """
        return self.cp.data_parallel(rt.mesh, self.tp.data_parallel(rt.mesh, (rt.env.rank, rt.env.world_size, None)))

    def metrics(self, rt: Runtime) -> tuple[int, dist.ProcessGroup | None]:
        """(size, group) over which ``par.mean``/``par.sum`` reduce: the replicas of :meth:`data_parallel`."""
        _, size, group = self.data_parallel(rt)
        return size, group

    def rng_rank(self, rt: Runtime) -> int:
        """The index that seeds this rank's random stream after ``prepare``: its rank, or its replica's index
        where ranks compute one replica together (tensor parallelism), so they draw alike."""
        return self.tp.rng_rank(rt.mesh, self.cp.data_parallel(rt.mesh, (rt.env.rank, rt.env.world_size, None))[0])

    def every_rank_reason(self) -> str | None:
        """Why a forward of the prepared model, or its whole state, needs every rank (words for the line said when
        one rank does it alone: :mod:`paratrain.rank_alone`); None where each rank holds the whole model."""
        return self.tp.every_rank_reason(self.name)

    def optimizer_every_rank_reason(self) -> str | None:
        """Why the optimizer's whole state needs every rank (as :meth:`every_rank_reason`)."""
        return self.every_rank_reason()

    def batch(self, call: ModelCall) -> ModelCall:
        """``forward_backward``'s micro-batch as this rank runs it (a sequence split cuts the target to its slice)."""
        return self.cp.batch(call)

    def forward_backward(self, model: nn.Module, call: ModelCall, scale: float) -> torch.Tensor | None:
        """Run forward and backward of the micro-batch ``call`` when the strategy owns that loop (pipelines, the
        vocabulary-split loss of tensor parallelism); None: it doesn't."""
        return self.tp.forward_backward(model, call, scale)

    def head_loss_refusal(self) -> str | None:
        """Why the loss cannot be computed at the model's head in chunks (``loss_chunk``), in words for a one-line
        error; None: it can, since the model runs whole on this rank as the user wrote it."""
        return self.cp.head_loss_refusal() or self.tp.head_loss_refusal()

    def traffic_bytes(self, model: nn.Module, steps: int) -> int | None:
        """Bytes this rank has sent plus received to keep ``model`` in step with the other ranks over its first
        ``steps`` optimizer steps (``paratrain bench``'s bytes/step); None where this strategy does not count them."""
        return None

    def grad_norm_group(self, model: nn.Module) -> dist.ProcessGroup | None:
        """Group over which local gradient norms add up to the global one (pipeline stages); None: no such group."""
        return None

    def sync_gradients(self, model: nn.Module) -> None:
        """Complete the gradients on the step that synchronises, before clipping and the optimizer step, where the
        wrapped model's backward does not (a weight tied across pipeline stages, tensor parallelism's partial
        sums); the default has nothing else to do."""
        self.tp.sync_gradients(model)

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        """Context of the optimizer's step at the end of an accumulation window: tensor parallelism updates the
        replicated parameters on their local tensors in it (see
        :mod:`paratrain.distributed.tensor_parallel.local_step`); the default changes nothing."""
        return self.tp.optimizer_stepping(optimizer)

    def grad_norm_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        """This rank's parameters whose gradients make up its part of the global norm, so that a tensor held on
        several ranks of ``grad_norm_group`` (a tied weight on two pipeline stages) is counted once."""
        return list(model.parameters())

    def full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        """The consolidated state dict (see :func:`paratrain.distributed.state_dict.full_state_dict`)."""
        from ..distributed.state_dict import full_state_dict

        return full_state_dict(self.unwrap(model), rank0_only=rank0_only)

    def model_state(self, model: nn.Module) -> dict[str, Any]:
        """This rank's part of the model state for a checkpoint (see :mod:`paratrain.checkpoint.states`): keyed
        by the user's parameter names, sharded tensors left sharded, so a load onto another world size or
        strategy reshards."""
        from ..checkpoint.states import model_state

        return model_state(self.unwrap(model))

    def load_model_state(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Copy a loaded ``model_state`` into ``model``."""
        from ..checkpoint.states import load_model_state

        load_model_state(self.unwrap(model), state)

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of ``optimizer``'s state for a checkpoint, per parameter name of ``model``."""
        from ..checkpoint.states import optimizer_state

        return optimizer_state(self.unwrap(model), optimizer)

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        """Put a loaded ``optimizer_state`` into ``optimizer``."""
        from ..checkpoint.states import load_optimizer_state

        load_optimizer_state(self.unwrap(model), optimizer, state)

    def describe(self) -> str:
        return self.name


def tensor_parallel(config: TPConfig | None) -> WholeLayers:
    """A strategy's tensor-parallel part for ``config`` (None: layers whole). Imported here, when used:
    ``torch.distributed.tensor`` takes over a second to import, which every strategy would otherwise pay at
    ``import paratrain``."""
    if config is None:
        return WholeLayers()
    from ..distributed.tensor_parallel.compose import TensorParallel

    return TensorParallel(config)


def expert_parallel(config: EPConfig | None) -> WholeExperts:
    """A strategy's expert-parallel part for ``config`` (None: every expert on every rank)."""
    if config is None:
        return WholeExperts()
    from ..distributed.expert_parallel.part import ExpertParallel

    return ExpertParallel(config.degree)
