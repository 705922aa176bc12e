"""Checks of the training script itself (``paratrain doctor --script train.py``): what it imports that will hurt,
and where it hard-codes CUDA on a host without it.

``torch.distributed.rpc`` is still importable and silent, but it unpickles whatever a peer sends (CVE-2024-7804,
unfixed: any process that can reach a worker's port runs code in it), it is in maintenance mode and its TensorPipe
backend is deprecated.

Scripts written for one GPU box name CUDA outright (nanoGPT's ``device = 'cuda'``, ``backend = 'nccl'`` and
``torch.cuda.set_device``): on a machine without CUDA they fail at those lines, after the launch. The doctor names
the lines first. Code under a test of ``torch.cuda.is_available()`` (or of the device string) is left alone: it
already picks. The script is parsed, never run.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from .checks import Check

RPC = "torch.distributed.rpc"
CUDA_DEVICE = re.compile(r"cuda(:\d+)?")
"""A device string naming CUDA: ``cuda``, ``cuda:0``."""
DEVICE_KEYWORDS = frozenset({"device", "map_location"})
"""Keyword arguments that take a device (``torch.zeros(..., device=)``, ``torch.load(map_location=)``)."""
CUDA_FIX = (
    "take the device from Parallel (par.device) or pick it: 'cuda' if torch.cuda.is_available() else "
    "'cpu'; the backend likewise ('nccl' or 'gloo'), or let Parallel start the process group; settings read "
    "from the command line can be set to cpu and gloo there"
)


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


def _dotted(node: ast.AST) -> str:
    """``torch.cuda.set_device`` for that attribute chain; ``""`` for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return f"{base}.{node.attr}" if base else ""
    return ""


def _names_cuda(node: ast.AST | None) -> bool:
    """A ``'cuda'``/``'cuda:N'`` literal, or an f-string ``f'cuda:{rank}'``."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return CUDA_DEVICE.fullmatch(node.value) is not None
    if isinstance(node, ast.JoinedStr) and node.values:
        first = node.values[0]
        return isinstance(first, ast.Constant) and str(first.value).startswith("cuda:")
    return False


def _picks_device(test: ast.AST) -> bool:
    """A condition that asks whether CUDA is there, or which device a string names: code under it picks."""
    for node in ast.walk(test):
        if isinstance(node, ast.Call) and _dotted(node.func).endswith(("cuda.is_available", "cuda.device_count")):
            return True
        if isinstance(node, ast.Compare) and any(_names_cuda(n) for n in (node.left, *node.comparators)):
            return True
    return False


class _CudaFinder(ast.NodeVisitor):
    """Collects (line, what) for every place the script hard-codes CUDA outside a branch that picks the device."""

    def __init__(self) -> None:
        self.found: list[tuple[int, str]] = []

    def visit_If(self, node: ast.If | ast.IfExp) -> None:
        if not _picks_device(node.test):
            self.generic_visit(node)

    visit_IfExp = visit_If

    def visit_Assign(self, node: ast.Assign | ast.AnnAssign) -> None:
        nccl = isinstance(node.value, ast.Constant) and node.value.value == "nccl"
        if nccl or _names_cuda(node.value):
            self.found.append((node.lineno, ast.unparse(node)))
        self.generic_visit(node)

    visit_AnnAssign = visit_Assign

    def visit_Call(self, node: ast.Call) -> None:
        what = _cuda_call(node)
        if what:
            self.found.append((node.lineno, what))
        self.generic_visit(node)


def _cuda_call(node: ast.Call) -> str:
    """What in this call hard-codes CUDA, or ``""``."""
    name = _dotted(node.func)
    if name.endswith("cuda.set_device"):
        return "torch.cuda.set_device()"
    if isinstance(node.func, ast.Attribute) and node.func.attr == "cuda":
        return ".cuda()"
    if name.endswith("init_process_group"):
        backend = next((k.value for k in node.keywords if k.arg == "backend"), node.args[0] if node.args else None)
        nccl = isinstance(backend, ast.Constant) and backend.value == "nccl"
        return "init_process_group(backend='nccl')" if nccl else ""
    given = [k.value for k in node.keywords if k.arg in DEVICE_KEYWORDS]
    if name.endswith("device") or (isinstance(node.func, ast.Attribute) and node.func.attr == "to"):
        given += node.args[:1]
    return next((f"device {ast.unparse(v)}" for v in given if _names_cuda(v)), "")


def cuda_uses(source: str, filename: str = "<script>") -> list[tuple[int, str]]:
    """(line, what) of each place ``source`` hard-codes CUDA, in line order."""
    finder = _CudaFinder()
    finder.visit(ast.parse(source, filename))
    return sorted(finder.found)


def check_cuda(path: str, cuda: bool) -> Check:
    """Warn when the script at ``path`` hard-codes CUDA and this host has none (``cuda``: torch sees a GPU)."""
    name = f"cuda in {Path(path).name}"
    try:
        found = cuda_uses(Path(path).read_text(), path)
    except (OSError, SyntaxError, UnicodeDecodeError) as err:
        return Check.warn(name, f"could not read {path}: {err}", "pass the path of a Python script")
    if not found:
        return Check.ok(name, "no hard-coded CUDA device or backend")
    where = ", ".join(f"line {line} {what}" for line, what in found)
    if cuda:
        return Check.ok(name, f"hard-codes CUDA ({where}); this host has it")
    return Check.warn(name, f"hard-codes CUDA, which this host lacks: {where}", CUDA_FIX)


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
    return Check.warn(
        name,
        f"imports {RPC} ({where}): it unpickles what peers send (CVE-2024-7804, unfixed), is in "
        "maintenance mode and its TensorPipe backend is deprecated",
        "for parameter servers use Parallel('ps', servers=S) (point-to-point, tensor-only messages, "
        "docs/parameter-server.md); otherwise send tensors with torch.distributed send/recv",
    )
