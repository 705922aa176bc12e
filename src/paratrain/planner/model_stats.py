"""What a plan needs to know about a model, found without running it at full size.

Three sources, one result (:class:`ModelStats`):

* ``transformer.transformer_stats``: closed forms for a decoder-only transformer (the named sizes, or
  ``--params 7.5B`` with a shape) — milliseconds, no module built.
* ``trace_module``: one forward and backward on the meta device under ``FlopCounterMode``, with a
  saved-tensors hook adding up what autograd keeps for backward — shapes only, no weights allocated. The forward is
  called as training calls it (:mod:`.inputs`: with targets, taking the model's own loss) and attention runs as the
  fused kernel does (:mod:`.attention`).
* ``measure_module``: the same on real tensors on this machine, plus the time of a forward and backward.

A :class:`RunnableModel` is a model the planner may build, to trace it, measure it or time it on a GPU; which
model a name builds is the caller's to say (``paratrain plan --model``'s names are the application's).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from ..errors import ConfigError
from ..model.stages import most_stages
from ..model.structure import forward_pieces
from .attention import FusedAttention, attention_flops
from .hardware import GIB, cpu_host
from .inputs import InputSpec, TrainingCall, forward_of, output_tensor

ELEMENT_BYTES = MappingProxyType({"fp32": (4, 4), "autocast": (4, 2), "param_dtype": (2, 2)})
"""(residual, compute) element sizes by how a model trains (``ModelStats.mixed``' modes): the residual stream and
norms, and the matrix products' inputs and outputs (``transformer.transformer_activations``' r and c)."""


@dataclass(frozen=True, kw_only=True)
class TPShape:
    """What a transformer's tensor-parallel plan splits: its shape and, per wrap unit, the parameters sharded."""

    layers: int
    hidden: int
    seq_len: int
    split: tuple[int, ...]
    """Parameters each wrap unit (``ModelStats.units``' order) shards over the tensor-parallel ranks; a weight two
    units share (a tied head) in the first only."""
    divides: tuple[tuple[str, int], ...]
    """Sizes every degree must divide, by name: the heads (query and key/value), the MLP width."""
    sequence_parallel: bool = True
    """The plan shards the activations between its split regions over the sequence (the built-in plans); False:
    they stay whole on every rank (an inferred plan, ``tp_plan="auto"``)."""
    splits_activations: bool = True
    """The plan splits attention and the MLP of every block, so the activations inside them are 1/tp; False: it
    leaves a part of the blocks whole, and their activations are counted whole (only the parameters split)."""
    largest: int | None = None
    """The largest degree the runtime splits the model this way (its plan inferred for larger ones differs or is
    refused); None: any degree the sizes divide."""

    def why_not(self, tp: int) -> str | None:
        """Why ``tp`` ranks cannot split this model, or None. A vocabulary that ``tp`` does not divide is split
        unevenly (DTensor's ``Shard``: the first ranks hold one row more), as the runtime does it
        (tests/distributed/test_tensor_parallel.py trains GPT-2 with an odd vocabulary)."""
        if self.largest is not None and tp > self.largest:
            return f"the plan the runtime infers splits it this way up to tp={self.largest} only"
        bad = [f"{name} {n}" for name, n in self.divides if n % tp]
        if not bad:
            return None
        return f"{' and '.join(bad)} {'does' if len(bad) == 1 else 'do'} not divide by tp={tp}"


