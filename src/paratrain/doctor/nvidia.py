"""What ``nvidia-smi`` says about this machine's GPUs, parsed from its text output.

Commands run through an injectable :class:`CommandRunner`, so tests replay recorded outputs of real machines
(``tests/fixtures/nvidia_smi/``) and every GPU check is exercised without a GPU. The parsers are tolerant:
a line they do not understand is skipped, never fatal, because a doctor that crashes on an odd driver
version helps nobody.
"""

from __future__ import annotations

import csv
import re
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

LIST_GPUS = ("nvidia-smi", "-L")
TOPOLOGY = ("nvidia-smi", "topo", "-m")
QUERY_FIELDS = (
    "index",
    "name",
    "memory.total",
    "pcie.link.gen.current",
    "pcie.link.gen.max",
    "pcie.link.width.current",
    "pcie.link.width.max",
)
QUERY = ("nvidia-smi", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits")
NOT_FOUND = 127
TIMED_OUT = 124


@dataclass(frozen=True, kw_only=True)
class CommandResult:
    """The outcome of one external command."""

    returncode: int
    """Exit status; 127 when the program is not installed, 124 when it ran past its timeout."""
    stdout: str = ""
    stderr: str = ""

    @property
    def first_line(self) -> str:
        """The first non-empty output line: nvidia-smi puts its reason for failing there."""
        for line in (self.stdout + "\n" + self.stderr).splitlines():
            if line.strip():
                return line.strip()
        return f"exit code {self.returncode}"


class CommandRunner(Protocol):
    """Runs ``argv`` and returns its output; tests pass a fake that replays recorded outputs."""

    def __call__(self, argv: Sequence[str]) -> CommandResult: ...


def run_command(argv: Sequence[str], timeout_s: float = 10.0) -> CommandResult:
    """Run a real command; a missing program or a hang becomes a result, not an exception."""
    try:
        done = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s)
    except FileNotFoundError:
        return CommandResult(returncode=NOT_FOUND, stderr=f"{argv[0]}: command not found")
    except subprocess.TimeoutExpired:
        return CommandResult(returncode=TIMED_OUT, stderr=f"{argv[0]} did not answer within {timeout_s:g} s")
    return CommandResult(returncode=done.returncode, stdout=done.stdout, stderr=done.stderr)


@dataclass(frozen=True, kw_only=True)
class Gpu:
    """One GPU as nvidia-smi numbers it (PCI bus order, the order CUDA uses with CUDA_DEVICE_ORDER=PCI_BUS_ID)."""

    index: int
    name: str
    uuid: str = ""
    memory_mib: int | None = None
    """Total memory in MiB, as nvidia-smi reports it."""
    pcie_gen: int | None = None
    """Current PCIe generation; drops at idle to save power, so it is only a hint."""
    pcie_gen_max: int | None = None
    """Highest generation this GPU *and slot* support."""
    pcie_width: int | None = None
    """Current PCIe lanes."""
    pcie_width_max: int | None = None
    """Most lanes this GPU and slot support."""


@dataclass(frozen=True, kw_only=True)
class NvidiaFacts:
    """Everything the GPU checks need from nvidia-smi."""

    found: bool
    """nvidia-smi is installed (it may still have failed)."""
    error: str | None = None
    """Why ``nvidia-smi -L`` failed (its first output line), or None when it worked."""
    gpus: tuple[Gpu, ...] = ()
    links: dict[tuple[int, int], str] = field(default_factory=dict)
    """``nvidia-smi topo -m`` cell for each GPU pair (i < j): 'NV18', 'PIX', 'PHB', 'SYS', …"""


def probe(run: CommandRunner) -> NvidiaFacts:
    """Ask nvidia-smi for the GPU list, their memory and PCIe links, and the topology matrix."""
    listed = run(LIST_GPUS)
    if listed.returncode == NOT_FOUND:
        return NvidiaFacts(found=False, error=listed.first_line)
    if listed.returncode != 0:
        return NvidiaFacts(found=True, error=listed.first_line)
    names = parse_gpu_list(listed.stdout)
    if not names:
        return NvidiaFacts(found=True)
    query = run(QUERY)
    rows = parse_query(query.stdout) if query.returncode == 0 else {}
    gpus = tuple(
        replace(rows[index], uuid=uuid) if index in rows else Gpu(index=index, name=name, uuid=uuid)
        for index, (name, uuid) in sorted(names.items())
    )
    topo = run(TOPOLOGY) if len(gpus) > 1 else None
    links = parse_topology(topo.stdout) if topo is not None and topo.returncode == 0 else {}
    return NvidiaFacts(found=True, gpus=gpus, links=links)


_LIST_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: ([^)]+)\)\s*$")


def parse_gpu_list(text: str) -> dict[int, tuple[str, str]]:
    """``nvidia-smi -L`` → {index: (name, uuid)}; MIG instance lines (indented) are left out."""
    gpus = {}
    for line in text.splitlines():
        match = _LIST_LINE.match(line)
        if match:
            gpus[int(match.group(1))] = (match.group(2).strip(), match.group(3).strip())
    return gpus


def parse_query(text: str) -> dict[int, Gpu]:
    """``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits`` → {index: Gpu}.

    Fields a GPU does not support read ``[N/A]`` or ``[Not Supported]`` and become None.
    """
    gpus = {}
    for row in csv.reader(text.splitlines(), skipinitialspace=True):
        if len(row) != len(QUERY_FIELDS) or not row[0].strip().isdigit():
            continue
        index, name, memory, gen, gen_max, width, width_max = (cell.strip() for cell in row)
        gpus[int(index)] = Gpu(
            index=int(index),
            name=name,
            memory_mib=_int(memory),
            pcie_gen=_int(gen),
            pcie_gen_max=_int(gen_max),
            pcie_width=_int(width),
            pcie_width_max=_int(width_max),
        )
    return gpus


def _int(cell: str) -> int | None:
    try:
        return int(float(cell))
    except ValueError:
        return None


_DEVICE = re.compile(r"^GPU(\d+)$")


def parse_topology(text: str) -> dict[tuple[int, int], str]:
    """``nvidia-smi topo -m`` → {(i, j): cell} for every GPU pair i < j.

    The header names the matrix's columns (GPUs, then NICs) before 'CPU Affinity'; each GPU row holds one cell
    per column. Cells are split on whitespace, so both the tab-separated and the older space-aligned layouts
    parse. Parsing stops at the legend.
    """
    columns: list[str] = []
    links: dict[tuple[int, int], str] = {}
    for line in text.splitlines():
        tokens = line.split()
        if not tokens or tokens[0].startswith("Legend"):
            if links:
                break
            continue
        if not columns and tokens[0] == "GPU0" and not line[:1].isalnum():
            columns = tokens[: tokens.index("CPU")] if "CPU" in tokens else tokens
            continue
        row = _DEVICE.match(tokens[0])
        if not columns or row is None:
            continue
        i = int(row.group(1))
        for column, cell in zip(columns, tokens[1 : 1 + len(columns)]):
            col = _DEVICE.match(column)
            if col is not None and i < int(col.group(1)):
                links[(i, int(col.group(1)))] = cell
    return links
