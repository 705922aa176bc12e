"""Pipeline stages cut from a model itself, so the model's own ``forward`` runs on every stage.

The tracing front end of ``torch.distributed.pipelining`` needs a model ``torch.export`` can capture whole, which
rotary embeddings and many transformers models are not. So, as torchtitan does (``distributed/pipeline_parallel.py``),
a stage is the model with everything it does not run swapped out:

* the blocks container keeps only this stage's blocks, under their own keys (``transformer.h`` holding ``"6"``
  and ``"7"``), so parameter names, the optimizer's mapping and checkpoints stay the user's;
* on every stage but the first, the modules before the blocks become stand-ins: the input embedding hands back
  the hidden states the stage received (:class:`Received`), an embedding that is *added* (GPT-2's positions
  ``wpe``) a zero, dropout a pass-through (it ran on the first stage already); an embedding block that does more
  than a lookup (BERT's ``embeddings``: word, position and token-type tables, a norm, dropout; it holds the input
  embedding) runs whole on the first stage and hands back the received hidden states on the others. The model's
  own forward still gets inputs of the model's shapes: a transformers model the hidden states as
  ``inputs_embeds=`` (its embedding is then not called), any other model the batch's token ids themselves, which
  every stage is handed besides (they are small), so code that reads its input's shape (nanoGPT's
  ``b, t = idx.size()``) runs on every stage as in one process;
* on every stage but the last, the modules after the blocks (final norm, head) become stand-ins that hand on what
  they are given (:class:`HandsOn`): what the first of them is called with, the blocks' output, is the stage's
  output, whatever the model's code does after it (nanoGPT without targets keeps the last position only);
* parameter-free pieces other than dropout (Llama's ``rotary_emb``, computed from the positions) stay on every
  stage.

A PEFT model (LoRA) is cut the same way, between its base model's blocks: its adapters live inside the blocks'
layers, so each stage holds its blocks with their adapters, and its forward passes everything to the base model,
whose signature says whether a stage's input goes as ``inputs_embeds=``.

A stage is a shallow copy: only the modules on the way from the root to the blocks are copied (with a
``_modules`` dict of their own); blocks, embeddings and head are the user's module objects, so a tie inside one
stage stays a tie. What a stage returns is a tensor (a ``ModelOutput``'s first field, ``logits``);
:class:`OutputKind` rebuilds an object of the model's own kind around the last stage's tensor, so a loss
written for the plain model's output (``out.logits``) works unchanged.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..batch import loss_of
from ..errors import ConfigError
from .cuts import balance
from .structure import Blocks, find_blocks, outer_modules

if TYPE_CHECKING:
    from .facts import ModelFacts


class StandIn(nn.Module):
    """Stands in for a module of another stage: holds no parameter and takes no tensor-parallel style."""


class PassThrough(StandIn):
    """Stands in for a module this stage does not run: gives back its input (the hidden states)."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x


class Received(StandIn):
    """Stands in for the input embedding (or the block holding it) on a stage past the first: whatever the model
    calls it with (the token ids, or ``inputs_embeds=``), it gives back the hidden states the stage received."""

    def __init__(self) -> None:
        super().__init__()
        self.value: torch.Tensor | None = None
        """Set by :class:`StageModule` around each forward."""

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        return self.value


class HandsOn(PassThrough):
    """Stands in for a module after the blocks on a stage before the last: gives back its input, and the first
    input it is given in a forward (the blocks' output) is kept as the stage's output."""

    def __init__(self, kept: list[torch.Tensor]) -> None:
        super().__init__()
        self.kept = kept
        """Shared by the stage's ``HandsOn`` modules: empty at the start of each forward, then the first input."""

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.kept and isinstance(x, torch.Tensor):
            self.kept.append(x)
        return x


class AddsNothing(StandIn):
    """Stands in for an embedding whose output is *added* to the hidden states (positions): a zero, so a later
    stage does not add it a second time."""

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return torch.zeros((), device=x.device)  # 0-dim: broadcasts and keeps the hidden states' dtype


