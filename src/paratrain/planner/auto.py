"""``strategy="auto"``: the data-parallel strategy a job should use for a model, from the planner's memory model.

``Parallel`` decides when ``prepare`` first sees the model, before anything is wrapped. It knows the
parameters and the hardware, and the batch when ``prepare`` was given a loader with the model: for a model whose
shape the planner has in closed form (paratrain's GPT; transformers' llama, mistral, qwen2, qwen3, gpt2 and the
mixtures of experts mixtral, qwen2_moe and qwen3_moe) the activations of the loader's batch count too, else model
states alone decide (parameters, gradients, optimizer
state, buffers, overhead): DDP when they fit — its communication is the least and nothing about the speed of
the rest of the step is known here —, else the least sharding that fits (zero1, zero2, zero3). ``paratrain plan``
also weighs speed (a ZeRO stage can beat ddp by sharding the optimizer step). On a CPU host
``processes_vs_threads`` says what the processes cost over threads.
When even zero3 does not fit and the model has a built-in tensor-parallel plan (its shape read by
``strategies.tp_shape.model_shape``), zero3 over groups of tp ranks is weighed, least tp first: tp splits the
blocks FSDP gathers whole, and the activations; ``Parallel`` then lays the ranks out as (dp, tp). Otherwise the
choice stays on the one-dimensional data-parallel mesh. Speed is not weighed here (``paratrain plan`` does, with
the batch): a layout that fits without tp has less traffic inside every layer. A mixture of experts whose shape is
known may be given expert parallelism instead, before tp (``choose(..., ep=True)``: each of ep ranks holds 1/ep of
the experts). When the loader's activations, not the model states, are what does not fit (long sequences),
context parallelism is weighed before tp (``choose(..., cp=True)``: cp ranks each hold 1/cp of every sequence and
join the shard group), least cp first.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import nn

from ..composition import takes
from ..errors import ConfigError
from ..model.experts import find_expert_layers
from ..model.structure import forward_pieces
from ..sizes import GIB
from .context_parallel import cp_pairs
from .estimates import estimate
from .expert_parallel import ep_degrees
from .hardware import Cluster, make_cluster
from .hf_config import config_from_dict
from .layout import EP_STRATEGIES, Layout
from .model_stats import ModelStats, MoEShape, TPShape, pipeline_facts, trainable_sizes
from .optimizers import PlannedOptimizer, planned
from .tensor_parallel import tp_degrees
from .training import Training
from .transformer import GPTConfig, moe_block, transformer_params, transformer_stats

CANDIDATES = (("ddp", 0), ("zero1", 1), ("zero2", 2), ("zero3", 3))
MEMORY_MARGIN = 0.15
"""The planner's own memory error: its peak per GPU against ``torch.cuda.max_memory_allocated`` on an H100, 32 of
32 cases within 15% (benchmarks/RESULTS.md §7). Nothing fitting by less than this may still fit."""


@dataclass(frozen=True, kw_only=True)
class AutoChoice:
    strategy: str
    reason: str
    tp: int = 1
    """Tensor-parallel ranks per group (consecutive, within a node): 1 unless ``choose`` was given a TP shape."""
    ep: int = 1
    """Expert-parallel ranks (data-parallel ranks splitting the experts): 1 unless ``choose`` was let weigh ep."""
    cp: int = 1
    """Context-parallel ranks (splitting each sequence): 1 unless ``choose`` was let weigh cp and had to."""
    fits: bool = True
    """False when nothing fits by the planner (the choice is then zero3, which shards the most; ``settle`` refuses
    it unless the shortfall is within the planner's error)."""
    needed: float = 0.0
    """Bytes per rank of the least-memory layout tried, when nothing fits (``least``: which)."""
    capacity: float = 0.0
    """Bytes one rank may use."""
    least: str = ""
    planned: str = ""
    """What the estimate counted (model states; activations when the batch was planned)."""
    activations: bool = False
    """Whether the loader's activations were planned (then a smaller batch or checkpointing would help)."""

    def describe(self) -> str:
        split = [f"{name}={n}" for name, n in (("tp", self.tp), ("ep", self.ep), ("cp", self.cp)) if n > 1]
        return self.strategy + (f" with {' '.join(split)}" if split else "")


def parameter_stats(model: nn.Module) -> ModelStats:
    """Sizes only (no trace, no batch): enough to decide on model states."""
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    units = tuple((name, sum(p.numel() for p in m.parameters())) for name, m in forward_pieces(model)) or (
        ("model", params),
    )
    largest = max(
        ((n, sum(p.numel() for p in m.parameters(recurse=False))) for n, m in model.named_modules()), key=lambda x: x[1]
    )
    return ModelStats(
        name=type(model).__name__,
        params=params,
        units=units,
        largest_layer=largest,
        flops_per_sample=0.0,
        activation_bytes_per_sample=0.0,
        checkpointed_bytes_per_sample=0.0,
        boundary_bytes_per_sample=0.0,
        source="parameters only (strategy='auto')",
        tensors=trainable_sizes(model),
        **pipeline_facts(model),
    )


def expert_shape(model: nn.Module, units: tuple[tuple[str, int], ...], cfg: GPTConfig) -> MoEShape | None:
    """``cfg``'s experts as ``model`` holds them (None for a dense shape): per forward piece (``units``' order) the
    parameters of its routed-experts modules (:func:`paratrain.model.experts.find_expert_layers`: shared experts are
    dense layers, not among them)."""
    if cfg.moe is None:
        return None
    pieces = dict(forward_pieces(model))
    routed = tuple(
        sum(p.numel() for layer in find_expert_layers(pieces[name]) for p in layer.module.parameters())
        if name in pieces
        else 0
        for name, _ in units
    )
    return MoEShape(
        experts=cfg.moe.experts,
        top_k=cfg.moe.top_k,
        hidden=cfg.hidden,
        seq_len=cfg.seq_len,
        layers=sum(1 for i in range(cfg.layers) if moe_block(cfg, i)),
        unit_experts=routed,
        active=transformer_params(cfg)["active"],
    )


def closed_form_shape(model: nn.Module) -> GPTConfig | None:
    """The transformer shape of ``model`` when the planner has it in closed form: paratrain's GPT (its ``cfg``) or
    a transformers model whose ``config`` ``hf_config`` reads (llama, mistral, qwen2, qwen3, gpt2, mixtral, qwen2_moe,
    qwen3_moe), and only when that shape's parameter count is the model's; None for any other model (its
    activations are then not planned)."""
    cfg = getattr(model, "cfg", None)
    if not isinstance(cfg, GPTConfig):
        config = getattr(model, "config", None)
        to_dict = getattr(config, "to_dict", None)
        try:
            cfg = config_from_dict(to_dict(), type(model).__name__) if callable(to_dict) else None
        except ConfigError:
            return None
    if cfg is None:
        return None
    params = sum(p.numel() for p in model.parameters())
    return cfg if transformer_params(cfg)["total"] == params else None


def with_activations(stats: ModelStats, cfg: GPTConfig, seq_len: int | None) -> ModelStats:
    """``stats`` (sizes from the model itself) with the closed form's FLOPs and activations of ``cfg`` at
    ``seq_len`` tokens a sample (default the model's context): shorter than its context, or longer for a model
    without a position table (rotary embeddings take any length: a long-sequence loader's)."""
    if seq_len is not None and 1 <= seq_len and (seq_len < cfg.seq_len or not cfg.learned_positions):
        cfg = replace(cfg, seq_len=seq_len)
    closed = transformer_stats(cfg, name=stats.name)
    return replace(
        stats,
        flops_per_sample=closed.flops_per_sample,
        attention_flops_per_sample=closed.attention_flops_per_sample,
        activation_bytes_per_sample=closed.activation_bytes_per_sample,
        checkpointed_bytes_per_sample=closed.checkpointed_bytes_per_sample,
        boundary_bytes_per_sample=closed.boundary_bytes_per_sample,
        mixed=closed.mixed,
        matmul_params=closed.matmul_params,
        output_bytes_per_sample=closed.output_bytes_per_sample,
        largest_activation_bytes_per_sample=closed.largest_activation_bytes_per_sample,
        cp=closed.cp,
        source=f"{closed.source}, at the loader's batch",
    )


def local_cluster(device: torch.device, world_size: int, local_world_size: int) -> Cluster:
    """This job's hardware: the GPUs' real memory, or this host's RAM shared by its CPU processes."""
    nodes = max(world_size // max(local_world_size, 1), 1)
    if device.type == "cuda":
        memory = torch.cuda.get_device_properties(device).total_memory / GIB
        return make_cluster("h100", gpus=local_world_size, nodes=nodes, gpu_mem_gb=memory)
    return make_cluster("cpu", gpus=local_world_size, nodes=nodes)


def _training(precision: str, optimizer: PlannedOptimizer, batch: int = 1) -> Training:
    return Training(
        precision=precision if precision in ("fp32", "bf16-mixed", "fp16-mixed") else "fp32",
        optimizer=optimizer.key,
        micro_batch=batch,
    )


def _layout(name: str, n: int) -> Layout:
    zero = dict(CANDIDATES)[name]
    return Layout.of(name=name, dp=n, zero=zero, shard=n if zero else 1)


def choose(
    model: nn.Module,
    cluster: Cluster,
    precision: str,
    *,
    tp: TPShape | None = None,
    ep: bool = False,
    cp: bool = False,
    optimizer: torch.optim.Optimizer | None = None,
    batch: tuple[int, int | None] | None = None,
) -> AutoChoice:
    """The first of ddp, zero1, zero2, zero3 whose model states (and, given the batch, activations) fit one
    rank's memory.

    ``batch``: (samples a rank's loader gives per step, tokens a sample or None) from the loader ``prepare`` was
    given; with a model whose shape the planner has in closed form (``closed_form_shape``) the activations of that
    micro-batch are planned too, so no layout whose activations do not fit is chosen. Without it, or for another
    model, model states alone decide (the reason says so).

    ``optimizer``: the user's, whose states are planned (:mod:`.optimizers`); None assumes AdamW, and the reason
    says so.

    ``tp``: what the model's tensor-parallel plan splits, per forward piece (``model.structure.forward_pieces``' order).
    Given, and when even zero3 does not fit, zero3 over groups of tp ranks is tried, least tp first: it splits the
    largest unit FSDP gathers. None keeps every choice on the one-dimensional mesh (``Parallel`` passes the shape
    only once this call, without it, found nothing that fits: reading it imports tensor parallelism).

    ``ep``: weigh expert parallelism for a mixture of experts whose shape is known in closed form: when nothing
    fits on its own, ddp, zero2 and zero3 with ep ranks splitting the experts (least ep first, within a node; the
    presets that take ``ep=``), before tp (which does not split the experts).

    ``cp``: weigh context parallelism when the loader's activations were planned and are what does not fit: the
    least sharding's model states fit without them, but no layout fits with them. Then ddp, zero1, zero2 and
    zero3 over dp x cp ranks, cp ranks splitting each sequence (least cp first, within a node), before tp.
    """
    stats = replace(parameter_stats(model), tp=tp)
    shape = closed_form_shape(model) if batch is not None or ep else None
    planned_activations = shape is not None and batch is not None
    if shape is not None and batch is not None:
        stats = with_activations(stats, shape, batch[1])
    if shape is not None and ep:
        stats = replace(stats, moe=expert_shape(model, stats.units, shape))
    samples = batch[0] if batch is not None and planned_activations else 1
    n = cluster.world_size
    opt = planned(optimizer)
    training = _training(precision, opt, samples)
    what = (
        f"model states {opt.states}, activations of the loader's {samples} samples, buffers, runtime"
        if planned_activations
        else f"model states {opt.states}; buffers, runtime"
        + ("" if batch is None else "; activations not planned: the model's shape is not known in closed form")
    )
    tried = []
    least: tuple[float, str, float] = (float("inf"), "", 0.0)
    for name, _ in CANDIDATES:
        e = estimate(stats, _layout(name, n), training, cluster)
        tried.append(f"{name} {e.memory.total / GIB:.2f}")
        least = min(least, (e.memory.total, name, e.capacity))
        if e.fits:
            why = (
                f"{stats.params / 1e6:.1f}M parameters need {e.memory.total / GIB:.2f} GiB per rank under {name} "
                f"({what}), of {e.capacity / GIB:.1f} GiB"
            )
            if name != "ddp":
                why += f" (ddp would need {tried[0].split()[1]} GiB)"
            return AutoChoice(strategy=name, reason=why)
    if ep:
        found, least = _with_ep(stats, cluster, training, tried, least)
        if found is not None:
            return found
    if cp and planned_activations and _states_fit(stats, cluster, training):
        found, least = _with_cp(stats, cluster, training, tried, least)
        if found is not None:
            return found
    for t in tp_degrees(stats, cluster):
        e = estimate(stats, Layout.of(name="zero3", dp=n // t, zero=3, shard=n // t, tp=t), training, cluster)
        tried.append(f"zero3 tp={t} {e.memory.total / GIB:.2f}")
        least = min(least, (e.memory.total, f"zero3 with tp={t}", e.capacity))
        if e.fits:
            return AutoChoice(
                strategy="zero3",
                tp=t,
                reason=(
                    f"zero3 alone needs {tried[3].split()[1]} GiB per rank; tp={t} splits the units it gathers: "
                    f"{e.memory.total / GIB:.2f} GiB of {e.capacity / GIB:.2f}"
                ),
            )
    return AutoChoice(
        strategy="zero3",
        fits=False,
        reason=f"nothing fits by the planner ({', '.join(tried)} GiB per "
        "rank); zero3 shards the most — see `paratrain plan`",
        needed=least[0],
        least=least[1],
        capacity=least[2],
        planned=what,
        activations=planned_activations,
    )


def _with_ep(
    stats: ModelStats, cluster: Cluster, training: Training, tried: list[str], least: tuple[float, str, float]
) -> tuple[AutoChoice | None, tuple[float, str, float]]:
    """``choose``'s expert-parallel candidates, least ep first and, for each, the least sharding: the first that
    fits, or None; ``tried`` and ``least`` (bytes, layout, capacity) carried on."""
    n = cluster.world_size
    for e in (d for d in ep_degrees(stats, cluster) if n % d == 0):
        for name, zero in (c for c in CANDIDATES if c[0] in EP_STRATEGIES):
            est = estimate(
                stats, Layout.of(name=name, dp=n, zero=zero, shard=n if zero else 1, ep=e), training, cluster
            )
            tried.append(f"{name} ep={e} {est.memory.total / GIB:.2f}")
            least = min(least, (est.memory.total, f"{name} with ep={e}", est.capacity))
            if est.fits:
                return AutoChoice(
                    strategy=name,
                    ep=e,
                    reason=(
                        f"zero3 alone needs {tried[3].split()[1]} GiB per rank; ep={e} gives each rank 1/{e} of the "
                        f"experts: {name} needs {est.memory.total / GIB:.2f} GiB of {est.capacity / GIB:.2f}"
                    ),
                ), least
    return None, least


def _states_fit(stats: ModelStats, cluster: Cluster, training: Training) -> bool:
    """Whether zero3's model states (and buffers, runtime) fit without any activation: then the activations are
    what does not fit."""
    bare = replace(
        stats,
        activation_bytes_per_sample=0.0,
        checkpointed_bytes_per_sample=0.0,
        mixed={},
        output_bytes_per_sample=0.0,
        largest_activation_bytes_per_sample=0.0,
        matmul_params=0,
    )
    return estimate(bare, _layout("zero3", cluster.world_size), training, cluster).fits


def _with_cp(
    stats: ModelStats, cluster: Cluster, training: Training, tried: list[str], least: tuple[float, str, float]
) -> tuple[AutoChoice | None, tuple[float, str, float]]:
    """``choose``'s context-parallel candidates, least cp first and, for each, the least sharding (over dp x cp):
    the first that fits, or None; ``tried`` and ``least`` (bytes, layout, capacity) carried on."""
    n = cluster.world_size
    for c in (c for t, c in cp_pairs(stats, cluster, ()) if t == 1):
        for name, zero in (candidate for candidate in CANDIDATES if takes(candidate[0]).cp):
            est = estimate(
                stats, Layout.of(name=name, dp=n // c, zero=zero, shard=n // c if zero else 1, cp=c), training, cluster
            )
            tried.append(f"{name} cp={c} {est.memory.total / GIB:.2f}")
            least = min(least, (est.memory.total, f"{name} with cp={c}", est.capacity))
            if est.fits:
                return AutoChoice(
                    strategy=name,
                    cp=c,
                    reason=(
                        f"the model states fit but the loader's activations do not: zero3 alone needs "
                        f"{tried[3].split()[1]} GiB per rank; cp={c} gives each rank 1/{c} of every sequence: {name} "
                        f"needs {est.memory.total / GIB:.2f} GiB of {est.capacity / GIB:.2f}"
                    ),
                ), least
    return None, least


def settle(choice: AutoChoice, precision: str) -> AutoChoice:
    """``choice`` when it fits. When nothing does: a ``ConfigError`` (one line: the least memory needed per rank
    against what there is, and the fixes), unless the least is within ``MEMORY_MARGIN`` of what there is — the
    planner cannot tell that from fitting, so zero3 is kept and its reason says that it may not fit."""
    if choice.fits:
        return choice
    need, have = choice.needed / GIB, choice.capacity / GIB
    if choice.needed <= (1 + MEMORY_MARGIN) * choice.capacity:
        return replace(
            choice,
            reason=(
                f"nothing fits by the planner, but the least ({choice.least}, {need:.2f} GiB per rank of {have:.2f}) "
                f"is within its {MEMORY_MARGIN:.0%} memory error, so zero3 (it shards the most) is tried and may run "
                f"out of memory; {_fixes(choice, precision)} would make room"
            ),
        )
    raise ConfigError(
        f"strategy 'auto': nothing fits: the least memory needed is {need:.2f} GiB per rank "
        f"({choice.least}; {choice.planned}), {have:.2f} GiB available; use {_fixes(choice, precision)}"
    )


def _fixes(choice: AutoChoice, precision: str) -> str:
    fixes = ["more GPUs (ranks)"]
    if choice.activations:
        fixes += ["a smaller batch per rank", "activation_checkpointing=True"]
    if precision == "fp32":
        fixes.append("precision='bf16-mixed'")
    return ", ".join(fixes[:-1]) + " or " + fixes[-1] if len(fixes) > 1 else fixes[0]


def processes_vs_threads(
    model: nn.Module, cluster: Cluster, precision: str, strategy: str, optimizer: torch.optim.Optimizer | None = None
) -> str:
    """On a CPU host: what ``cluster.ranks_per_node`` processes add to a step over one process using every core
    as threads, by the planner's time model (the optimizer as in ``choose``; compute, which they split evenly,
    left out)."""
    stats = parameter_stats(model)
    opt = planned(optimizer)
    training = _training(precision, opt)
    one = estimate(stats, Layout.of(name="single"), training, cluster).time
    many = estimate(stats, _layout(strategy, cluster.world_size), training, cluster).time
    n, cores = cluster.ranks_per_node, cluster.device.cores or cluster.ranks_per_node
    shared = f"{n} processes on {cores} cores" + (" time-share them" if n > cores else " split them")
    return (
        f"{shared}, so together they compute no faster than one process with {cores} threads, and by the "
        f"planner each step takes {1e3 * (many.step_s - one.step_s):.1f} ms longer: "
        f"{1e3 * many.exposed_comm_s:.1f} ms of {strategy}'s gradient traffic over gloo, and every process runs "
        f"its optimizer step and streams all the weights at its share of the cores ({opt.step}: "
        f"{1e3 * many.optimizer_s:.1f} ms instead of {1e3 * one.optimizer_s:.1f}). More processes will be slower "
        f"here than threads: use them to test parallel code (`paratrain plan --gpu cpu --measure` estimates "
        f"whole steps)"
    )
