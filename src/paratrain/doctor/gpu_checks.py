"""GPU checks from nvidia-smi's facts: which GPUs a job sees, their models, the links between them, PCIe.

Pure functions, driven in tests by recorded nvidia-smi outputs (``tests/fixtures/nvidia_smi/``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import combinations
from types import MappingProxyType

from .checks import Check
from .nvidia import Gpu, NvidiaFacts
from .system import TorchFacts

SLOW_PCIE_GBPS = 10.0
"""Links below this (gen3 x8 ≈ 7.9 GB/s, gen4 x4) halve host↔GPU copies compared with a gen3 x16 slot."""
PCIE_LANE_GBPS = MappingProxyType({1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563})
"""Usable GB/s per lane and direction after line encoding."""


@dataclass(frozen=True, kw_only=True)
class Visibility:
    """The nvidia-smi GPUs that CUDA_VISIBLE_DEVICES leaves to CUDA, in CUDA's order."""

    indices: tuple[int, ...]
    ignored: str | None = None
    """The first entry naming no GPU; CUDA drops it and every entry after it."""


def resolve_visible(cvd: str | None, gpus: Sequence[Gpu]) -> Visibility:
    """Apply CUDA's reading of CUDA_VISIBLE_DEVICES (indices or GPU-UUID prefixes) to nvidia-smi's list.

    Indices are nvidia-smi's (PCI bus order); CUDA uses the same numbering with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    """
    if cvd is None:
        return Visibility(indices=tuple(g.index for g in gpus))
    chosen: list[int] = []
    for entry in (e.strip() for e in cvd.split(",")):
        index = _lookup(entry, gpus)
        if index is None or index in chosen:
            return Visibility(indices=tuple(chosen), ignored=entry or None)
        chosen.append(index)
    return Visibility(indices=tuple(chosen))


def _lookup(entry: str, gpus: Sequence[Gpu]) -> int | None:
    if entry.isdigit():
        return int(entry) if any(g.index == int(entry) for g in gpus) else None
    matches = [g.index for g in gpus if entry.startswith("GPU-") and g.uuid.startswith(entry)]
    return matches[0] if len(matches) == 1 else None


def check_visible_gpus(torch: TorchFacts, nvidia: NvidiaFacts, cvd: str | None, visible: Visibility) -> Check:
    """GPUs nvidia-smi lists vs GPUs torch sees, explained by CUDA_VISIBLE_DEVICES where it is set."""
    if not nvidia.found:
        if torch.device_count:
            return Check.warn(
                "gpus",
                f"torch sees {torch.device_count} GPU(s) but nvidia-smi is not installed",
                "install the NVIDIA utilities or put nvidia-smi on PATH: the GPU checks need it",
            )
        return Check.ok("gpus", "no GPU (nvidia-smi not found): jobs run on CPU processes with gloo")
    if nvidia.error:
        if "no devices" in nvidia.error.lower():
            return Check.warn(
                "gpus",
                "nvidia-smi found no GPU: jobs run on CPU processes with gloo",
                "in a container pass --gpus all (Docker) or request GPUs from the scheduler",
            )
        return Check.fail(
            "gpus",
            f"nvidia-smi failed: {nvidia.error}",
            "the driver is not loaded or does not match its kernel module: reboot after a driver update, "
            "check `dmesg | grep -i nvrm`",
        )
    listed, expected, seen = len(nvidia.gpus), len(visible.indices), torch.device_count
    evidence = f"nvidia-smi lists {listed}"
    if cvd is not None:
        evidence += f"; CUDA_VISIBLE_DEVICES={cvd!r} keeps {expected}"
        if visible.indices and expected < listed:
            evidence += f" ({', '.join(f'GPU{i}' for i in visible.indices)})"
    evidence += f"; torch sees {seen}"
    if expected and not torch.cuda_available:
        return Check.warn("gpus", evidence, "torch cannot use CUDA: see the torch check")
    if seen != expected:
        return Check.fail(
            "gpus",
            evidence,
            "CUDA misses a GPU: look for Xid / 'fallen off the bus' in dmesg and "
            "`nvidia-smi -q`, and for another process holding it in exclusive mode",
        )
    if not expected:
        return Check.warn(
            "gpus",
            evidence,
            "CUDA_VISIBLE_DEVICES hides every GPU, so jobs run on the CPU: unset it or list the GPUs to use",
        )
    if visible.ignored is not None:
        return Check.warn(
            "gpus",
            f"{evidence}; entry {visible.ignored!r} names no GPU",
            "CUDA stops reading CUDA_VISIBLE_DEVICES at the first bad entry: use indices or UUIDs "
            "from nvidia-smi -L, each once",
        )
    if cvd is not None and expected < listed:
        evidence += " (nvidia-smi ignores CUDA_VISIBLE_DEVICES)"
    return Check.ok("gpus", evidence)