@dataclass(frozen=True)
class StagePlan:
    """How a model is cut: which blocks each stage runs and what lies around them."""

    blocks: Blocks
    before: tuple[str, ...]
    """Qualified names of the modules before the blocks (embeddings, dropout)."""
    after: tuple[str, ...]
    """… and after them (final norm, head; rotary embeddings registered last)."""
    bounds: tuple[tuple[int, int], ...]
    """Per stage, the half-open range of block indices it runs."""
    input_embedding: str | None
    """The module that reads the model's input (token ids)."""

    @property
    def num_stages(self) -> int:
        return len(self.bounds)

    def stage_of(self, param_name: str) -> int | None:
        """The stage holding the parameter called ``param_name`` (None: a parameter-free piece on every stage)."""
        for i, (start, end) in enumerate(self.bounds):
            if any(_inside(param_name, b) for b in self.blocks.names[start:end]):
                return i
        if any(_inside(param_name, m) for m in self.before):
            return 0
        if any(_inside(param_name, m) for m in self.after):
            return self.num_stages - 1
        return None


def _inside(name: str, module: str) -> bool:
    return name.startswith(module + ".")


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _input_embedding(model: nn.Module, before: Sequence[str]) -> str | None:
    getter = getattr(model, "get_input_embeddings", None)
    if callable(getter):
        try:
            emb = getter()
        except (NotImplementedError, AttributeError):
            emb = None
        for name, module in model.named_modules():
            if emb is not None and module is emb:
                return name
    return next((n for n in before if _has_params(model.get_submodule(n))), None)


def plan_stages(
    model: nn.Module,
    num_stages: int,
    split_points: Sequence[str] | None = None,
    split: Sequence[int] | None = None,
    facts: ModelFacts | None = None,
) -> StagePlan:
    """Cut ``model`` into ``num_stages`` stages at the named blocks (``split_points``, where stages 2, 3, … begin),
    at block indices (``split``), or balanced by the blocks' parameter counts; one-line ``ConfigError`` when the
    model cannot be split this way. ``facts``: ``model``'s, when ``prepare`` found them."""
    kind = type(model).__name__
    blocks = facts.blocks if facts is not None else find_blocks(model)
    if blocks is None:
        raise ConfigError(
            f"pipeline cannot split {kind}: it has no repeated blocks (two or more modules of one class with "
            "layers of their own, in one parent) to cut between; express it as nn.Sequential(...) or use ddp or fsdp"
        )
    before, after = outer_modules(model, blocks)
    _check_path(model, blocks)
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        raise ConfigError(
            f"pipeline cannot train {kind} with its router's load-balancing loss "
            "(config.output_router_logits=True): the loss sums over every block's routing and a stage "
            "runs only its own; use ddp or zero3 (tp, hsdp), or set "
            "output_router_logits=False"
        )
    input_embedding = _input_embedding(model, before)
    for name in before:
        module = model.get_submodule(name)
        holds_input = input_embedding is not None and input_embedding.startswith(f"{name}.")
        if _has_params(module) and name != input_embedding and not holds_input and not isinstance(module, nn.Embedding):
            raise ConfigError(
                f"pipeline cannot split {kind}: {name} ({type(module).__name__}) runs before the blocks, holds no "
                "input embedding and does more than look up one, so later stages cannot skip it; use ddp or fsdp"
            )
    n = len(blocks.names)
    if num_stages > n:
        raise ConfigError(
            f"pipeline needs at least {num_stages} blocks for {num_stages} stages; {kind} has {n} "
            f"({blocks.container}); use fewer processes or stages"
        )
    if split_points is not None and split is not None:
        raise ConfigError("give either split (indices) or split_points (block names), not both")
    if split_points is not None:
        unknown = [p for p in split_points if p not in blocks.names]
        if unknown:
            raise ConfigError(
                f"pipeline split points {unknown} are not blocks of {kind}; name blocks such as "
                f"{blocks.names[min(1, n - 1)]!r} (the first block of a stage)"
            )
        split = [blocks.names.index(p) for p in split_points]
    if split is None:
        sizes = [sum(p.numel() for p in m.parameters()) for m in blocks.modules(model)]
        starts = [0, *balance(sizes, num_stages)]
    else:
        starts = [0, *split]
    if len(starts) != num_stages or starts != sorted(set(starts)) or starts[-1] >= n:
        given = list(split_points) if split_points is not None else list(split or [])
        raise ConfigError(
            f"pipeline split {given} does not fit: {num_stages} stages need {num_stages - 1} "
            f"increasing split points among blocks 1..{n - 1} of {blocks.container}"
        )
    bounds = tuple(zip(starts, [*starts[1:], n]))
    for stage, (start, end) in enumerate(bounds):  # checked on every rank alike, so all refuse together
        outer = (before if stage == 0 else []) + (after if stage == len(bounds) - 1 else [])
        modules = blocks.modules(model)[start:end] + [model.get_submodule(o) for o in outer]
        if not any(p.requires_grad for m in modules for p in m.parameters()):
            raise ConfigError(
                f"pipeline stage {stage} ({blocks.names[start]}..{blocks.names[end - 1]}) holds no "
                "trainable parameter, so its rank would have nothing to optimise; move the split points "
                "or use fewer stages"
            )
    return StagePlan(
        blocks=blocks, before=tuple(before), after=tuple(after), bounds=bounds, input_embedding=input_embedding
    )


