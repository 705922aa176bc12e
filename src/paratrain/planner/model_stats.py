"""What a plan needs to know about a model, found without running it at full size.

Three sources, one result (:class:`ModelStats`):

* ``transformer_stats``: closed forms for a decoder-only transformer (the built-in GPT sizes, or
  ``--params 7.5B`` with a shape) — milliseconds, no module built.
* ``trace_module``: one forward and backward on the meta device under ``FlopCounterMode``, with a
  saved-tensors hook adding up what autograd keeps for backward — shapes only, no weights allocated.
* ``measure_module``: the same on real tensors on this machine, plus the time of a forward and backward.
"""
from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from ..errors import ConfigError
from ..workloads.gpt import GPTConfig
from .tensor_parallel import ELEMENT_BYTES, TPShape


@dataclass(frozen=True, kw_only=True)
class ModelStats:
    """Sizes, FLOPs and activation memory of one model, per training sample."""

    name: str
    params: int
    """Trainable parameters (shared weights counted once)."""
    units: tuple[tuple[str, int], ...]
    """The model's wrap units in order, as (name, parameters): what FSDP wraps one by one and a pipeline
    splits between stages (the root's direct children, with ModuleList/ModuleDict items taken one by one)."""
    largest_layer: tuple[str, int]
    """The module holding the most parameters directly (an embedding table, a big linear)."""
    flops_per_sample: float
    """Forward + backward FLOPs of one sample (matmuls and convolutions; elementwise work is not counted)."""
    activation_bytes_per_sample: float
    """Bytes autograd keeps from forward to backward for one sample, training in fp32."""
    checkpointed_bytes_per_sample: float
    """The same with activation checkpointing of every wrap unit: each unit's input is kept, and one unit's
    activations at a time are rebuilt during backward (Korthikanti et al. 2022, section 5)."""
    boundary_bytes_per_sample: float
    """Bytes of the largest output of a unit other than the last, for one sample: what a pipeline or
    model-parallel stage passes on to the next."""
    mixed: Mapping[str, tuple[float, float, float]] = field(default_factory=dict)
    """The three figures above (activations, checkpointed, boundary) under 16-bit training, by how it is done:
    ``autocast`` (fp32 parameters and residual stream, 16-bit matrix products: single, ddp, zero1, pipelines)
    and ``param_dtype`` (FSDP's mixed precision: everything 16-bit). Missing: half the fp32 figures."""
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
    source: str = ""
    """How the figures were found, for the report."""
    measured_step_s: float | None = None
    """Seconds of one forward + backward at ``measured_batch`` on this machine (``measure_module`` only)."""
    measured_batch: int | None = None
    measured_threads: int | None = None
    """The intra-op threads that forward + backward ran on."""
    tp: TPShape | None = None
    """What tensor parallelism splits (closed-form transformers); None: the model is not planned with tp."""

    def __post_init__(self) -> None:
        if self.params < 1:
            raise ConfigError(f"model {self.name!r} has no trainable parameters")
        if not self.units:
            raise ConfigError(f"model {self.name!r}: no units")
        if self.tp is not None and len(self.tp.split) != len(self.units):
            raise ConfigError(f"model {self.name!r}: {len(self.tp.split)} tensor-parallel splits for "
                              f"{len(self.units)} units")
        if self.unit_flops and len(self.unit_flops) != len(self.units):
            raise ConfigError(f"model {self.name!r}: {len(self.unit_flops)} unit FLOP counts for "
                              f"{len(self.units)} units")
        if min(self.flops_per_sample, self.activation_bytes_per_sample, self.checkpointed_bytes_per_sample,
               self.boundary_bytes_per_sample) < 0:
            raise ConfigError(f"model {self.name!r}: FLOPs and byte counts must be >= 0")

    @property
    def largest_unit(self) -> tuple[str, int]:
        return max(self.units, key=lambda u: u[1])


