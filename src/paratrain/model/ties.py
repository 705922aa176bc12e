"""Tied parameters: one tensor reachable under several names (GPT-2's output head reuses the token embedding).

Ties must be found before a model is wrapped: sharding or copying breaks them silently on some torch versions
(FSDP2 on torch 2.11 gives the second owner its own copy, which an optimizer never sees).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Ties:
    """The groups of parameter names that share one tensor."""

    groups: tuple[tuple[str, ...], ...]

    def __bool__(self) -> bool:
        return bool(self.groups)

    def owners(self) -> list[list[str]]:
        """For each group, the qualified names of the modules that hold the shared parameter."""
        return [[name.rpartition(".")[0] for name in group] for group in self.groups]

    def partner(self, name: str) -> str | None:
        """Another name of the tensor called ``name``, or None when it is not tied."""
        for group in self.groups:
            if name in group:
                return next(n for n in group if n != name)
        return None

    def broken(self, model: nn.Module) -> list[tuple[str, str]]:
        """Pairs of names that should share one tensor in ``model`` but no longer do (names absent from ``model``,
        as on a pipeline stage, are skipped)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        out = []
        for group in self.groups:
            present = [n for n in group if n in params]
            out.extend((present[0], n) for n in present[1:] if params[n] is not params[present[0]])
        return out


def find_ties(model: nn.Module) -> Ties:
    """Every group of names under which ``model`` reaches one parameter tensor."""
    by_tensor: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(param), []).append(name)
    return Ties(groups=tuple(tuple(names) for names in by_tensor.values() if len(names) > 1))
