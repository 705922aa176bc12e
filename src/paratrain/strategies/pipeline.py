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

``hybrid`` adds a data-parallel dimension: ``dp`` x ``pp`` ranks, each pipeline's stages laid out across the ``dp``
dimension by the data engine of the preset ``data`` names (:mod:`.data_engines`, the one ``Parallel(data)`` runs
without stages), called on each stage as torchtitan calls one ``parallelize_fn`` on every model part: replicated with
DDP (``data="ddp"``), with their optimizer's states sharded over it by ``ZeroRedundancyOptimizer`` besides
(``data="zero1"``, ZeRO-1), or sharded with FSDP2 (``data="zero3"``, also spelled ``"fsdp"``).

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
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..batch import ModelCall
from ..composition import ZERO_BUBBLE, refusal, refuse_degree, schedule_refusal
from ..dims import ParallelDims
from ..distributed.optimizer import rebuild
from ..distributed.parallelize import Step, takes_meta
from ..distributed.pipeline import PipelinedModel, stage_states
from ..distributed.pipeline_metadata import keep_buffers_through_metadata_pass
from ..env import ClusterEnv
from ..errors import ConfigError
from ..model.cuts import cut_points
from ..model.materialize import to_device
from ..model.stages import StageModule, StagePlan, build_stage, plan_stages
from ..options import CPConfig, EPConfig, PipelineConfig, TPConfig, check_microbatches, rank_of_stage, stages_of
from .base import Runtime, Strategy, expert_parallel, tensor_parallel
from .data_engines import OneReplica, Shards, Units
from .presets import preset_named
from .registry import register