# --- closed forms -----------------------------------------------------------------------------------------

def transformer_params(cfg: GPTConfig) -> dict[str, int]:
    """Exact parameter counts of ``workloads.gpt.GPT(cfg)`` by part: embedding, one block, head (final norm
    and, when untied, the output matrix), and what tensor parallelism splits of a block (all but its norms and
    the row-parallel layers' biases, which are added after the reduction)."""
    h, f, v = cfg.hidden, cfg.ffn_width, cfg.vocab
    b = int(cfg.bias)
    norm = 2 * h if cfg.bias else h
    fc = 2 * f if cfg.gated else f
    block = 2 * norm + (3 * h * h + 3 * h * b) + (h * h + h * b) + (h * fc + fc * b) + (f * h + h * b)
    embedding = v * h + (cfg.seq_len * h if cfg.learned_positions else 0)
    head = norm + (0 if cfg.tied else v * h)
    return {"embedding": embedding, "block": block, "head": head, "total": embedding + cfg.layers * block + head,
            "block_split": block - 2 * norm - 2 * h * b}


def transformer_activations(cfg: GPTConfig, *, residual: int, act: int) -> tuple[float, float]:
    """Bytes autograd saves per sample for ``workloads.gpt.GPT(cfg)``: (one block, everything outside the blocks).

    ``residual`` is the element size of the residual stream and the norms, ``act`` that of the matrix products'
    inputs and outputs: 4 and 4 in fp32, 4 and 2 under autocast, 2 and 2 with FSDP's 16-bit parameters.
    Counted from what each operation saves, and equal to ``saved_tensors_hooks``' count on the real module
    (tests/test_planner_stats.py). A block (s tokens, width h, MLP width f, a heads) keeps its input x, the input
    and output of the QKV projection, the attention output (the projection reads it in place) and a log-sum-exp of
    a·s fp32 values (``scaled_dot_product_attention``'s fused kernels store no s x s scores), the residual after
    attention, the MLP's input, its inner activation and its activation function's output (SwiGLU: gate and up,
    the SiLU output and the product); LayerNorm two fp32 statistics per token, RMSNorm its normalised input and one
    per token. Outside the blocks: the final norm's input, the head's input, log-softmax's fp32 output for the
    loss (4·V per token), the token ids and the targets.
    """
    s, h, a, f, v = cfg.seq_len, cfg.hidden, cfg.heads, cfg.ffn_width, cfg.vocab
    norm = 8 * s if cfg.bias else residual * s * h + residual * s  # LayerNorm: mean, rstd; RMSNorm: x·r and r
    mlp = act * s * f * (4 if cfg.gated else 2)
    block = (residual * s * h + norm + act * s * h + 3 * act * s * h + act * s * h + 4 * a * s
             + residual * s * h + norm + act * s * h + mlp)
    outside = residual * s * h + norm + act * s * h + 4 * s * v + 16 * s
    return float(block), float(outside)


