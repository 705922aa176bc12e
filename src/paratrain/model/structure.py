"""A model's repeated blocks: the unit that sharding, checkpointing, compiling and pipeline stages work on.

Everyone who shards transformers uses the same unit: one transformer block (PyTorch's FSDP notes, torchtitan,
Accelerate's ``_no_split_modules``-based wrapping). Blocks are found by what they are, in whatever holds them: a
``ModuleList`` or ``Sequential`` (transformers, nanoGPT), a ``ModuleDict`` keyed by index (torchtitan, whose keys
survive a pipeline's cut), or plain attributes of one parent (``self.block0``, ``self.block1``). In this order:

1. a transformers model says which classes must not be split (``_no_split_modules``, also on a PEFT model's
   base model): the blocks are the modules of those classes that repeat inside one parent;
2. otherwise, the parent whose children with parameters include two or more instances of one *composite* class (a
   module with children of its own: a block, not a bare ``nn.Linear``). A container (``ModuleList``,
   ``Sequential``, ``ModuleDict``) must hold nothing else with parameters; among plain attributes the repeated
   class is taken alone. Containers come first; among several candidates, the one holding the most parameters.

Blocks need not have one shape: DeepSeek-V3's first blocks are dense and the rest mixtures of experts, one class.
A stack of plain layers (an MLP as ``nn.Sequential(Linear, ReLU, Linear)``) has no blocks; callers fall back to
their size-based rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class Blocks:
    """Where a model's repeated blocks live."""

    container: str
    """Qualified name of the module that holds them (a ``ModuleList``/``Sequential``/``ModuleDict``, or the parent
    whose attributes they are; ``""`` for the root itself)."""
    names: tuple[str, ...]
    """Qualified names of the blocks, in order."""
    cls: type[nn.Module]
    """The blocks' class."""

    def modules(self, model: nn.Module) -> list[nn.Module]:
        return [model.get_submodule(n) for n in self.names]


def _no_split_classes(model: nn.Module) -> set[str]:
    names: set[str] = set()
    for module in model.modules():
        found = getattr(module, "_no_split_modules", None)
        if found:
            names.update(found)
    return names


def _has_params(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def _composite(module: nn.Module) -> bool:
    return next(module.children(), None) is not None


def _candidates(model: nn.Module, allowed: set[str] | None, containers: bool) -> list[Blocks]:
    """Blocks held by a container (``containers``) or as attributes of any other module."""
    found = []
    for qual, parent in model.named_modules():
        if isinstance(parent, _CONTAINERS) != containers:
            continue
        weighted = [(name, child) for name, child in parent.named_children() if _has_params(child)]
        by_class: dict[type[nn.Module], list[str]] = {}
        for name, child in weighted:
            by_class.setdefault(type(child), []).append(name)
        if containers and len(by_class) != 1:
            continue
        for cls, names in by_class.items():
            if len(names) < 2 or (allowed is not None and cls.__name__ not in allowed):
                continue
            if allowed is None and not _composite(parent.get_submodule(names[0])):
                continue  # a stack of plain layers, not blocks
            prefix = f"{qual}." if qual else ""
            found.append(Blocks(container=qual, names=tuple(prefix + name for name in names), cls=cls))
    return found


def find_blocks(model: nn.Module) -> Blocks | None:
    """The model's repeated blocks (see the module docstring), or None when it has none."""
    allowed = _no_split_classes(model) or None
    found = []
    for rule in ((allowed, True), (allowed, False)) if allowed else ():
        found = found or _candidates(model, *rule)
    for rule in ((None, True), (None, False)):
        found = found or _candidates(model, *rule)
    if not found:
        return None

    def size(b: Blocks) -> int:
        return sum(p.numel() for m in b.modules(model) for p in m.parameters())

    return max(found, key=size)


def outer_modules(model: nn.Module, blocks: Blocks) -> tuple[list[str], list[str]]:
    """The modules on the way to the blocks that are registered before them and after them.

    Walking from the root to the blocks' container, each level's other children are the pieces that run around
    the blocks: the embeddings before (registered first), the final norm and the output head after. Returns the
    qualified names ``(before, after)``; modules without parameters (rotary embeddings, dropout) are listed too.
    """
    before: list[str] = []
    after: list[str] = []
    path = blocks.container.split(".") if blocks.container else []
    module, prefix = model, ""
    for part in path:
        seen_path = False
        for name, _ in module.named_children():
            if name == part:
                seen_path = True
                continue
            (after if seen_path else before).append(prefix + name)
        module, prefix = module.get_submodule(part), f"{prefix}{part}."
    return before, after


def forward_pieces(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's pieces in forward order, the planner's stand-in for FSDP's units and a pipeline's cut points
    (:mod:`.units` has the runtime's units): for a model with repeated blocks, the modules before the blocks, the
    blocks, and the modules after them; otherwise the root's direct children, with ModuleList/ModuleDict items taken
    one by one (they have no forward)."""
    blocks = find_blocks(model)
    if blocks is not None:  # the blocks' container holds them and, in an nn.Sequential, the pieces around them
        before, after = outer_modules(model, blocks)
        prefix = f"{blocks.container}." if blocks.container else ""
        container = model.get_submodule(blocks.container) if blocks.container else model
        inner = [(prefix + k, c) for k, c in container.named_children()]
        after = sorted(after, key=lambda n: -n.count("."))  # the final norm inside runs before the head outside
        return [(n, model.get_submodule(n)) for n in before] + inner + [(n, model.get_submodule(n)) for n in after]
    units: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            units.extend((f"{name}.{k}", c) for k, c in child.named_children())
        else:
            units.append((name, child))
    return units