@dataclass(frozen=True, kw_only=True)
class CPShape:
    """What context parallelism (Ulysses) splits and sends: every token's activations 1/cp, and around attention its
    queries, keys, values and output, which all-to-alls turn from a sequence split into a head split and back."""

    layers: int
    seq_len: int
    heads: int
    """Query heads: the cp ranks of a tp rank split its heads/tp."""
    kv_heads: int
    """Key/value heads, split as the query heads (Ulysses does not repeat them)."""
    head_dim: int

    def why_not(self, cp: int, tp: int = 1, past_heads: bool = False) -> str | None:
        """Why ``cp`` ranks (of ``tp``-rank groups) cannot split this model, or None: under Ulysses each rank of tp x
        cp takes whole query and key/value heads in attention, and an equal share of every sequence. ``past_heads``:
        heads that do not divide run the all-gather, whose ranks take two head-tail pieces of every sequence."""
        bad = [
            f"{name} {n}" for name, n in (("heads", self.heads), ("key/value heads", self.kv_heads)) if n % (tp * cp)
        ]
        heads = f"{' and '.join(bad)} {'does' if len(bad) == 1 else 'do'} not divide by tp x cp = {tp * cp}"
        if bad and not past_heads:
            return heads
        if bad and self.seq_len % (2 * cp):
            return f"sequence length {self.seq_len} does not divide by 2 x cp = {2 * cp} (the all-gather's: {heads})"
        if self.seq_len % cp:
            return f"sequence length {self.seq_len} does not divide by cp={cp}"
        return None


@dataclass(frozen=True, kw_only=True)
class MoEShape:
    """A mixture-of-experts model's routed experts, as expert parallelism splits and feeds them."""

    experts: int
    """Routed experts in each MoE block."""
    top_k: int
    """Experts each token goes through."""
    layers: int
    """MoE blocks: each dispatches every token to its experts' ranks and back."""
    hidden: int
    seq_len: int
    unit_experts: tuple[int, ...]
    """Routed experts' parameters in each wrap unit (``ModelStats.units``' order): what ``ep`` ranks divide."""
    active: int
    """Parameters one token's forward uses: all but the experts it skips."""
    whole: int = 0
    """Parameters of the MoE blocks' routers and shared experts (all of them): every token computes with them, and
    tensor parallelism does not split them either."""
    mlp_activations: Mapping[str, float] = field(default_factory=dict)
    """Per-sample bytes the MoE blocks' MLPs save for backward, besides their inputs (``moe.mlp_activations``), by
    mode (``fp32``, ``autocast``, ``param_dtype``): what every tensor-parallel rank keeps whole, as it runs each MoE
    block whole over the gathered sequence; empty when not known."""

    @property
    def expert_params(self) -> int:
        return sum(self.unit_experts)

    def why_not(self, ep: int) -> str | None:
        """Why ``ep`` ranks cannot split the experts (each rank holds whole experts), or None."""
        return None if self.experts % ep == 0 else f"{self.experts} experts do not divide by ep={ep}"