def transformer_stats(cfg: GPTConfig, *, name: str, params: int | None = None) -> ModelStats:
    """Stats of a decoder-only transformer from its shape alone.

    FLOPs per sample (s tokens): ``6·N·s + 12·L·h·s²`` — 6 FLOPs per matmul weight per token for forward and
    backward (Kaplan et al. 2020) plus the attention scores and weighted sum (PaLM, Chowdhery et al. 2022,
    appendix B); N leaves out embedding lookups, which do no matmul. Within 1% of ``FlopCounterMode``.

    Activations: ``transformer_activations`` for fp32, autocast and 16-bit parameters. For GPT-2 shapes a block
    keeps 64·s·h bytes in fp32 and 36·s·h under autocast, where Korthikanti et al. (2022, eq. 1) count
    ``s·h·(34 + 5·a·s/h)`` for 16-bit training that stores the attention scores. With every block
    checkpointed: each block's input plus one block's activations during its recompute (same paper, section 5).

    ``params`` replaces the exact count (``--params 7.5B``); the blocks then share what the embedding and head
    leave.
    """
    counts = transformer_params(cfg)
    h, s, n_layers, v = cfg.hidden, cfg.seq_len, cfg.layers, cfg.vocab
    total = counts["total"] if params is None else params
    block = counts["block"]
    if params is not None:
        block = (params - counts["embedding"] - counts["head"]) // n_layers
        if block < 1:
            raise ConfigError(f"--params {params:,} leaves nothing for {n_layers} layers after the "
                              f"{counts['embedding'] + counts['head']:,}-parameter embedding and head; "
                              "lower --vocab/--hidden or raise --params")
    non_matmul = (s * h if cfg.learned_positions else 0) + (0 if cfg.tied else v * h)
    flops = 6 * (total - non_matmul) * s + 12 * n_layers * h * s * s
    fc = (2 if cfg.gated else 1) * cfg.ffn_width
    layers = [("wte", v * h), ("blocks.0.qkv", 3 * h * h + 3 * h * cfg.bias),
              ("blocks.0.fc", h * fc + fc * cfg.bias)]
    if not cfg.tied:
        layers.append(("head", v * h))
    units = (("embedding", counts["embedding"]), *((f"blocks.{i}", block) for i in range(n_layers)),
             ("head", counts["head"]))
    shape = (f"{n_layers} layers, hidden {h}, {cfg.heads} heads, seq {s}, vocab {v}"
             + (", SwiGLU" if cfg.gated else ""))

    def figures(residual: int, act: int) -> tuple[float, float, float]:
        per_block, outside = transformer_activations(cfg, residual=residual, act=act)
        return (n_layers * per_block + outside, n_layers * residual * s * h + per_block + outside,
                float(residual * s * h))

    fp32 = figures(*ELEMENT_BYTES["fp32"])
    block_split = counts["block_split"] * block // counts["block"]
    tp = TPShape(layers=n_layers, hidden=h, seq_len=s, divides=(("heads", cfg.heads), ("MLP width", cfg.ffn_width)),
                 split=(v * h, *(block_split,) * n_layers, 0 if cfg.tied else v * h))
    matmul = n_layers * (4 * h * h + h * (fc + cfg.ffn_width)) + v * h  # the head's (possibly tied) weight
    return ModelStats(name=name, params=total, units=units, largest_layer=max(layers, key=lambda x: x[1]),
                      flops_per_sample=float(flops), activation_bytes_per_sample=fp32[0],
                      checkpointed_bytes_per_sample=fp32[1], boundary_bytes_per_sample=fp32[2],
                      mixed={mode: figures(*ELEMENT_BYTES[mode]) for mode in ("autocast", "param_dtype")},
                      matmul_params=matmul, tp=tp,
                      output_bytes_per_sample=4.0 * s * v, largest_activation_bytes_per_sample=4.0 * s * fc,
                      param_bytes={"float32": 4 * total},
                      source=f"closed-form transformer ({shape})")


def transformer_shape(params: float, *, layers: int | None = None, hidden: int | None = None,
                      heads: int | None = None, seq_len: int = 2048, vocab: int = 50257) -> GPTConfig:
    """A plausible GPT shape for ``params`` parameters when only some figures are known.

    Uses N ≈ 12·L·h² (a block's four h×h-equivalent matrices and its 4h MLP) for the missing one, and when
    both are missing the aspect ratio h ≈ 128·L of GPT-3's family, with h a multiple of 128 and 128-wide heads.
    """
    if params <= 0:
        raise ConfigError(f"--params must be > 0, got {params:g}")
    if hidden is None and layers is None:
        layers = max(1, round((params / (12 * 128**2)) ** (1 / 3)))
    if hidden is None:
        hidden = max(128, 128 * round((params / (12 * layers)) ** 0.5 / 128))
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    if heads is None:
        heads = max(1, hidden // 128) if hidden % 128 == 0 else 1
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=seq_len, vocab=vocab)