def most_stages(model: nn.Module) -> tuple[int, str | None]:
    """The most pipeline stages ``pipeline`` and ``hybrid`` cut ``model`` into (an ``nn.Sequential``'s layers, any
    other model's repeated blocks), and when that is none, the line ``prepare`` refuses the model with: what the
    planner offers pipelines by, so that it offers none the runtime refuses."""
    if isinstance(model, nn.Sequential):
        return len(model), None
    try:
        plan = plan_stages(model, 2)
    except ConfigError as err:
        return 0, str(err)
    return len(plan.blocks.names), None


def _path(blocks: Blocks) -> list[str]:
    """Qualified names of the modules from the root (``""``) down to the blocks' container."""
    parts = blocks.container.split(".") if blocks.container else []
    return [""] + [".".join(parts[: i + 1]) for i in range(len(parts))]


def _check_path(model: nn.Module, blocks: Blocks) -> None:
    for name in _path(blocks):
        module = model.get_submodule(name)
        own = next(iter(module._parameters), None)
        if own is not None:
            where = f"{name}.{own}" if name else own
            raise ConfigError(
                f"pipeline cannot split {type(model).__name__}: the parameter {where} sits on a module "
                "that every stage runs through, so no single stage can own it; move it into a "
                "sub-module, or use ddp or fsdp"
            )


def stand_in(plan: StagePlan, name: str, module: nn.Module, kept: list[torch.Tensor]) -> nn.Module:
    """What a stage that does not run the outer module ``name`` puts in its place (see the module docstring);
    ``kept``: where the stand-ins after the blocks keep the stage's output."""
    if name in plan.after:
        return HandsOn(kept) if _has_params(module) or isinstance(module, nn.Dropout) else module
    if not _has_params(module):
        return PassThrough() if isinstance(module, nn.Dropout) else module
    embedding = plan.input_embedding
    if embedding is not None and (name == embedding or embedding.startswith(f"{name}.")):
        return Received()
    if isinstance(module, nn.Embedding):
        return AddsNothing()
    return PassThrough()


def build_stage(model: nn.Module, plan: StagePlan, stages: Sequence[int]) -> nn.Module:
    """The model as the given stages (one, or every stage a rank holds) run it: a shallow copy down to the blocks'
    container, which keeps only those stages' blocks; outer modules of other stages replaced by stand-ins."""
    first, last = 0 in stages, plan.num_stages - 1 in stages
    kept = {plan.blocks.names[i] for s in stages for i in range(*plan.bounds[s])}
    copies: dict[str, nn.Module] = {}
    for name in _path(plan.blocks):
        original = model.get_submodule(name)
        twin = copy.copy(original)
        twin.__dict__["_modules"] = dict(original._modules)
        copies[name] = twin
        if name:
            parent, _, child = name.rpartition(".")
            copies[parent]._modules[child] = twin
    container = copies[plan.blocks.container]
    _keep_layer_types(
        copies[plan.blocks.container.rpartition(".")[0]],
        sorted(i for s in stages for i in range(*plan.bounds[s])),
        len(plan.blocks.names),
    )
    prefix = f"{plan.blocks.container}." if plan.blocks.container else ""
    owner = stages[0] if first else None  # parameter-free children go with the block before them
    for key in list(container._modules):
        qual = prefix + key
        if qual in plan.blocks.names:
            owner = qual if qual in kept else None
        if owner is None:
            del container._modules[key]
    kept: list[torch.Tensor] = []
    for names, keep in ((plan.before, first), (plan.after, last)):
        if keep:
            continue
        for name in names:
            parent, _, child = name.rpartition(".")
            copies[parent]._modules[child] = stand_in(plan, name, model.get_submodule(name), kept)
    return copies[""]