@dataclass(frozen=True, kw_only=True)
class TableStats:
    """An embedding the ``ps`` strategy would hold row-sharded on its servers (``model.tables.auto_tables``' rule)."""

    name: str
    rows: int
    dim: int
    lookups_per_sample: float = 0.0
    """Ids one sample looks up (a token sequence's length, an ``EmbeddingBag``'s ids per bag); 0 when not known."""

    @property
    def numel(self) -> int:
        return self.rows * self.dim


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    """Sizes, FLOPs and activation memory of one model, per training sample."""

    name: str
    params: int
    """Trainable parameters (shared weights counted once)."""
    units: tuple[tuple[str, int], ...]
    """The model's pieces in forward order, as (name, parameters) (:func:`paratrain.model.structure.forward_pieces`):
    what the planner takes FSDP to wrap one by one and a pipeline to split between stages."""
    largest_layer: tuple[str, int]
    """The module holding the most parameters directly (an embedding table, a big linear)."""
    flops_per_sample: float
    """Forward + backward FLOPs of one sample (matmuls and convolutions; elementwise work is not counted)."""
    attention_flops_per_sample: float = 0.0
    """Of ``flops_per_sample``: the attention scores and their weighted sum, forward and backward, counted over the
    whole s x s matrix (0 when not known). A causal kernel computes about half of them (it skips the masked
    blocks); selective recomputation repeats their forward third."""
    activation_bytes_per_sample: float
    """Bytes autograd keeps from forward to backward for one sample, training in fp32."""
    checkpointed_bytes_per_sample: float
    """The same with activation checkpointing of every wrap unit: each unit's input is kept, and one unit's
    activations at a time are rebuilt during backward (Korthikanti et al. 2022, section 5)."""
    boundary_bytes_per_sample: float
    """Bytes of the largest output of a unit other than the last, for one sample: what a pipeline or
    model-parallel stage passes on to the next."""
    cut_between_blocks: bool = False
    """The units are (embedding, blocks…, head) and a pipeline cuts only between the blocks, as the runtime's cutter
    does (:func:`paratrain.model.stages.plan_stages`): the embedding rides with the first stage, the head with the
    last."""
    pipeline_copy: int = 0
    """Parameters the last pipeline stage holds a second copy of: a head tied to the embedding (GPT-2's)."""
    mixed: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    """The three figures above (activations, checkpointed, boundary) under 16-bit training, by how it is done:
    ``autocast`` (fp32 parameters and residual stream, 16-bit matrix products: single, ddp, zero1, pipelines)
    and ``param_dtype`` (FSDP's mixed precision: everything 16-bit). Missing: half the fp32 figures."""
    op_checkpointed: Mapping[str, float] = field(default_factory=dict)
    """Per-sample activation bytes under per-operation selective AC (``recompute="op"``), by mode (``fp32``,
    ``autocast``, ``param_dtype``); empty when not known (the plan then keeps every activation)."""
    matmul_params: int = 0
    """Parameters autocast casts to 16-bit for its matrix products (weights of linear and convolution layers):
    their 16-bit copies are saved for backward."""
    output_bytes_per_sample: float = 0.0
    """Bytes of the model's output for one sample in fp32, as the loss reads it."""
    largest_activation_bytes_per_sample: float = 0.0
    """The largest single tensor autograd saves, for one sample, in fp32: backward holds a gradient of that size
    coming in and one going out while it is still saved."""
    unit_flops: tuple[float, ...] = ()
    """Forward + backward FLOPs of one sample per wrap unit, in ``units``' order (traced models: what
    ``FlopCounterMode`` charges each unit, backward included); empty when not known (closed forms), and a
    pipeline's stages are then taken to split the FLOPs evenly."""
    param_bytes: Mapping[str, int] = field(default_factory=dict)
    """Bytes of the parameters as built, by dtype."""
    tensors: tuple[int, ...] = ()
    """Sizes of the trainable parameter tensors (a tied one once): what ``ZeroRedundancyOptimizer`` hands out whole
    (``memory.zero1_busiest``); empty when not known (ZeRO-1 is then planned as the ZeRO paper's even split)."""
    source: str = ""
    """How the figures were found, for the report."""
    measured_step_s: float | None = None
    """Seconds of one forward + backward at ``measured_batch`` on this machine (``measure_module`` only)."""
    measured_batch: int | None = None
    measured_threads: int | None = None
    """The intra-op threads that forward + backward ran on."""
    tp: TPShape | None = None
    """What tensor parallelism splits (closed-form transformers); None: the model is not planned with tp."""
    cp: CPShape | None = None
    """What context parallelism splits (closed-form transformers); None: the model is not planned with cp."""
    moe: MoEShape | None = None
    """The routed experts (closed-form mixtures of experts); None: a dense model, planned without ``ep``."""
    refused: Mapping[str, str] = field(default_factory=dict)
    """Why the runtime would not split this model, by degree flag (``tp``, ``cp``): the plan leaves those rows out
    and says why (``RunnableModel.splits``)."""
    tables: tuple[TableStats, ...] = ()
    """The embeddings a parameter server holds row-sharded (``Parallel("ps")``'s ``tables="auto"``); their weights
    are counted in ``params`` and, one tensor each, in ``tensors``."""
    warnings: tuple[str, ...] = ()
    """What the figures may miss of training, one line each (a traced output that is not per token)."""
    pipeline_stages: int | None = None
    """The most stages paratrain's pipelines cut the model into (:func:`paratrain.model.stages.most_stages`; 0: they
    cannot cut it), when the model was built; None (closed forms): its units bound the stages."""
    pipeline_refusal: str = ""
    """Why pipelines cannot cut the model, when ``pipeline_stages`` is 0: the line ``prepare`` refuses it with."""

    def __post_init__(self) -> None:
        if self.params < 1:
            raise ConfigError(f"model {self.name!r} has no trainable parameters")
        if not self.units:
            raise ConfigError(f"model {self.name!r}: no units")
        if self.tp is not None and len(self.tp.split) != len(self.units):
            raise ConfigError(
                f"model {self.name!r}: {len(self.tp.split)} tensor-parallel splits for {len(self.units)} units"
            )
        if self.moe is not None and len(self.moe.unit_experts) != len(self.units):
            raise ConfigError(
                f"model {self.name!r}: {len(self.moe.unit_experts)} expert counts for {len(self.units)} units"
            )
        if self.unit_flops and len(self.unit_flops) != len(self.units):
            raise ConfigError(
                f"model {self.name!r}: {len(self.unit_flops)} unit FLOP counts for {len(self.units)} units"
            )
        if (
            min(
                self.flops_per_sample,
                self.activation_bytes_per_sample,
                self.checkpointed_bytes_per_sample,
                self.boundary_bytes_per_sample,
            )
            < 0
        ):
            raise ConfigError(f"model {self.name!r}: FLOPs and byte counts must be >= 0")

    @property
    def stage_bound(self) -> int:
        """The most pipeline stages the model is planned in."""
        return len(self.units) if self.pipeline_stages is None else self.pipeline_stages

    @property
    def largest_unit(self) -> tuple[str, int]:
        return max(self.units, key=lambda u: u[1])

    @property
    def dense_params(self) -> int:
        """Parameters that are not in a table: what a parameter server's workers pull and push whole."""
        return self.params - sum(t.numel for t in self.tables)

    @property
    def dense_tensors(self) -> tuple[int, ...]:
        """``tensors`` less one of each table's size: the dense tensors a parameter server spreads over its servers."""
        rest = list(self.tensors)
        for t in self.tables:
            if t.numel in rest:
                rest.remove(t.numel)
        return tuple(rest)