class PipelineStrategy(Strategy):
    """Shared by ``pipeline`` (pp = world) and ``hybrid`` (dp x pp)."""

    name = "pipeline"

    def __init__(self, config: PipelineConfig | None = None, **options: object) -> None:
        cp = CPConfig.pop(options)
        if cp is not None:
            raise ConfigError(refuse_degree(self.name, "cp", cp.degree))
        self.tp = tensor_parallel(TPConfig.pop(options))
        self.ep = expert_parallel(EPConfig.pop(options, self.name, takes_ep=True))  # refused below where not taken
        self.config = config if config is not None else PipelineConfig(**options)  # type: ignore[arg-type]
        tp = self.tp.config.degree if self.tp.splits else 1  # type: ignore[union-attr]
        refused = refusal(self.name, tp=tp, ep=self.ep.degree, data=self.config.data, schedule=self.config.schedule)
        if refused:
            raise ConfigError(refused)
        self.data = self._engine()
        self._names: dict[int, dict[int, str]] = {}

    def _engine(self) -> OneReplica:
        """What lays each stage out across the ``dp`` ranks: the engine of the preset ``config.data`` names.

        A zero-bubble schedule runs a stage's weight gradients apart from its input gradients, through
        ``torch.autograd.grad`` over the parameters the stage holds when its input gradients are computed. So its
        ``ddp`` replicates with FSDP2's ``replicate``, as beside tp (autograd.grad fires no
        ``DistributedDataParallel`` hook: each replica would keep its own gradients), whose reduction the schedule
        runs itself; and FSDP keeps each stage's parameters gathered from the first forward to the last backward
        (ZeRO-2 within a step), since a block re-sharded after its forward would be left out of its weight
        gradients."""
        preset = preset_named(self.config.data)
        options = dict(preset.defaults)
        zero_bubble = self.config.schedule in ZERO_BUBBLE
        if zero_bubble and preset.engine is Shards:
            options["reshard_after_forward"] = False
        return preset.engine(options, split=self.tp.splits or zero_bubble)

    def degrees(self, env: ClusterEnv) -> tuple[int, int]:
        """(dp, pp)."""
        return 1, env.world_size // self.tp_degree(env)

    def dims(self, env: ClusterEnv) -> ParallelDims:
        dp, pp = self.degrees(env)
        zero = self.data.zero if dp > 1 else 0
        data = {"dp_shard": dp, "zero": zero} if zero else {"dp_replicate": dp}
        return ParallelDims(**data, pp=pp, tp=self.tp_degree(env), ep=self.ep.degree)

    def validate(self, env: ClusterEnv) -> None:
        dp, pp = self.degrees(env)
        if pp < 2:
            tp = self.tp_degree(env)
            need = f"{2 * tp} processes with tp={tp}" if tp > 1 else "processes"
            raise ConfigError(f"{self.name} needs at least 2 pipeline stages ({need}); launch more with -n")
        self._check_microbatches(pp)

    def _check_microbatches(self, pp: int) -> None:
        """Before any process group: the micro-batches the schedule runs over ``pp`` ranks."""
        per_rank = self.config.stages_per_rank or 1
        check_microbatches(self.config.schedule, self.config.microbatches, pp, pp * per_rank)

    def rng_rank(self, rt: Runtime) -> int:
        """The replica's index: its stages (and tp ranks) share a stream, so a script's own draws (nanoGPT's
        ``get_batch``) give every stage one batch, the first stage its inputs and the last their targets."""
        return self.data_parallel(rt)[0]

    def data_parallel(self, rt: Runtime) -> tuple[int, int, dist.ProcessGroup | None]:
        assert rt.mesh is not None
        dp = rt.mesh["dp"]
        return dp.get_local_rank(), dp.size(), dp.get_group() if dp.size() > 1 else None

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        self.tp.check_stages(model, self.name)
        self.ep.check(model)
        if rt.precision.name == "fp16-mixed":
            raise ConfigError(f"{self.name} does not support fp16-mixed (loss scaling across stages); use bf16-mixed")
        refused = schedule_refusal(self.config.schedule, compiled=rt.transforms.compile is not None)
        if refused:
            raise ConfigError(refused)
        assert rt.mesh is not None
        pp_mesh = rt.mesh["pp"]
        pp, pp_rank = pp_mesh.size(), pp_mesh.get_local_rank()
        per_rank = self.config.stages_per_rank or 1
        total, schedule = pp * per_rank, self.config.schedule
        mine = stages_of(schedule, pp_rank, pp, per_rank)  # a loop, or a V for zbv and dualpipev
        if isinstance(model, nn.Sequential):
            out = self._wrap_sequential(model, rt, total, mine)
        else:
            out = self._wrap_blocks(model, rt, total, mine)
        out.num_stages, out.device = total, rt.device
        out.pp_group = pp_mesh.get_group()
        out.last_rank = dist.get_global_rank(out.pp_group, rank_of_stage(schedule, total - 1, pp))
        out.microbatches = self.config.microbatches
        out.eval_outputs = self.config.eval_outputs
        out.schedule_name = self.config.schedule
        out.precision = rt.precision
        out.split_loss = self.tp.split_loss
        return out

    def _wrap_sequential(self, model: nn.Sequential, rt: Runtime, total: int, mine: list[int]) -> PipelinedModel:
        if len(model) < total:
            raise ConfigError(
                f"{self.name} needs at least {total} layers for {total} stages; the model has {len(model)}"
            )
        names = list(model._modules)
        split = self.config.split
        if self.config.split_points is not None:
            unknown = [p for p in self.config.split_points if p not in names]
            if unknown:
                raise ConfigError(
                    f"pipeline split points {unknown} are not layers of this nn.Sequential; name "
                    f"layers such as {names[min(1, len(names) - 1)]!r}"
                )
            split = [names.index(p) for p in self.config.split_points]
        starts = cut_points(model, total, split)
        bounds = list(zip(starts, [*starts[1:], len(model)]))
        assert rt.facts is not None
        owned = [(names[i], model[i]) for s in mine for i in range(*bounds[s])]
        out = PipelinedModel(owned)
        out.parts = [
            (s, rt.parallelize(model[bounds[s][0] : bounds[s][1]], ep=self._experts(rt), data=self._stage_step(rt, ())))
            for s in mine
        ]
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
        apart = self.tp.splits or self.data_parallel(rt)[1] > 1  # a rank's stages get parameters of their own
        # before FSDP swaps the parameters
        out.tied, out.uncounted = _tie_groups(model, plan, rt, mine, self.config.schedule, apart)
        units = (plan.blocks.cls,)  # one sharding unit per block, never a bare container
        # Every stage's tensor-parallel plan is read off the whole model before any stage is split in place (an
        # inferred plan probes the model's first block, which an earlier stage of this rank may hold).
        splits = {s: self._stage_split(model, plan, s, total, rt) for s in mine}
        for s in mine:
            stage = StageModule(build_stage(model, plan, [s]), s, last=s == total - 1)
            stage.copy_views = self.config.schedule in ZERO_BUBBLE
            out.stage_modules[s] = stage
            out.parts.append(
                (s, rt.parallelize(stage, tp=splits[s], ep=self._experts(rt), data=self._stage_step(rt, units)))
            )
        self._names[id(out)] = names
        return out

    def _stage_step(self, rt: Runtime, units: Units) -> Step:
        """Place one stage and lay it out across its ``dp`` replicas with the data engine (``units``: the classes of
        its sharding units). An engine that shards takes the stage still on the meta device, so each rank then
        materializes only its shard of it (DDP needs real tensors: the stage is materialized first)."""
        assert rt.mesh is not None
        data = self.data.step(rt, rt.mesh["dp"], stage_units=units)

        def place(part: nn.Module) -> nn.Module:
            keep_buffers_through_metadata_pass(part)
            part = data(to_device(part, rt.device))
            rt.precision.wrap_forward(part, rt.device)
            return part

        return takes_meta(place) if getattr(data, "takes_meta", False) else place

    def _experts(self, rt: Runtime) -> Step | None:
        """The step that splits a stage's routed experts over its ``dp`` replicas (``ep=``; else None), in the
        layout the replicas' engine gives them: beside DDP, or sharded as FSDP shards the stage."""
        assert rt.mesh is not None
        return self.ep.step(rt.mesh["dp"], rt.device, self.data.zero, self.data.expert_shard_options(rt), stage=True)

    def _stage_split(self, model: nn.Module, plan: StagePlan, s: int, total: int, rt: Runtime) -> Step | None:
        """Tensor parallelism of stage ``s`` by the whole model's plan, its boundaries whole (None without tp)."""
        (start, end), blocks = plan.bounds[s], plan.blocks.names
        return self.tp.stage_splitter(
            model,
            rt,
            first_block=blocks[start] if s > 0 else None,
            last_block=blocks[end - 1] if s < total - 1 else None,
        )

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        """The optimizer over this rank's stages, as the data engine wraps it: under ``data="zero1"`` its states
        sharded over the data-parallel ranks holding the same stages (and, with tp, the same shards)."""
        return self.data.wrap_optimizer(rebuild(optimizer, self._names[id(model)], model, subset=True), model, rt)

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
        return _renamed(self.data.optimizer_state(model, optimizer), getattr(model, "aliases", {}))

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        state = _renamed(state, {v: k for k, v in getattr(model, "aliases", {}).items()})
        self.data.load_optimizer_state(model, optimizer, state)

    def full_state_dict(self, model: nn.Module, rank0_only: bool) -> dict[str, torch.Tensor]:
        assert isinstance(model, PipelinedModel)
        local = {
            k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().cpu()
            for k, v in model.state_dict().items()
        }
        parts = stage_states(local, model, 0 if rank0_only else None)
        if not parts:
            return {}
        merged = {k: v for part in parts for k, v in part.items()}
        if model.key_order is not None:
            return OrderedDict((k, merged[k]) for k in model.key_order if k in merged)
        return OrderedDict(sorted(merged.items(), key=lambda kv: _layer_order(kv[0])))

    def describe(self) -> str:
        return self._described(f"{self.name}(schedule={self.config.schedule}, microbatches={self.config.microbatches}")

    def _described(self, opening: str) -> str:
        """``opening`` (a name and its settings, the bracket open) with the tp and ep parts, closed."""
        return opening + "".join(f", {d}" for d in (self.tp.describe(), self.ep.describe()) if d) + ")"


