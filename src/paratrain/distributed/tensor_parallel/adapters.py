"""PEFT LoRA layers under an inferred tensor-parallel plan: each adapter is split with its base layer.

A LoRA layer (``peft.tuners.lora.Linear``) computes ``base(x) + B(A(dropout(x))) * scaling``, where ``A`` and ``B``
are small ``nn.Linear`` layers (``lora_A[name]``, ``lora_B[name]``) and ``base`` the layer it wraps. The rule:

* the wrapper takes its base layer's role (query, output, up, down ...) and its shape;
* a column-split base: ``B`` column-split the same way (a fused ``[q | k | v]`` one by the same blocks), ``A``
  replicated — ``A`` reads the whole input, ``B`` produces this rank's output features, added to the base's;
* a row-split base: ``A`` row-split (it reads this rank's input features, its small output all-reduced), ``B``
  replicated — both terms are whole after their all-reduces, and added.

So the adapters' weights follow the base's sharding and train as they would on one process. Only plain LoRA is
split: a layer with a variant (DoRA normalises by the whole base weight) is not recognised and stays replicated
with everything inside it, as are LoRA embeddings. LoRA dropout on a row-split layer's input drops per rank: with
``lora_dropout > 0`` the ranks of a tp group drop alike (one RNG stream) but on different features than one
process would; the adapter still trains, not bitwise as one process.
"""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from .probe import Split


def is_lora(module: nn.Module) -> bool:
    """A PEFT LoRA layer of any kind (it wraps a ``base_layer`` and holds ``lora_A``/``lora_B`` adapters)."""
    return (
        isinstance(getattr(module, "base_layer", None), nn.Module)
        and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)
        and isinstance(getattr(module, "lora_B", None), nn.ModuleDict)
    )


def plain_lora_base(module: nn.Module) -> nn.Module | None:
    """The base layer of a plain LoRA layer whose adapters are ``nn.Linear`` (no variant such as DoRA); else
    None."""
    if not is_lora(module) or getattr(module, "lora_variant", None) or getattr(module, "merged_adapters", None):
        return None
    adapters = [*module.lora_A.values(), *module.lora_B.values()]
    return module.base_layer if adapters and all(type(a) is nn.Linear for a in adapters) else None


def inside_lora(name: str, wrappers: set[str]) -> bool:
    """``name`` is a module inside one of the LoRA layers named ``wrappers``."""
    return any(name.startswith(f"{w}.") for w in wrappers)


def with_adapters(block: nn.Module, split: Split) -> Split:
    """``split`` (named by the block's layers, a LoRA layer among them) with every LoRA layer replaced by its base
    layer and adapters, split by the rule in the module docstring."""
    columns: dict[str, int] = {}
    rows: list[str] = []
    for name, parts in split.columns.items():
        layer = block.get_submodule(name)
        if plain_lora_base(layer) is None:
            columns[name] = parts
            continue
        columns[f"{name}.base_layer"] = parts
        columns.update({f"{name}.lora_B.{a}": parts for a in layer.lora_B})
    for name in split.rows:
        layer = block.get_submodule(name)
        rows.extend(
            [name]
            if plain_lora_base(layer) is None
            else [f"{name}.base_layer", *(f"{name}.lora_A.{a}" for a in layer.lora_A)]
        )
    return replace(split, columns=columns, rows=tuple(rows))