def check_gpu_models(gpus: Sequence[Gpu]) -> Check:
    """Identical models and memory: a data-parallel job runs at its slowest GPU and fits its smallest one."""
    kinds = Counter((g.name, g.memory_mib) for g in gpus)
    described = ", ".join(f"{count}× {name} {_mib(memory)}" for (name, memory), count in kinds.items())
    if len(kinds) == 1:
        return Check.ok("gpu models", described)
    (name, memory), _ = kinds.most_common(1)[0]
    group = ",".join(str(g.index) for g in gpus if (g.name, g.memory_mib) == (name, memory))
    return Check.warn(
        "gpu models",
        described,
        f"a job runs at its slowest GPU and fits its smallest: use one model, e.g. "
        f"CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES={group}",
    )


def _mib(memory: int | None) -> str:
    return f"{memory} MiB" if memory is not None else "(memory unknown)"


_PATH_RANK = MappingProxyType({"PIX": 1, "PXB": 2, "PHB": 3, "NODE": 4, "SYS": 5, "SOC": 5})
"""Slower paths rank higher; NVLink ranks 0. 'SOC' is the name older drivers gave to SYS."""


def _path_rank(cell: str) -> int:
    return 0 if cell.startswith("NV") else _PATH_RANK.get(cell, 6)


def check_interconnect(gpus: Sequence[Gpu], links: Mapping[tuple[int, int], str]) -> Check:
    """NVLink or PCIe between every pair of GPUs (``nvidia-smi topo -m``)."""
    indices = [g.index for g in gpus]
    if len(indices) < 2:
        return Check.ok("interconnect", "1 GPU: no GPU-to-GPU traffic")
    pairs = list(combinations(indices, 2))
    cells = {p: links.get(p) for p in pairs}
    if any(cell is None for cell in cells.values()):
        return Check.warn(
            "interconnect",
            "nvidia-smi topo -m gave no matrix for these GPUs",
            "run `nvidia-smi topo -m` by hand; an old driver or a container may hide the topology",
        )
    summary = f"{len(pairs)} pair(s): " + ", ".join(f"{c}×{n}" for c, n in Counter(cells.values()).most_common())
    (a, b), worst = max(cells.items(), key=lambda item: _path_rank(item[1]))
    if _path_rank(worst) <= _PATH_RANK["PXB"]:
        return Check.ok("interconnect", summary)
    fix = (
        "all-reduce goes at the slowest path, here through the CPU: use GPUs on NVLink or one PCIe switch, "
        "or communicate less (accumulate gradients)"
    )
    group = _nvlink_group(indices, cells)
    if group:
        fix += f"; NVLink joins CUDA_VISIBLE_DEVICES={','.join(map(str, group))}"
    return Check.warn("interconnect", f"{summary}; slowest GPU{a}-GPU{b} {worst}", fix)


def _nvlink_group(indices: Sequence[int], cells: Mapping[tuple[int, int], str]) -> list[int]:
    """The largest set of GPUs (≥ 2) where every pair has NVLink, or []."""
    best: list[int] = []
    for i in indices:
        group = [i] + [j for j in indices if j != i and cells.get((min(i, j), max(i, j)), "").startswith("NV")]
        if all(cells[(x, y)].startswith("NV") for x, y in combinations(sorted(group), 2)) and len(group) > len(best):
            best = sorted(group)
    return best if len(best) > 1 else []


def pcie_gbps(gen: int | None, width: int | None) -> float | None:
    """Usable GB/s per direction of a PCIe link."""
    if gen is None or width is None or gen not in PCIE_LANE_GBPS:
        return None
    return PCIE_LANE_GBPS[gen] * width


def check_pcie(gpus: Sequence[Gpu]) -> Check:
    """PCIe generation and width of each GPU's link (host↔GPU copies, and GPU↔GPU traffic without NVLink).

    The *current* generation drops at idle to save power, so it is reported but never judged; the link is
    judged at its maximum generation and current width.
    """
    known = [g for g in gpus if pcie_gbps(g.pcie_gen_max, g.pcie_width) is not None]
    if not known:
        return Check.warn("pcie", "nvidia-smi reported no PCIe link data", "run `nvidia-smi -q -d PCIE` by hand")
    problems = []
    for g in known:
        speed = pcie_gbps(g.pcie_gen_max, g.pcie_width) or 0.0
        if g.pcie_width_max and g.pcie_width < g.pcie_width_max:
            problems.append(f"GPU{g.index} x{g.pcie_width} of x{g.pcie_width_max}")
        elif speed < SLOW_PCIE_GBPS:
            problems.append(f"GPU{g.index} gen{g.pcie_gen_max} x{g.pcie_width} ≈{speed:.1f} GB/s")
    links = Counter((g.pcie_gen_max, g.pcie_width) for g in known)
    evidence = ", ".join(
        f"{n}× gen{gen} x{width} ({pcie_gbps(gen, width):.0f} GB/s)" for (gen, width), n in links.most_common()
    )
    idle = [g for g in known if g.pcie_gen is not None and g.pcie_gen < (g.pcie_gen_max or 0)]
    if idle:
        evidence += f"; {len(idle)} at a lower gen now (idle power saving)"
    if problems:
        return Check.warn(
            "pcie",
            "; ".join(problems),
            "if it stays so under load, the slot caps host↔GPU copies: move the GPU to an x16 slot, "
            "check risers and BIOS bifurcation",
        )
    return Check.ok("pcie", evidence)