def _tie_groups(
    model: nn.Module, plan: StagePlan, rt: Runtime, mine: list[int], schedule: str, apart: bool
) -> tuple[list[tuple[dist.ProcessGroup, str]], set[str]]:
    """For each weight tied across stages, one process group per pipeline of the ranks holding it.

    Stages of one rank that use it share the one tensor (a V's first and last stage: its gradient is their sum) unless
    ``apart``: tensor parallelism or a data engine lays out each stage on its own, giving each its own parameter.

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
        holders = sorted({rank_of_stage(schedule, s, pp) for s in by_stage})
        if len(holders) < len(by_stage) and apart:
            raise ConfigError(
                f"{', '.join(names)} are one tensor used by stages {sorted(by_stage)}, two of which run on one rank "
                f"and are laid out apart there (by tp or data-parallel replicas); choose split points or a "
                "schedule that put its users on different ranks (zbv and dualpipev hold the first and last stage on "
                "one), or untie them"
            )
        if len(holders) == 1:
            continue  # one tensor on one rank
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
                key = f"{section}.{new}{rest[len(old) :]}"
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

    def _engine(self) -> OneReplica:
        return OneReplica({}, split=False)  # one replica: nothing to lay a stage out across


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
        self._check_microbatches(pp)

    def describe(self) -> str:
        return self._described(f"hybrid({self.config.data} x pipeline, schedule={self.config.schedule}")
