"""Checks of the training script itself (``paratrain doctor --script train.py``): what it imports that will hurt.

``torch.distributed.rpc`` is still importable and silent, but it unpickles whatever a peer sends (CVE-2024-7804,
unfixed: any process that can reach a worker's port runs code in it), it is in maintenance mode and its TensorPipe
backend is deprecated. The script is parsed, never run.
"""
from __future__ import annotations

import ast
from pathlib import Path

from .checks import Check

RPC = "torch.distributed.rpc"


def imported(source: str, filename: str = "<script>") -> list[tuple[str, int]]:
    """(dotted name, line) of every absolute import in ``source``: ``import a.b`` gives ``a.b``; ``from a import
    b`` gives ``a`` and ``a.b`` (``b`` may be a module). The one parser of a script's imports for the doctor's
    checks (this module's and :mod:`paratrain.tf.doctor`'s)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found += [(node.module, node.lineno), *((f"{node.module}.{a.name}", node.lineno) for a in node.names)]
    return found


def rpc_imports(source: str, filename: str = "<script>") -> list[int]:
    """The lines of ``source`` that import ``torch.distributed.rpc`` (or anything from it)."""
    return sorted({line for name, line in imported(source, filename) if name == RPC or name.startswith(RPC + ".")})


def check_script(path: str) -> Check:
    """Warn when the script at ``path`` imports torch.distributed.rpc, and say why."""
    name = f"script {Path(path).name}"
    try:
        source = Path(path).read_text()
        lines = rpc_imports(source, path)
    except (OSError, SyntaxError, UnicodeDecodeError) as err:
        return Check.warn(name, f"could not read {path}: {err}", "pass the path of a Python script")
    if not lines:
        return Check.ok(name, f"no import of {RPC}")
    where = ", ".join(f"line {n}" for n in lines)
    return Check.warn(name, f"imports {RPC} ({where}): it unpickles what peers send (CVE-2024-7804, unfixed), is in "
                      "maintenance mode and its TensorPipe backend is deprecated",
                      "for parameter servers use Parallel('ps', servers=S) (point-to-point, tensor-only messages, "
                      "docs/parameter-server.md); otherwise send tensors with torch.distributed send/recv")