def _keep_layer_types(owner: nn.Module, kept: list[int], blocks: int) -> None:
    """Give the stage copy of the blocks' owner a config whose per-block ``layer_types`` are its kept blocks'.

    transformers models with blocks of several kinds (GPT-OSS, Gemma, Qwen2 with sliding windows) pick each block's
    attention mask by its position in the loop, ``config.layer_types[i]`` for ``enumerate(self.layers)``; on a stage
    that holds blocks 6 and 7, position 0 is block 6, whose type is ``layer_types[6]``."""
    config = getattr(owner, "config", None)
    types = getattr(config, "layer_types", None)
    if not isinstance(types, (list, tuple)) or len(types) != blocks:
        return
    config = copy.copy(config)
    config.layer_types = [types[i] for i in kept]
    owner.__dict__["config"] = config


@dataclass(frozen=True)
class OutputKind:
    """What the model returns around its main tensor, so the last stage's tensor can be handed back as that."""

    cls: type | None = None
    """The output's class: a ``ModelOutput`` or tuple type; None for a bare tensor."""
    field: str | None = None
    """The ``ModelOutput`` field holding the tensor (``logits``)."""
    loss_at: int | None = None
    """Where a tuple holds the loss the model computed, or its place when it computed none (nanoGPT's
    ``(logits, loss)`` and ``(logits, None)``: 1)."""
    at: int = 0
    """Where a tuple holds the tensor."""

    def wrap(self, tensor: torch.Tensor, loss: torch.Tensor | None = None) -> Any:
        """The model's kind of output around ``tensor`` (and the ``loss`` it computed, when it did)."""
        if self.cls is None:
            return tensor
        if self.field is None:
            items: list[Any] = [None] * (max(self.at, -1 if self.loss_at is None else self.loss_at) + 1)
            items[self.at] = tensor
            if self.loss_at is not None:
                items[self.loss_at] = loss
            return self.cls(items)
        return self.cls(**{self.field: tensor}, **({} if loss is None else {"loss": loss}))


def split_output(out: Any) -> tuple[torch.Tensor, OutputKind]:
    """The tensor a stage passes on (or the loss reads) — never a loss the model computed — and how to rebuild
    the model's kind of output from it."""
    if isinstance(out, torch.Tensor):
        return out, OutputKind()
    if isinstance(out, Mapping):  # transformers' ModelOutput: fields in order, unset ones absent
        field = next((k for k, v in out.items() if isinstance(v, torch.Tensor) and v.dim() > 0), None)  # no loss
        if field is not None:
            return out[field], OutputKind(type(out), field)
    if isinstance(out, tuple) and out:
        tensors = [i for i, t in enumerate(out) if isinstance(t, torch.Tensor) and t.dim() > 0]
        losses = [i for i, t in enumerate(out[:2]) if t is None or isinstance(t, torch.Tensor) and t.dim() == 0]
        if tensors and tensors[0] <= 1:
            return out[tensors[0]], OutputKind(tuple, loss_at=losses[0] if losses else None, at=tensors[0])
    raise ConfigError(
        f"a pipeline stage must produce a tensor, a ModelOutput or a tuple starting with one; the "
        f"model returned {type(out).__name__}"
    )


LOSS_INPUT = "paratrain_loss__"
"""The prefix under which a model's own loss inputs (``labels=``; ``""``: its positional target) travel through a
pipeline schedule to the stages; only the last stage hands them to the model."""
TOKEN_IDS = "paratrain_ids__"
"""The keyword under which the batch's input reaches the stages past the first of a model that takes no
``inputs_embeds=``: they run the model's forward on it (:class:`StageModule`)."""