# --- tracing and measuring ----------------------------------------------------------------------------------


def _count(params: object) -> int:
    return sum(p.numel() for p in params if p.requires_grad)  # type: ignore[attr-defined]


def _stats(
    model: nn.Module,
    name: str,
    call: TrainingCall,
    device: str,
    batch: int,
    key: Callable[[torch.Tensor], object],
    source: str,
) -> ModelStats:
    """Stats from one forward + backward of ``model`` called as training calls it (``call``, ``batch`` samples made
    on ``device``).

    A saved-tensors hook records each tensor autograd keeps (once, by ``key``; parameters and buffers
    excluded) and which wrap unit was running; forward hooks record each unit's output size. Attention runs the
    fused kernel, as training does (:mod:`.attention`: on the meta device too). The loss is the
    model's own where it returns one (what it saves is traced); else it is taken to be a cross-entropy over the
    output, which saves its fp32 log-probabilities: one output-sized tensor more.
    """
    weights = {key(p) for p in model.parameters()} | {key(b) for b in model.buffers()}
    saved: dict[object, tuple[int, str]] = {}
    running = ["(root)"]

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = key(t)
        if k not in weights and k not in saved:
            saved[k] = (t.untyped_storage().nbytes(), running[0])
        return t

    def enter(unit: str) -> Callable[..., None]:
        return lambda *_: running.__setitem__(0, unit)

    def leave(_m: nn.Module, _i: object, out: object) -> None:
        outputs.append(_tensor_bytes(out))
        running[0] = "(root)"

    units = forward_pieces(model)
    outputs: list[int] = []
    hooks = [h for n, m in units for h in (m.register_forward_pre_hook(enter(n)), m.register_forward_hook(leave))]
    from ..model.tables import auto_tables

    table_names = auto_tables(model, meta_built=False)
    lookups: Counter[str] = Counter()

    def looked_up(name: str) -> Callable[..., None]:
        return lambda _m, args: lookups.update({name: args[0].numel()})

    hooks += [model.get_submodule(n).register_forward_pre_hook(looked_up(n)) for n in table_names]
    try:
        with (
            FlopCounterMode(display=False, custom_mapping=attention_flops(call.document_tokens)) as counter,
            FusedAttention(),
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        ):
            x, forward = call.run(model, batch, device)
            forward.loss.backward()
    finally:
        for h in hooks:
            h.remove()
    out = forward.output
    per_unit: Counter[str] = Counter()
    for nbytes, unit in saved.values():
        per_unit[unit] += nbytes
    outside = per_unit.pop("(root)", 0) + (0 if forward.own_loss else 4 * out.numel())
    # Checkpointing every unit keeps each unit's input and, during one unit's recompute, its activations.
    checkpointed = x.numel() * x.element_size() + sum(outputs[:-1]) + outside + max(per_unit.values(), default=0)
    return ModelStats(
        name=name,
        **_parameter_facts(model, units, counter, batch),
        activation_bytes_per_sample=sum(per_unit.values(), outside) / batch,
        checkpointed_bytes_per_sample=min(checkpointed, sum(per_unit.values(), outside)) / batch,
        boundary_bytes_per_sample=max(outputs[:-1] or outputs or [0]) / batch,
        output_bytes_per_sample=4 * out.numel() / batch,
        largest_activation_bytes_per_sample=max((n for n, _ in saved.values()), default=0) / batch,
        source=source,
        tables=_tables(model, table_names, lookups, batch),
        warnings=tuple(w for w in (forward.warning(x, name),) if w is not None),
    )


