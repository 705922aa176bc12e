"""``pipeline`` and ``hybrid``: pipeline parallelism with micro-batches on ``torch.distributed.pipelining``.

The model is cut into stages, one per rank of the ``pp`` mesh dimension (two or more per rank for the
interleaved schedule): an ``nn.Sequential`` between its layers, any other model between its repeated blocks
(GPT-2's ``transformer.h.*``, Llama's ``model.layers.*``), each stage being the model itself with the other
stages' pieces swapped out (:mod:`paratrain.model.stages`). A weight tied across stages (an embedding reused by
the output head) lives on both stages; their gradients are summed before clipping and the optimizer step.

Each batch is split into micro-batches that flow through the stages under a schedule: GPipe (all forwards,
then all backwards), 1F1B (one forward, one backward: at most ``p`` micro-batches of activations alive instead
of ``m``) or interleaved 1F1B (several stages per rank, a smaller bubble). The loss is computed on the last
stage; gradients are the mean over micro-batches.

``hybrid`` adds a data-parallel dimension: ``dp`` x ``pp`` ranks, each pipeline's stages replicated with DDP
across the ``dp`` dimension, with their optimizer's states sharded over it by ``ZeroRedundancyOptimizer``
(``data="zero1"``, ZeRO-1), or sharded with FSDP (``data="fsdp"``).

``tp=T`` splits each stage's layers over T ranks as well (the model's tensor-parallel plan applied per stage, its
boundaries whole: :mod:`paratrain.distributed.tensor_parallel.stage_styles`): a ``(pp, tp)`` mesh for ``pipeline``,
``(dp, pp, tp)`` for ``hybrid``, ``tp`` innermost. The last stage's loss runs on logits split over the vocabulary, under
``loss_parallel``, as ``tp`` without stages does; with DDP the stages are replicated by FSDP2's ``replicate``
(``DistributedDataParallel`` refuses DTensor parameters), as ``Parallel("ddp", tp=T)`` does.

``ep=E`` (``hybrid`` only) splits each stage's routed experts over groups of E of that stage's ``dp`` replicas, tokens
exchanged within the group, as ``Parallel("ddp"|"zero3", ep=E)`` splits them over its data-parallel ranks
(:mod:`paratrain.distributed.expert_parallel`); ``pipeline`` has one replica, nothing to split them over.

Training runs through ``par.forward_backward(model, x, y, loss_fn)``; calling the prepared model runs a
forward-only pass and gives every rank of the pipeline the last stage's output.
"""
from __future__ import annotations

import math
import sys
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batch import ModelCall
from ..composition import refusal, refuse_degree
from ..dims import ParallelDims
from ..distributed.data_parallel import apply_ddp, apply_fsdp, apply_replicate
from ..distributed.optimizer import rebuild
from ..distributed.parallelize import Step, takes_meta
from ..distributed.pipeline import PipelinedModel, stage_states
from ..distributed.pipeline_metadata import keep_buffers_through_metadata_pass
from ..env import ClusterEnv
from ..errors import ConfigError
from ..model.cuts import cut_points
from ..model.materialize import to_device
from ..model.stages import StageModule, StagePlan, build_stage, plan_stages
from ..options import CPConfig, DDPConfig, EPConfig, FSDPConfig, PipelineConfig, TPConfig
from .base import Runtime, Strategy, expert_parallel, tensor_parallel
from .data_engines import load_zero_optimizer_state, zero_optimizer_state
from .registry import register