class StageModule(nn.Module):
    """One pipeline stage: tensor in, tensor out, through the model's own forward on a stage copy.

    A transformers model takes a later stage's input as ``inputs_embeds=`` (its embedding is then not called) and
    runs without a key/value cache (``use_cache=False``: training needs none, and a cache is no tensor to pass); any
    other model takes the batch's input (:data:`TOKEN_IDS`), its input embedding handing back the received hidden
    states (:class:`Received`). A stage before the last hands on its blocks' output (:class:`HandsOn`).
    Keyword inputs (an attention mask) reach every stage; the inputs of a loss the model computes itself reach the
    last stage only, which then hands on the loss (:func:`paratrain.batch.loss_of`) instead of the logits.
    """

    def __init__(self, stage: nn.Module, index: int, last: bool) -> None:
        super().__init__()
        self.stage = stage
        self.index, self.first, self.last = index, index == 0, last
        base = stage.get_base_model() if callable(getattr(stage, "get_base_model", None)) else stage  # PEFT
        accepted = inspect.signature(type(base).forward).parameters
        self.embeds_keyword = "inputs_embeds" in accepted
        self.takes_ids = not self.first and not self.embeds_keyword
        """The model's forward runs on the batch's input here (handed in as :data:`TOKEN_IDS`)."""
        self.receivers = [m for m in stage.modules() if isinstance(m, Received)]
        self.kept = next((m.kept for m in stage.modules() if isinstance(m, HandsOn)), [])
        self.extra = {"use_cache": False} if "use_cache" in accepted else {}
        self.constants: dict[str, Any] = {}
        """Keyword inputs of this batch that are no tensors (a schedule splits only tensors into micro-batches)."""
        self.kind = OutputKind()
        """The kind of output the model produced on the last forward (read on the last stage)."""
        self.loss: torch.Tensor | None = None
        """The loss the model computed on the last forward, on the last stage given the loss's inputs."""
        self.hands_on_loss = False
        """Return that loss, not the logits (a training schedule's loss function reads it)."""
        self.copy_views = False
        """Hand on a copy of an output that is a view: a zero-bubble schedule detaches a stage's outputs in place
        once their input gradients are computed, which a view refuses."""

    def forward(self, x: torch.Tensor, **inputs: Any) -> torch.Tensor:
        inputs = {**self.constants, **inputs}
        ids = inputs.pop(TOKEN_IDS, None)
        own = {k[len(LOSS_INPUT) :]: inputs.pop(k) for k in list(inputs) if k.startswith(LOSS_INPUT)}
        own = own if self.last else {}
        target = own.pop("", None)
        kwargs = {**self.extra, **inputs, **own}
        args: tuple[Any, ...] = (x,)
        if not self.first and self.embeds_keyword:
            args, kwargs["inputs_embeds"] = (), x
        elif self.takes_ids:
            args = (ids,)
        for receiver in self.receivers:
            receiver.value = x
        self.kept.clear()
        try:
            out = self.stage(*args, *(() if target is None else (target,)), **kwargs)
        except (ValueError, TypeError, RuntimeError, IndexError) as err:
            if self.first:
                raise
            raise ConfigError(
                f"pipeline stage {self.index} cannot run {type(self.stage).__name__}'s forward with the other "
                f"stages' modules stood in for ({type(err).__name__}: {str(err).splitlines()[0][:80]}); use zero3 "
                "or tp for this model"
            ) from None
        finally:
            for receiver in self.receivers:
                receiver.value = None
        if self.kept:  # a stage before the last: its blocks' output, not what the model made of it
            tensor = self.kept.pop()
        else:
            tensor, self.kind = split_output(out)
        self.loss = None
        if own or target is not None:
            self.loss = loss_of(out)
            if self.hands_on_loss:
                return self.loss
        if tensor._base is not None and (self.copy_views or _sharded(self)):
            # A middle stage's hidden states come out as a view (GPT-2's ``view``, the logits slice); FSDP warns
            # on every such root output, since an in-place op on it would skip its hooks. A copy is one activation.
            tensor = tensor.clone()
        return tensor


def _sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)