# --- tracing and measuring ----------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class InputSpec:
    """One sample's input: its shape and dtype (token ids are ``long``)."""

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    high: int | None = None
    """Token ids are drawn below this (a vocabulary's size); None: all zero. Timing wants real ids: the
    embedding's backward on one repeated id serialises on that row."""

    def __post_init__(self) -> None:
        if not self.shape or min(self.shape) < 1:
            raise ConfigError(f"input shape must be non-empty with sizes >= 1, got {self.shape}")

    @classmethod
    def parse(cls, text: str) -> InputSpec:
        """``3x224x224`` (float32), ``long:1024`` (token ids) or ``float16:8x8``."""
        dtype_name, _, dims = text.rpartition(":")
        dtype = getattr(torch, dtype_name or "float32", None)
        if not isinstance(dtype, torch.dtype):
            raise ConfigError(f"unknown input dtype {dtype_name!r} in {text!r}; use e.g. float32 or long")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
        except ValueError:
            raise ConfigError(f"bad input shape {text!r}; write one sample's shape like 3x224x224 or long:1024") from None
        return cls(shape=shape, dtype=dtype)

    def make(self, batch: int, device: str | torch.device) -> torch.Tensor:
        if self.dtype.is_floating_point:
            return torch.randn(batch, *self.shape, dtype=self.dtype, device=device)
        if self.high is None:
            return torch.zeros(batch, *self.shape, dtype=self.dtype, device=device)
        return torch.randint(0, self.high, (batch, *self.shape), dtype=self.dtype, device=device)