def _parameter_facts(
    model: nn.Module, units: list[tuple[str, nn.Module]], counter: FlopCounterMode, batch: int
) -> dict[str, Any]:
    """``ModelStats``' fields that the parameters and the FLOP count give: the units with their sizes and FLOPs
    (a root holding parameters of its own as a unit first), the largest layer, bytes by dtype, the weights autocast
    casts."""
    sizes = [(n, _count(m.parameters())) for n, m in units]
    by_module = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
    unit_flops = [by_module.get(f"{type(model).__name__}.{n}", 0) / batch for n, _ in units]
    direct = _count(model.parameters(recurse=False))
    if direct or not sizes:
        sizes.insert(0, ("(root)", direct))
        unit_flops.insert(0, max(0.0, counter.get_total_flops() / batch - sum(unit_flops)))
    by_dtype: Counter[str] = Counter()
    for p in model.parameters():
        by_dtype[str(p.dtype).removeprefix("torch.")] += p.numel() * p.element_size()
    layers = [(n or "(root)", _count(m.parameters(recurse=False))) for n, m in model.named_modules()]
    matmul = {
        id(m.weight): m.weight.numel()
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.weight.requires_grad
    }
    return dict(
        params=_count(model.parameters()),
        units=tuple(sizes),
        largest_layer=max(layers, key=lambda x: x[1]),
        flops_per_sample=counter.get_total_flops() / batch,
        unit_flops=tuple(unit_flops),
        matmul_params=sum(matmul.values()),
        param_bytes=dict(by_dtype),
        tensors=trainable_sizes(model),
        **pipeline_facts(model),
    )


def pipeline_facts(model: nn.Module) -> dict[str, Any]:
    """``ModelStats``' pipeline fields, from the runtime's own cutter."""
    stages, refusal = most_stages(model)
    return dict(pipeline_stages=stages, pipeline_refusal=refusal or "")