class PipelineStrategy(Strategy):
    """Shared by ``pipeline`` (pp = world) and ``hybrid`` (dp x pp)."""

    name = "pipeline"
    native_precision = True  # applied to each stage, not to the prepared model

    def __init__(self, config: PipelineConfig | None = None, **options: object) -> None:
        cp = CPConfig.pop(options)
        if cp is not None:
            raise ConfigError(refuse_degree(self.name, "cp", cp.degree))
        self.tp = tensor_parallel(TPConfig.pop(options))
        self.ep = expert_parallel(EPConfig.pop(options, self.name, takes_ep=True))  # refused below where not taken
        self.config = config if config is not None else PipelineConfig(**options)  # type: ignore[arg-type]
        tp = self.tp.config.degree if self.tp.splits else 1  # type: ignore[union-attr]
        refused = refusal(self.name, tp=tp, ep=self.ep.degree, data=self.config.data)
        if refused:
            raise ConfigError(refused)
        self._names: dict[int, dict[int, str]] = {}

    def degrees(self, env: ClusterEnv) -> tuple[int, int]:
        """(dp, pp)."""
        return 1, env.world_size // self.tp_degree(env)

    def dims(self, env: ClusterEnv) -> ParallelDims:
        dp, pp = self.degrees(env)
        zero = {"fsdp": 3, "zero1": 1}.get(self.config.data, 0) if dp > 1 else 0
        data = {"dp_shard": dp, "zero": zero} if zero else {"dp_replicate": dp}
        return ParallelDims(**data, pp=pp, tp=self.tp_degree(env), ep=self.ep.degree)

    def validate(self, env: ClusterEnv) -> None:
        dp, pp = self.degrees(env)
        if pp < 2:
            tp = self.tp_degree(env)
            need = f"{2 * tp} processes with tp={tp}" if tp > 1 else "processes"
            raise ConfigError(f"{self.name} needs at least 2 pipeline stages ({need}); launch more with -n")

    def rng_rank(self, rt: Runtime) -> int:
        """Each stage of each replica its own random stream; the ranks of one tp group share theirs."""
        assert rt.mesh is not None
        return rt.mesh["dp"].get_local_rank() * rt.mesh["pp"].size() + rt.mesh["pp"].get_local_rank()

    def data_parallel(self, rt: Runtime) -> tuple[int, int, dist.ProcessGroup | None]:
        assert rt.mesh is not None
        dp = rt.mesh["dp"]
        return dp.get_local_rank(), dp.size(), dp.get_group() if dp.size() > 1 else None

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        self.tp.check_stages(model, self.name)
        self.ep.check(model)
        if rt.precision.name == "fp16-mixed":
            raise ConfigError(f"{self.name} does not support fp16-mixed (loss scaling across stages); use bf16-mixed")
        assert rt.mesh is not None
        pp_mesh = rt.mesh["pp"]
        pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        total = pp * (self.config.stages_per_rank or 1)
        mine = [pp_rank + k * pp for k in range(self.config.stages_per_rank or 1)]  # interleaved: loop placement
        if isinstance(model, nn.Sequential):
            out = self._wrap_sequential(model, rt, total, mine)
        else:
            out = self._wrap_blocks(model, rt, total, mine)
        out.num_stages, out.device = total, rt.device
        out.pp_group = pp_mesh.get_group()
        out.last_rank = dist.get_global_rank(out.pp_group, (total - 1) % pp)
        out.microbatches = self.config.microbatches
        out.eval_outputs = self.config.eval_outputs
        out.schedule_name = self.config.schedule
        out.precision = rt.precision
        out.split_loss = self.tp.split_loss
        return out

    def _wrap_sequential(self, model: nn.Sequential, rt: Runtime, total: int, mine: list[int]) -> PipelinedModel:
        if len(model) < total:
            raise ConfigError(f"{self.name} needs at least {total} layers for {total} stages; the model has "
                              f"{len(model)}")
        names = list(model._modules)
        split = self.config.split
        if self.config.split_points is not None:
            unknown = [p for p in self.config.split_points if p not in names]
            if unknown:
                raise ConfigError(f"pipeline split points {unknown} are not layers of this nn.Sequential; name "
                                  f"layers such as {names[min(1, len(names) - 1)]!r}")
            split = [names.index(p) for p in self.config.split_points]
        starts = cut_points(model, total, split)
        bounds = list(zip(starts, [*starts[1:], len(model)]))
        assert rt.facts is not None
        owned = [(names[i], model[i]) for s in mine for i in range(*bounds[s])]
        out = PipelinedModel(owned)
        data = self._with_experts(lambda m: self._place(m, rt), rt)
        out.parts = [(s, rt.parallelize(model[bounds[s][0]:bounds[s][1]], data=data)) for s in mine]
        self._names[id(out)] = rt.facts.first_names
        return out

    def _wrap_blocks(self, model: nn.Module, rt: Runtime, total: int, mine: list[int]) -> PipelinedModel:
        """Cut a model between its repeated blocks; each stage is the model's own forward on a stage copy."""
        plan = plan_stages(model, total, self.config.split_points, self.config.split, rt.facts)
        here = build_stage(model, plan, mine)  # everything this rank holds, under the user's names
        out = PipelinedModel(list(here.named_children()))
        # The optimizer maps its parameters by name: a tied tensor is found under the name this rank holds it by
        # (the head's on the last stage), not only under its first name (the embedding's).
        assert rt.facts is not None
        first = rt.facts.first_names
        names = {**first, **{id(p): n for n, p in here.named_parameters()}}
        out.aliases = {n: first[i] for i, n in names.items() if n != first.get(i, n)}
        out.key_order = list(model.state_dict())
        out.tied, out.uncounted = _tie_groups(model, plan, rt, mine)  # before FSDP swaps the parameters
        units = FSDPConfig(wrap_classes=(plan.blocks.cls,))  # one sharding unit per block, never a bare container
        for s in mine:
            stage = StageModule(build_stage(model, plan, [s]), s, last=s == total - 1)
            split = self._stage_split(model, plan, s, total, rt)
            out.stage_modules[s] = stage
            out.parts.append((s, rt.parallelize(stage, tp=split, data=self._stage_step(rt, units))))
        self._names[id(out)] = names
        return out

    def _stage_step(self, rt: Runtime, units: FSDPConfig) -> Step:
        """Place (and replicate or shard) one stage; FSDP shards a stage still on the meta device, so each rank
        then materializes only its shard of it (DDP needs real tensors: the stage is materialized first)."""
        step = lambda m: self._place(m, rt, units)  # noqa: E731
        return self._with_experts(takes_meta(step) if self.config.data == "fsdp" else step, rt)

    def _with_experts(self, step: Step, rt: Runtime) -> Step:
        """``step`` with the stage's routed experts split over its ``dp`` replicas first (``ep=``; else ``step``), in
        the layout the replicas' engine gives them: beside DDP, or sharded by FSDP with the stage's precision."""
        assert rt.mesh is not None
        shard = self.config.data == "fsdp"
        options = {"mp_policy": rt.precision.fsdp_policy(cast_output=False)} if shard else {}
        return self.ep.data_step(step, rt.mesh["dp"], rt.device, 3 if shard else 0, options, stage=True)

    def _stage_split(self, model: nn.Module, plan: StagePlan, s: int, total: int, rt: Runtime) -> Step | None:
        """Tensor parallelism of stage ``s`` by the whole model's plan, its boundaries whole (None without tp)."""
        (start, end), blocks = plan.bounds[s], plan.blocks.names
        return self.tp.stage_splitter(model, rt, first_block=blocks[start] if s > 0 else None,
                                      last_block=blocks[end - 1] if s < total - 1 else None)

    def _replicate(self, part: nn.Module, rt: Runtime, units: FSDPConfig) -> nn.Module:
        assert rt.mesh is not None
        dp_mesh = rt.mesh["dp"]
        if dp_mesh.size() == 1:
            return part
        if self.config.data == "fsdp":
            return apply_fsdp(part, dp_mesh, units, rt.precision.fsdp_policy())
        if self.tp.splits:  # DistributedDataParallel refuses DTensor parameters; FSDP2's replicate takes them
            return apply_replicate(part, dp_mesh)
        ddp = apply_ddp(part, dp_mesh, rt.device, DDPConfig())
        # The pipeline stage runs every forward under no_sync and prepares DDP's reducer itself before a batch's
        # last backward chunk. Its metadata inference, on the first batch, runs one more forward outside no_sync,
        # which left the reducer expecting the first chunk's gradients: they were synchronised early (the first
        # step rounded differently from later ones, so a resumed run was not bitwise equal) and recorded twice for
        # DDP's bucket rebuild (an internal assert on the second step when no forward came between, as in GPipe).
        # A DDP forward here therefore never prepares the reducer.
        ddp.require_backward_grad_sync = False
        return ddp

    def _place(self, part: nn.Module, rt: Runtime, units: FSDPConfig | None = None) -> nn.Module:
        keep_buffers_through_metadata_pass(part)
        part = self._replicate(to_device(part, rt.device), rt, units or FSDPConfig())
        if not (self.config.data == "fsdp" and rt.mesh is not None and rt.mesh["dp"].size() > 1):
            rt.precision.wrap_forward(part, rt.device)  # FSDP took the precision as its policy
        return part

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        """The optimizer over this rank's stages; under ``data="zero1"`` its states sharded over the data-parallel
        ranks holding the same stages (and, with tp, the same shards)."""
        optimizer = rebuild(optimizer, self._names[id(model)], model, subset=True)
        if not self._zero1(rt):
            return optimizer
        from ..distributed.zero import zero_redundancy  # imports DTensor: 1-2 s, when used

        assert rt.mesh is not None
        return zero_redundancy(optimizer.param_groups, optimizer, rt.mesh["dp"].get_group())

    def _zero1(self, rt: Runtime) -> bool:
        return self.config.data == "zero1" and rt.mesh is not None and rt.mesh["dp"].size() > 1

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()  # the stages already synchronise once per batch, after the last micro-batch

    def every_rank_reason(self) -> str | None:
        return f"under {self.name} each rank holds a stage of the model"

    def head_loss_refusal(self) -> str:
        return f"under {self.name} the last stage computes the loss inside the schedule"

    def forward_backward(self, model: nn.Module, call: ModelCall, scale: float) -> torch.Tensor:
        if not isinstance(model, PipelinedModel):
            raise ConfigError("pass the model that prepare() returned to forward_backward")
        return model.forward_backward(call, scale)

    def grad_norm_group(self, model: nn.Module) -> dist.ProcessGroup | None:
        return model.pp_group if isinstance(model, PipelinedModel) else None

    def sync_gradients(self, model: nn.Module) -> None:
        """Sum a tied weight's gradients over the stages that hold it (Megatron's embedding group): each stage saw
        only its own use of the weight. Under hybrid the stages' gradients are already the mean over ``dp``
        (the sum commutes with it) or that mean's shard (FSDP shards the two copies alike). With ``tp``, the
        partial gradients tensor parallelism leaves are summed first (see ``Strategy.sync_gradients``)."""
        super().sync_gradients(model)
        self.ep.sync_gradients(model)
        if not isinstance(model, PipelinedModel) or not model.tied:
            return
        params = dict(model.named_parameters())
        for group, name in model.tied:
            param = params[name]
            if param.grad is None:  # a stage that did not use it this step: its part is zero
                param.grad = torch.zeros_like(param)
            elif hasattr(param.grad, "placements") and param.grad.placements != param.placements:  # DTensor
                # tp: an embedding's gradient comes out replicated, the head's split like the weight; each rank
                # then adds the same slice
                param.grad = param.grad.redistribute(placements=param.placements)
            grad = param.grad
            dist.all_reduce(grad.to_local() if hasattr(grad, "to_local") else grad, group=group)

    def grad_norm_parameters(self, model: nn.Module) -> list[nn.Parameter]:
        if not isinstance(model, PipelinedModel):
            return list(model.parameters())
        return [p for n, p in model.named_parameters() if n not in model.uncounted]

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Keyed as one process keys it: a tied weight's state under the tensor's first name (the embedding's),
        also on the stage that holds it as the head, so checkpoints move between pipeline and other strategies
        (the two stages' identical copies are written once). Under ZeRO-1, this rank's partition of it."""
        if _sharded(optimizer):
            state = zero_optimizer_state(model, optimizer)
        else:
            state = super().optimizer_state(model, optimizer)
        return _renamed(state, getattr(model, "aliases", {}))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        state = _renamed(state, {v: k for k, v in getattr(model, "aliases", {}).items()})
        if _sharded(optimizer):
            load_zero_optimizer_state(model, optimizer, state)
        else:
            super().load_optimizer_state(model, optimizer, state)

    def full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        assert isinstance(model, PipelinedModel)
        local = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
                 for k, v in model.state_dict().items()}
        parts = stage_states(local, model, 0 if rank0_only else None)
        if not parts:
            return {}
        merged = {k: v for part in parts for k, v in part.items()}
        if model.key_order is not None:
            return OrderedDict((k, merged[k]) for k in model.key_order if k in merged)
        return OrderedDict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))

    def describe(self) -> str:
        return self._described(f"{self.name}(schedule={self.config.schedule}, "
                               f"microbatches={self.config.microbatches}")

    def _described(self, opening: str) -> str:
        """``opening`` (a name and its settings, the bracket open) with the tp and ep parts, closed."""
        return opening + "".join(f", {d}" for d in (self.tp.describe(), self.ep.describe()) if d) + ")"


def _sharded(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` is a ``ZeroRedundancyOptimizer`` (``data="zero1"``), told without importing
    ``torch.distributed.optim`` (1-2 s): an optimizer can only be one once that module is loaded."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    return zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer)


def _tie_groups(model: nn.Module, plan: StagePlan, rt: Runtime,
                mine: list[int]) -> tuple[list[tuple[dist.ProcessGroup, str]], set[str]]:
    """For each weight tied across stages, one process group per pipeline of the ranks holding it.

    Returns this rank's (group, parameter name) pairs and the names whose gradient another rank of the group
    counts in the global norm (the group's first rank counts it, so it is counted once). Every rank creates every
    group, in the same order, as ``new_group`` requires.
    """
    assert rt.mesh is not None
    pp_dim = rt.mesh.mesh_dim_names.index("pp")  # type: ignore[union-attr]
    grid = rt.mesh.mesh.movedim(pp_dim, -1).reshape(-1, rt.mesh["pp"].size()).tolist()  # [dp, tp][pp] -> rank
    pp = len(grid[0])
    me = dist.get_rank()
    tied: list[tuple[dist.ProcessGroup, str]] = []
    uncounted: set[str] = set()
    assert rt.facts is not None
    for names in rt.facts.ties.groups:
        by_stage: dict[int, str] = {}
        for name in names:
            stage = plan.stage_of(name)
            if stage is not None:
                by_stage.setdefault(stage, name)
        if len(by_stage) < 2:
            continue  # on one stage: still one tensor there
        holders = sorted({s % pp for s in by_stage})
        if len(holders) < len(by_stage):
            raise ConfigError(f"{', '.join(names)} are one tensor used by stages {sorted(by_stage)}, two of which "
                              "run on one rank; choose split points that put its users on different ranks")
        for row in grid:
            ranks = [row[h] for h in holders]
            group = dist.new_group(ranks)
            if me in ranks:
                name = next(n for s, n in by_stage.items() if s in mine)
                tied.append((group, name))
                if me != ranks[0]:
                    uncounted.add(name)
    return tied, uncounted


def _renamed(state: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """Flattened optimizer state (``state.<param>.<field>``, ``param_groups.<param>.<key>``) with parameter names
    mapped through ``names``."""
    if not names:
        return state
    out = {}
    for key, value in state.items():
        section, _, rest = key.partition(".")
        for old, new in names.items():
            if rest.startswith(old + "."):
                key = f"{section}.{new}{rest[len(old):]}"
                break
        out[key] = value
    return out


def _layer_order(key: str) -> tuple[int, str]:
    head = key.split(".", 1)[0]
    return (int(head), key) if head.isdigit() else (math.inf, key)  # type: ignore[return-value]


@register("pipeline", "pp")
class PurePipeline(PipelineStrategy):
    name = "pipeline"

    def __init__(self, config: PipelineConfig | None = None, **options: object) -> None:
        super().__init__(config, **options)
        if self.config.dp not in (None, 1):
            raise ConfigError("strategy 'pipeline' has no data-parallel dimension; use 'hybrid' with dp=…")


@register("hybrid")
class HybridPipeline(PipelineStrategy):
    """Data parallel (DDP or FSDP) x pipeline on a 2-D mesh."""

    name = "hybrid"

    def degrees(self, env: ClusterEnv) -> tuple[int, int]:
        tp = self.tp_degree(env)
        dp = self.config.dp if self.config.dp is not None else max(env.world_size // tp // 2, 1)
        if dp < 1 or env.world_size % (dp * tp):
            of = f" of tp={tp}" if tp > 1 else ""
            raise ConfigError(
                f"hybrid cannot split {env.world_size} processes into dp={dp} pipelines{of}; "
                f"choose dp dividing the number of processes{' / tp' if tp > 1 else ''} (e.g. -n {4 * tp} with dp=2)"
            )
        return dp, env.world_size // (dp * tp)

    def validate(self, env: ClusterEnv) -> None:
        dp, pp = self.degrees(env)
        if pp < 2 or dp < 2:
            tp = self.tp_degree(env)
            of = f" x tp={tp}" if tp > 1 else ""
            raise ConfigError(
                f"hybrid needs dp >= 2 and pp >= 2 (got dp={dp} x pp={pp}{of} from {env.world_size} processes); "
                f"launch {4 * tp} processes, or use 'pipeline' or 'ddp'"
            )

    def describe(self) -> str:
        return self._described(f"hybrid({self.config.data} x pipeline, schedule={self.config.schedule}")
