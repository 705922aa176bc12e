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


def rpc_imports(source: str, filename: str = "<script>") -> list[int]:
    """The lines of ``source`` that import ``torch.distributed.rpc`` (or anything from it)."""
    lines = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            if any(a.name == RPC or a.name.startswith(RPC + ".") for a in node.names):
                lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            if node.module == RPC or node.module.startswith(RPC + ".") or (
                    node.module == "torch.distributed" and any(a.name == "rpc" for a in node.names)):
                lines.append(node.lineno)
    return sorted(lines)


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