def _tables(model: nn.Module, names: list[str], lookups: Counter[str], batch: int) -> tuple[TableStats, ...]:
    """The trainable tables among ``names``, with the ids each sample looked them up by."""
    weights = [(n, model.get_submodule(n).weight) for n in names]
    return tuple(
        TableStats(name=n, rows=w.shape[0], dim=w.shape[1], lookups_per_sample=lookups[n] / batch)
        for n, w in weights
        if w.requires_grad
    )


def trainable_sizes(model: nn.Module) -> tuple[int, ...]:
    """Sizes of ``model``'s trainable parameter tensors, a shared one once (``ModelStats.tensors``)."""
    return tuple(p.numel() for p in model.parameters() if p.requires_grad)


def _tensor_bytes(out: object) -> int:
    try:
        t = output_tensor(out)
    except ConfigError:
        return 0
    return t.numel() * t.element_size()


def trace_module(
    factory: Callable[[], nn.Module], example: InputSpec | TrainingCall, *, name: str, batch: int = 2
) -> ModelStats:
    """Stats from one forward and backward of ``factory()`` built on the meta device, called as training calls it
    (``example``: the input, or how to call the model, ``TrainingCall``): no weight is allocated.

    Activation bytes are the storages autograd saves for backward (views counted once, through their base),
    excluding parameters and buffers. ``batch`` is 2 so that batch-statistics layers see more than one
    sample; figures are divided back to one sample.

    A forward that reads tensor values (a router's counts per expert turned into split sizes, ``.item()``,
    ``nonzero``) cannot run on the meta device, which holds none: such a model is traced on this CPU instead when
    it fits here (:func:`_host_trace`). Any other failure of the model's own code is one line, as is a model too
    large for the host.
    """
    model = _built(factory, name, device="meta")
    call = TrainingCall.of(example)
    try:
        return _stats(
            model,
            name,
            call,
            "meta",
            batch,
            key=lambda t: id(t._base if t._base is not None else t),  # meta tensors have no address
            source="traced on the meta device (FlopCounterMode + saved tensors)",
        )
    except ConfigError:
        raise
    except Exception as err:  # the model's own code: its error as one line (--debug shows the traceback)
        if not _needs_values(err):
            raise _forward_failed(name, err) from err
        return _host_trace(factory, call, name=name, batch=batch, why=_one_line(err))


def _needs_values(err: Exception) -> bool:
    """Whether ``err`` is the meta device's: an op that needs tensor values, or that has no meta kernel."""
    return isinstance(err, NotImplementedError) or "meta" in str(err).lower()


def _one_line(err: Exception) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _forward_failed(name: str, err: Exception) -> ConfigError:
    return ConfigError(f"tracing {name!r} failed in its forward ({_one_line(err)}); check --input and --targets")


def _host_trace(factory: Callable[[], nn.Module], call: TrainingCall, *, name: str, batch: int, why: str) -> ModelStats:
    """``trace_module`` on real tensors on this CPU, for a model whose forward the meta device cannot run (``why``).
    What the figures miss: attention whose value heads differ from its query heads runs torch's unfused CPU path,
    which saves the s x s scores a GPU's kernel does not."""
    try:
        return _host_stats(
            factory,
            call,
            name=name,
            batch=batch,
            why=f"its forward cannot run on the meta device ({why}) and tracing it on this CPU",
            instead="plan its shape instead (--model-config or --params)",
            source=f"traced on this CPU: its forward cannot run on the meta device ({why})",
        )[1]
    except ConfigError:
        raise
    except Exception as err:
        raise _forward_failed(name, err) from err


