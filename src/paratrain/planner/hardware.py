"""The hardware catalogue: devices, links and the cluster a plan is made for.

Figures are vendors' dense (no sparsity) peak numbers; what a training step sustains is the peak times an
MFU-like efficiency (``mfu``), which ``calibrated`` can set from one measured step. Memory is in GiB (2**30
bytes, what ``nvidia-smi`` and ``torch.cuda.mem_get_info`` report); bandwidth in GB/s (1e9 bytes/s), one
direction, as collectives use it. Every figure can be overridden (``make_cluster`` and ``paratrain plan``'s
``--gpu-mem-gb``, ``--tflops``, ``--mfu``, ``--intra-bw-gbs``, ``--inter-bw-gbs``).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from types import MappingProxyType

from ..errors import ConfigError

GIB = 2**30
GB = 1e9


@dataclass(frozen=True, kw_only=True)
class Device:
    """One accelerator (or, for ``cpu``, one host whose cores all ranks on it share)."""

    name: str
    """Catalogue name."""
    memory_gib: float
    """Memory one rank may use; for a shared host, the whole host's RAM."""
    bf16_tflops: float
    """Dense peak for bf16/fp16 tensor-core matmuls (TFLOP/s); the mixed-precision compute rate."""
    fp32_tflops: float
    """Dense peak for plain fp32 (no TF32: PyTorch's default for matmuls since 1.12)."""
    mfu: float = 0.4
    """Sustained fraction of peak over a training step (model FLOPs utilisation); 30-50% is typical for
    well-tuned transformer training on GPUs."""
    overhead_gib: float = 0.75
    """Memory no tensor of the model accounts for: CUDA context (~0.3-0.5 GiB), cuBLAS/NCCL workspaces and
    allocator slack; for a CPU rank, the process with torch imported (~0.25 GiB measured)."""
    intra_link: str = "pcie4"
    """Catalogue name of the link between devices of one node."""
    inter_link: str = "eth-100g"
    """Catalogue name of the link between nodes."""
    overlap: float = 0.8
    """Fraction of backward (or forward+backward for FSDP prefetch) time that can hide gradient/parameter
    communication. GPUs run NCCL on a separate stream; a CPU rank's gloo threads compete with compute."""
    shared_by_ranks: bool = False
    """True for a CPU host: ranks on a node split its compute and memory instead of owning one device each."""

    def __post_init__(self) -> None:
        for name in ("memory_gib", "bf16_tflops", "fp32_tflops", "mfu"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"device {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.mfu > 1:
            raise ConfigError(f"device {self.name}: mfu is a fraction of peak, must be <= 1, got {self.mfu}")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"device {self.name}: overlap must be in [0, 1], got {self.overlap}")
        if self.overhead_gib < 0:
            raise ConfigError(f"device {self.name}: overhead_gib must be >= 0, got {self.overhead_gib}")

    def peak_tflops(self, precision: str) -> float:
        return self.fp32_tflops if precision == "fp32" else self.bf16_tflops


