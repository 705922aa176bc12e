"""Which embeddings of a model are tables a parameter server holds row-sharded: the one rule the ``ps`` strategy lays
a model out by and the planner plans it by."""

from __future__ import annotations

from torch import nn

TABLE_TYPES = (nn.Embedding, nn.EmbeddingBag)
TABLE_MIN_NUMEL = 1 << 22
"""The size (elements) from which ``tables="auto"`` takes an untied embedding: 16 MiB of fp32."""


def unsupported(module: nn.Module) -> str:
    """The option of an embedding that needs every row each step (so it cannot be a table), or ``""``."""
    if getattr(module, "max_norm", None) is not None:
        return "max_norm"
    if getattr(module, "scale_grad_by_freq", False):
        return "scale_grad_by_freq"
    return ""


def weight_owners(model: nn.Module) -> dict[int, list[str]]:
    """Every name each parameter goes by (a tied weight has several)."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return owners


def auto_tables(model: nn.Module, min_numel: int = TABLE_MIN_NUMEL, *, meta_built: bool = True) -> list[str]:
    """Names of the embeddings ``tables="auto"`` makes tables: untied ``nn.Embedding``/``nn.EmbeddingBag`` without
    ``max_norm`` or ``scale_grad_by_freq``, built on the meta device (``meta_built``: a model traced on meta for a
    plan was not built there by its user) or of at least ``min_numel`` elements."""
    owners = weight_owners(model)
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, TABLE_TYPES)
        and len(owners[id(m.weight)]) == 1
        and not unsupported(m)
        and ((meta_built and m.weight.is_meta) or m.weight.numel() >= min_numel)
    ]