def _host_stats(
    factory: Callable[[], nn.Module],
    call: TrainingCall,
    *,
    name: str,
    batch: int,
    why: str,
    instead: str,
    source: str,
) -> tuple[nn.Module, ModelStats]:
    """The model built for real on this CPU, once it is known to fit (``why``/``instead``: the refusal's words), and
    its stats from a real forward and backward (activation bytes: the unique storages autograd saves, by address)."""
    check_fits_host(factory, name, why=why, instead=instead)
    model = _built(factory, name, device=None)
    return model, _stats(model, name, call, "cpu", batch, key=lambda t: t.untyped_storage().data_ptr(), source=source)


def _built(factory: Callable[[], nn.Module], name: str, device: str | None) -> nn.Module:
    """``factory()`` on ``device`` (None: where the factory puts it), checked to be a module."""
    if device is None:
        model = factory()
    else:
        with torch.device(device):
            model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the factory for {name!r} returned {type(model).__name__}, not an nn.Module")
    return model if device is None else model.to(device)  # in case the factory put some tensors elsewhere


def check_fits_host(factory: Callable[[], nn.Module], name: str, *, why: str, instead: str) -> None:
    """Refuse to build ``factory()`` for real unless its weights, gradients and Adam states (16 bytes a parameter,
    counted on the meta device) fit in half this host's RAM."""
    with torch.device("meta"):
        size = _count(factory().parameters()) * 16
    ram = cpu_host().memory_gib * GIB
    if size > ram / 2:
        raise ConfigError(
            f"{name!r}: {why} needs ~{size / GIB:.1f} GiB for weights, gradients and optimizer states, more than "
            f"half this host's {ram / GIB:.1f} GiB; {instead}"
        )


def measure_module(
    factory: Callable[[], nn.Module], example: InputSpec | TrainingCall, *, name: str, batch: int, steps: int = 3
) -> ModelStats:
    """Stats from a real forward and backward on this machine's CPU, and the median time of ``steps`` more.

    Activation bytes are the unique storages autograd saves (by address). The model is first built on the
    meta device to check that its weights, gradients and Adam states fit in half the host's RAM.
    """
    call = TrainingCall.of(example)
    model, stats = _host_stats(
        factory,
        call,
        name=name,
        batch=batch,
        why="measuring it for real",
        instead="plan it without --measure",
        source="measured on this machine",
    )
    x, targets = call.inputs(model, batch, "cpu")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        forward_of(model(x, **targets)).loss.backward()
        times.append(time.perf_counter() - start)
    return replace(
        stats,
        measured_step_s=sorted(times)[len(times) // 2],
        measured_batch=batch,
        measured_threads=torch.get_num_threads(),
    )


@dataclass(frozen=True, kw_only=True)
class RunnableModel:
    """A model the planner may build: traced for its stats, run on this CPU (``--measure`` on a CPU host) or timed
    on this machine's GPU (``--measure`` on a GPU)."""

    name: str
    factory: Callable[[], nn.Module]
    call: TrainingCall
    """How training calls it: one sample's input, and its targets."""
    stats: ModelStats | None = None
    """Its closed-form stats, when its shape is known (a transformer): exact, and found without building it."""
    splits: Callable[[ModelStats, int | None, int | None], ModelStats] | None = None
    """``splits(stats, tp, cp)``: ``stats`` with what the runtime's tensor and context parallelism would split of
    this model at the degrees asked (None: the planner's search), or why they would refuse it
    (``ModelStats.refused``). Given by the caller, which may ask the runtime; None: planned without them, unless
    the closed forms know its shape."""

    def find_stats(self, measure_batch: int | None = None, tp: int | None = None, cp: int | None = None) -> ModelStats:
        """Measured on this CPU at ``measure_batch`` samples; else the closed-form stats, or a meta-device trace;
        with what tp and cp split of it (``splits``) where the closed forms do not say."""
        if measure_batch is not None:
            stats = measure_module(self.factory, self.call, name=self.name, batch=measure_batch)
        elif self.stats is not None:
            return self.stats
        else:
            stats = trace_module(self.factory, self.call, name=self.name)
        return stats if self.splits is None else self.splits(stats, tp, cp)