def wrap_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's units in forward order, as FSDP shards it and a pipeline cuts it: for a model with repeated
    blocks (:func:`paratrain.model.find_blocks`), the modules before the blocks, the blocks, and the modules after
    them; otherwise the root's direct children, with ModuleList/ModuleDict items taken one by one (they have no
    forward)."""
    from ..model.structure import find_blocks, outer_modules

    blocks = find_blocks(model)
    if blocks is not None:  # the blocks' container holds them and, in an nn.Sequential, the pieces around them
        before, after = outer_modules(model, blocks)
        prefix = f"{blocks.container}." if blocks.container else ""
        container = model.get_submodule(blocks.container) if blocks.container else model
        inner = [(prefix + k, c) for k, c in container.named_children()]
        after = sorted(after, key=lambda n: -n.count("."))  # the final norm inside runs before the head outside
        return ([(n, model.get_submodule(n)) for n in before] + inner
                + [(n, model.get_submodule(n)) for n in after])
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units.extend((f"{name}.{k}", c) for k, c in child.named_children())
        else:
            units.append((name, child))
    return units


def _count(params: object) -> int:
    return sum(p.numel() for p in params if p.requires_grad)  # type: ignore[attr-defined]


def _stats(model: nn.Module, name: str, x: torch.Tensor, batch: int, key: Callable[[torch.Tensor], object],
           source: str) -> ModelStats:
    """Stats from one forward + backward of ``model`` on ``x`` (``batch`` samples).

    A saved-tensors hook records each tensor autograd keeps (once, by ``key``; parameters and buffers
    excluded) and which wrap unit was running; forward hooks record each unit's output size. The loss is assumed
    to be cross-entropy, which saves its fp32 log-probabilities: one output-sized tensor more.
    """
    from torch.utils.flop_counter import FlopCounterMode

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

    units = wrap_units(model)
    outputs: list[int] = []
    hooks = [h for n, m in units for h in (m.register_forward_pre_hook(enter(n)), m.register_forward_hook(leave))]
    try:
        with FlopCounterMode(display=False) as counter, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _first_tensor(model(x))
            out.float().sum().backward()
    finally:
        for h in hooks:
            h.remove()
    per_unit: Counter[str] = Counter()
    for nbytes, unit in saved.values():
        per_unit[unit] += nbytes
    outside = per_unit.pop("(root)", 0) + 4 * out.numel()
    # Checkpointing every unit keeps each unit's input and, during one unit's recompute, its activations.
    checkpointed = x.numel() * x.element_size() + sum(outputs[:-1]) + outside + max(per_unit.values(), default=0)

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
    matmul = {id(m.weight): m.weight.numel() for m in model.modules()
              if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)) and m.weight.requires_grad}
    return ModelStats(name=name, params=_count(model.parameters()), units=tuple(sizes),
                      largest_layer=max(layers, key=lambda x: x[1]),
                      flops_per_sample=counter.get_total_flops() / batch, unit_flops=tuple(unit_flops),
                      activation_bytes_per_sample=sum(per_unit.values(), outside) / batch,
                      checkpointed_bytes_per_sample=min(checkpointed, sum(per_unit.values(), outside)) / batch,
                      boundary_bytes_per_sample=max(outputs[:-1] or outputs or [0]) / batch,
                      matmul_params=sum(matmul.values()), output_bytes_per_sample=4 * out.numel() / batch,
                      largest_activation_bytes_per_sample=max((n for n, _ in saved.values()), default=0) / batch,
                      param_bytes=dict(by_dtype), source=source)


def _tensor_bytes(out: object) -> int:
    try:
        t = _first_tensor(out)
    except ConfigError:
        return 0
    return t.numel() * t.element_size()


def _first_tensor(out: object) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, Mapping) else out if isinstance(out, (tuple, list)) else ()
    for v in values:
        if isinstance(v, torch.Tensor):
            return v
    raise ConfigError(f"the model returned {type(out).__name__}, not a tensor (or a tuple/dict holding one)")


def trace_module(factory: Callable[[], nn.Module], example: InputSpec, *, name: str, batch: int = 2) -> ModelStats:
    """Stats from one forward and backward of ``factory()`` built on the meta device: no weight is allocated.

    Activation bytes are the storages autograd saves for backward (views counted once, through their base),
    excluding parameters and buffers. ``batch`` is 2 so that batch-statistics layers see more than one
    sample; figures are divided back to one sample.
    """
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the factory for {name!r} returned {type(model).__name__}, not an nn.Module")
    model = model.to("meta")  # in case the factory put some tensors on an explicit device
    return _stats(model, name, example.make(batch, "meta"), batch,
                  key=lambda t: id(t._base if t._base is not None else t),  # meta tensors have no address
                  source="traced on the meta device (FlopCounterMode + saved tensors)")


def measure_module(factory: Callable[[], nn.Module], example: InputSpec, *, name: str, batch: int,
                   steps: int = 3) -> ModelStats:
    """Stats from a real forward and backward on this machine's CPU, and the median time of ``steps`` more.

    Activation bytes are the unique storages autograd saves (by address). The model is first built on the
    meta device to check that its weights, gradients and Adam states fit in half the host's RAM.
    """
    from .hardware import GIB, cpu_host

    with torch.device("meta"):
        size = _count(factory().parameters()) * 16
    ram = cpu_host().memory_gib * GIB
    if size > ram / 2:
        raise ConfigError(f"measuring {name!r} for real needs ~{size / GIB:.1f} GiB for weights, gradients and "
                          f"optimizer states, more than half this host's {ram / GIB:.1f} GiB; plan it without --measure")
    model = factory()
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the factory for {name!r} returned {type(model).__name__}, not an nn.Module")
    stats = _stats(model, name, example.make(batch, "cpu"), batch,
                   key=lambda t: t.untyped_storage().data_ptr(), source="measured on this machine")
    x = example.make(batch, "cpu")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        _first_tensor(model(x)).float().sum().backward()
        times.append(time.perf_counter() - start)
    return replace(stats, measured_step_s=sorted(times)[len(times) // 2], measured_batch=batch,
                   measured_threads=torch.get_num_threads())