@dataclass(frozen=True, kw_only=True)
class Link:
    """A connection collectives run over, as an alpha-beta model: time = latency + bytes / bandwidth."""

    name: str
    bandwidth_gbs: float
    """Bandwidth per rank in one direction (GB/s). For an inter-node link: what one node injects."""
    latency_us: float = 5.0
    """Per-message latency (microseconds); a ring collective pays it once per step of the ring."""
    p2p_gbs: float | None = None
    """Point-to-point bandwidth when it differs from the collectives' (gloo over loopback)."""

    def __post_init__(self) -> None:
        if not self.bandwidth_gbs > 0:
            raise ConfigError(f"link {self.name}: bandwidth must be > 0 GB/s, got {self.bandwidth_gbs}")
        if self.latency_us < 0:
            raise ConfigError(f"link {self.name}: latency must be >= 0, got {self.latency_us}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * GB

    @property
    def p2p_bytes_per_s(self) -> float:
        return (self.p2p_gbs or self.bandwidth_gbs) * GB


def _pcie(gen: int, lanes: int) -> Link:
    # ~0.985 GB/s per lane per direction at gen3 (8 GT/s, 128b/130b), doubling each generation.
    return Link(name=f"pcie{gen}" + ("" if lanes == 16 else f"-x{lanes}"),
                bandwidth_gbs=round(0.985 * 2 ** (gen - 3) * lanes, 1), latency_us=5.0)


def _ethernet(gbit: int, roce: bool) -> Link:
    return Link(name=f"{'roce' if roce else 'eth'}-{gbit}g", bandwidth_gbs=gbit / 8, latency_us=5.0 if roce else 25.0)


DEVICES = MappingProxyType({d.name: d for d in (
    Device(name="a100-40gb", memory_gib=40, bf16_tflops=312, fp32_tflops=19.5, intra_link="nvlink3",
           inter_link="ib-hdr"),
    Device(name="a100-80gb", memory_gib=80, bf16_tflops=312, fp32_tflops=19.5, intra_link="nvlink3",
           inter_link="ib-hdr"),
    Device(name="h100-80gb", memory_gib=79.6, bf16_tflops=989, fp32_tflops=67, intra_link="nvlink4",
           inter_link="ib-ndr"),
    Device(name="h200-141gb", memory_gib=140.4, bf16_tflops=989, fp32_tflops=67, intra_link="nvlink4",
           inter_link="ib-ndr"),
    Device(name="l4", memory_gib=22.5, bf16_tflops=121, fp32_tflops=30.3, overhead_gib=0.6),
    Device(name="rtx-4090", memory_gib=24, bf16_tflops=165, fp32_tflops=82.6, overhead_gib=0.6),
)})
"""GPUs (SXM versions where there is a choice). Memory as ``nvidia-smi`` reports it."""

DEVICE_ALIASES = MappingProxyType({"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb",
                                   "4090": "rtx-4090", "rtx4090": "rtx-4090"})

CPU_GFLOPS_PER_CORE = 96.0
"""Peak fp32 GFLOP/s of one x86 core with two 256-bit FMA units at ~3 GHz (32 FLOP/cycle). An MLP's forward and
backward sustained 77-96 GFLOP/s on one core of the 2-core EPYC this was written on; with ``mfu=0.5`` the
default plans ~48 GFLOP/s per core, leaving room for the elementwise work a transformer adds."""

LINKS = MappingProxyType({link.name: link for link in (
    # NVLink: A100 600 GB/s and H100 900 GB/s in total, both directions: half each way.
    Link(name="nvlink3", bandwidth_gbs=300, latency_us=3.0),
    Link(name="nvlink4", bandwidth_gbs=450, latency_us=3.0),
    *(_pcie(gen, lanes) for gen in (3, 4, 5) for lanes in (16, 8, 4)),
    # InfiniBand, one port per node: HDR 200 Gb/s, NDR 400 Gb/s. Nodes with one NIC per GPU: --inter-bw-gbs.
    Link(name="ib-hdr", bandwidth_gbs=25, latency_us=2.0),
    Link(name="ib-ndr", bandwidth_gbs=50, latency_us=2.0),
    *(_ethernet(g, roce=False) for g in (10, 25, 100, 200, 400)),
    *(_ethernet(g, roce=True) for g in (10, 25, 100, 200, 400)),
    # gloo between processes of one host: all-reduce 1.0-1.5 GB/s, point-to-point 3-4 GB/s (FIELD-NOTES).
    Link(name="loopback-gloo", bandwidth_gbs=1.2, latency_us=100.0, p2p_gbs=3.5),
)})
"""Links by name. PCIe names without a lane count are x16 (``pcie4``); others name it (``pcie4-x8``)."""


def cpu_host(*, cores: int | None = None, memory_gib: float | None = None) -> Device:
    """This machine's class: memory is host RAM, compute ``CPU_GFLOPS_PER_CORE`` x cores, ranks share both."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    tflops = cores * CPU_GFLOPS_PER_CORE / 1000
    return Device(name="cpu", memory_gib=memory_gib, bf16_tflops=tflops, fp32_tflops=tflops, mfu=0.5,
                  overhead_gib=0.25, intra_link="loopback-gloo", inter_link="eth-10g", overlap=0.0,
                  shared_by_ranks=True)


def device_names() -> list[str]:
    return [*DEVICES, "cpu"]


def get_device(name: str) -> Device:
    """The catalogue device called ``name`` (case-insensitive; ``h100`` is ``h100-80gb``)."""
    key = name.lower()
    key = DEVICE_ALIASES.get(key, key)
    if key == "cpu":
        return cpu_host()
    if key not in DEVICES:
        raise ConfigError(f"unknown GPU {name!r}; choose one of: {', '.join(device_names())} "
                          "(or take the closest and override --gpu-mem-gb/--tflops)")
    return DEVICES[key]


def get_link(name: str, device: Device) -> Link:
    """The catalogue link called ``name``; ``nvlink`` means the device's own generation."""
    key = name.lower()
    if key == "nvlink":
        if not device.intra_link.startswith("nvlink"):
            raise ConfigError(f"{device.name} has no NVLink; use --interconnect pcie4 (or another pcie*)")
        key = device.intra_link
    if key not in LINKS:
        raise ConfigError(f"unknown link {name!r}; choose one of: nvlink, {', '.join(LINKS)}")
    return LINKS[key]


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Identical nodes of ``ranks_per_node`` devices (or, on a CPU host, processes)."""

    device: Device
    ranks_per_node: int = 1
    nodes: int = 1
    intra: Link
    """Between ranks of one node."""
    inter: Link
    """Between nodes (unused when ``nodes == 1``)."""

    def __post_init__(self) -> None:
        if self.ranks_per_node < 1:
            raise ConfigError(f"--gpus must be >= 1, got {self.ranks_per_node}")
        if self.nodes < 1:
            raise ConfigError(f"--nodes must be >= 1, got {self.nodes}")

    @property
    def world_size(self) -> int:
        return self.ranks_per_node * self.nodes

    def share(self, ranks_per_node: int) -> float:
        """The fraction of one device a rank owns when ``ranks_per_node`` ranks run per node."""
        return 1 / ranks_per_node if self.device.shared_by_ranks else 1.0

    def memory_bytes(self, ranks_per_node: int | None = None) -> float:
        """Memory one rank may use."""
        return self.device.memory_gib * GIB * self.share(ranks_per_node or self.ranks_per_node)

    def flops_per_s(self, precision: str, ranks_per_node: int | None = None) -> float:
        """Sustained FLOP/s of one rank: peak x MFU, split among ranks on a shared host."""
        d = self.device
        return d.peak_tflops(precision) * 1e12 * d.mfu * self.share(ranks_per_node or self.ranks_per_node)

    def link_for(self, size: int, stride: int) -> Link:
        """The link a group of ``size`` ranks, ``stride`` apart, is limited by.

        A group within a node uses the intra-node link. One spanning nodes is limited by the inter-node link,
        which the ``min(stride, ranks_per_node)`` groups of a node that cross it at once share: a ring of
        consecutive ranks crosses each node boundary once, while HSDP's replica groups (one per local rank)
        and a hybrid's stage-to-stage sends all cross it together.
        """
        if self.nodes == 1 or size * stride <= self.ranks_per_node:
            return self.intra
        sharers = min(stride, self.ranks_per_node)
        if sharers == 1:
            return self.inter
        p2p = self.inter.p2p_gbs / sharers if self.inter.p2p_gbs else None
        return replace(self.inter, name=f"{self.inter.name} / {sharers}",
                       bandwidth_gbs=self.inter.bandwidth_gbs / sharers, p2p_gbs=p2p)


def make_cluster(gpu: str = "h100", *, gpus: int = 1, nodes: int = 1, interconnect: str | None = None,
                 inter_node: str | None = None, gpu_mem_gb: float | None = None, tflops: float | None = None,
                 mfu: float | None = None, intra_bw_gbs: float | None = None,
                 inter_bw_gbs: float | None = None) -> Cluster:
    """A cluster from catalogue names and optional overrides (``tflops`` replaces both peaks)."""
    device = get_device(gpu)
    changes: dict[str, float] = {}
    if gpu_mem_gb is not None:
        changes["memory_gib"] = gpu_mem_gb
    if tflops is not None:
        changes.update(bf16_tflops=tflops, fp32_tflops=tflops)
    if mfu is not None:
        changes["mfu"] = mfu
    device = replace(device, **changes)
    intra = get_link(interconnect or device.intra_link, device)
    inter = get_link(inter_node or device.inter_link, device)
    if intra_bw_gbs is not None:
        intra = replace(intra, name=f"{intra.name} (override)", bandwidth_gbs=intra_bw_gbs, p2p_gbs=None)
    if inter_bw_gbs is not None:
        inter = replace(inter, name=f"{inter.name} (override)", bandwidth_gbs=inter_bw_gbs, p2p_gbs=None)
    return Cluster(device=device, ranks_per_node=gpus, nodes=nodes, intra=intra, inter=inter)


def calibrated(cluster: Cluster, *, flops_per_step: float, step_time_s: float, precision: str) -> Cluster:
    """The cluster with its device's MFU set so that one rank alone runs ``flops_per_step`` in ``step_time_s``.

    A measured single-device step is the best predictor of the sustained rate; the catalogue peak only
    fixes the scale. Raises when the measurement implies more than the catalogue peak (raise --tflops).
    """
    if step_time_s <= 0:
        raise ConfigError(f"--step-time must be > 0 seconds, got {step_time_s}")
    peak = cluster.device.peak_tflops(precision) * 1e12
    mfu = flops_per_step / step_time_s / peak
    if mfu > 1:
        raise ConfigError(f"a {step_time_s} s step means {flops_per_step / step_time_s / 1e12:.1f} TFLOP/s, above "
                          f"{cluster.device.name}'s peak {peak / 1e12:g}; check --step-time or raise --tflops")
    return replace(cluster, device=replace(cluster.device, mfu=mfu))
