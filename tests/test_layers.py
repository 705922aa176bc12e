"""The package's layers hold: no import reaches up a layer, the layer-3 siblings never import each other, the library
never imports the demo workloads, and no modules import each other in a circle.

Every ``import`` in ``src/paratrain`` counts, also inside functions and under ``TYPE_CHECKING``: an import hidden
there still ties the modules together, it only fails later. The layers are those of ``shared/DESIGN.md``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "paratrain"

LAYERS: dict[int, tuple[str, ...]] = {
    0: (
        "dims",
        "composition",
        "options",
        "errors",
        "seeding",
        "digest",
        "progress",
        "lazy",
        "version",
        "sizes",
        "flags",
    ),
    1: (
        "env",
        "devices",
        "tensor_layouts",
        "precision",
        "data",
        "lr",
        "rank_agreement",
        "rank_log",
        "call_watch",
        "hang_trace",
        "factory",
        "batch",
        "draws",
        "preemption",
    ),
    2: ("model", "loss"),
    3: ("distributed", "planner", "checkpoint"),
    4: ("strategies", "launcher"),
    5: (
        "parallel",
        "settings",
        "prepared",
        "session",
        "loop",
        "guard",
        "monitor",
        "replicas",
        "rank_alone",
        "script_verify",
    ),
    6: ("workloads", "demo", "bench", "verify", "doctor", "testing", "dry_run", "cuda_step", "plan_commands", "tf"),
    7: ("cli", "__main__", ""),  # "": the package's own __init__, the façade over everything
}
SIBLINGS = frozenset(LAYERS[3])
LIBRARY_TOP = 5  # layers up to here are the library; workloads are the demos built on it

# Known violations, each to be removed by the change that fixes it (the list must end empty).
ALLOWED: frozenset[tuple[str, str]] = frozenset()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The paratrain modules ``name`` imports anywhere in its file."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "paratrain":
                target = node.module
            else:
                continue
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "paratrain")
    return {t for t in found if t in known and t != name}


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _part(module: str) -> str:
    """The top-level module or package of ``paratrain`` that ``module`` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _layer(module: str) -> int:
    part = _part(module)
    for layer, parts in LAYERS.items():
        if part in parts:
            return layer
    raise AssertionError(f"{module}: put paratrain.{part} in a layer of tests/test_layers.py (shared/DESIGN.md)")


def _violations(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    out: dict[tuple[str, str], str] = {}
    for source, targets in graph.items():
        for target in targets:
            low, high = _layer(source), _layer(target)
            if high > low:
                what = (
                    "imports the demo workloads"
                    if _part(target) == "workloads" and low <= LIBRARY_TOP
                    else f"reaches up from layer {low} to {high}"
                )
                out[(source, target)] = what
            elif low == high == 3 and _part(source) != _part(target):
                out[(source, target)] = "crosses between the layer-3 siblings"
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_every_module_has_a_layer():
    for module in _modules():
        _layer(module)


def test_no_import_breaks_the_layers():
    found = _violations(_graph())
    new = {edge: why for edge, why in found.items() if edge not in ALLOWED}
    assert not new, "\n".join(f"{s} -> {t}: {why}" for (s, t), why in sorted(new.items()))


def test_the_allowed_list_holds_only_live_violations():
    """A fixed violation leaves the list, so it cannot come back unnoticed."""
    stale = ALLOWED - set(_violations(_graph()))
    assert not stale, f"remove from ALLOWED (fixed): {sorted(stale)}"


def test_no_import_cycle():
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_checks_catch_what_they_are_for():
    graph = {
        "paratrain.errors": {"paratrain.parallel"},
        "paratrain.parallel": {"paratrain.errors"},
        "paratrain.planner.a": {"paratrain.checkpoint.b", "paratrain.workloads.gpt"},
        "paratrain.checkpoint.b": set(),
        "paratrain.workloads.gpt": set(),
    }
    found = _violations(graph)
    assert found[("paratrain.errors", "paratrain.parallel")] == "reaches up from layer 0 to 5"
    assert found[("paratrain.planner.a", "paratrain.checkpoint.b")] == "crosses between the layer-3 siblings"
    assert found[("paratrain.planner.a", "paratrain.workloads.gpt")] == "imports the demo workloads"
    assert _cycles(graph) == [["paratrain.errors", "paratrain.parallel"]]
    with pytest.raises(AssertionError, match="put paratrain.nowhere in a layer"):
        _layer("paratrain.nowhere.x")


FACADE_LINES = 425
"""In ruff's format (a keyword a line where a call does not fit); 350 in the former hand layout."""


def test_parallel_stays_a_facade():
    """``Parallel`` holds lifecycle and verbs; a feature that grows it belongs in a component it composes."""
    lines = len((SRC / "parallel.py").read_text().splitlines())
    assert lines <= FACADE_LINES, (
        f"parallel.py has {lines} lines (at most {FACADE_LINES}): move the logic into a "
        "component (session, strategies/chosen, prepared, loop, checkpoint.auto, ...)"
    )
