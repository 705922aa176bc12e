"""The hardware catalogue: devices, links and the cluster a plan is made for.

Figures are vendors' dense (no sparsity) peak numbers; what a training step sustains is the peak times an
MFU-like efficiency (``mfu``), which ``calibrated`` can set from one measured step. Memory is in GiB (2**30
bytes, what ``nvidia-smi`` and ``torch.cuda.mem_get_info`` report); bandwidth in GB/s (1e9 bytes/s), one
direction, as collectives use it. Every figure can be overridden (``make_cluster`` and ``paratrain plan``'s
``--gpu-mem-gb``, ``--tflops``, ``--mfu``, ``--mem-bw-gbs``, ``--intra-bw-gbs``, ``--inter-bw-gbs``), and a
link's per-collective figures can be set from a measurement (``measured_link``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from types import MappingProxyType

from ..errors import ConfigError
from ..sizes import GIB

GB = 1e9

PS_SERVER_REQUEST_S = 0.75e-3
"""A parameter server's time per request (``Device.ps_server_request_s``): the mean of its own ``busy_s`` per
request, 649-863 us in seven runs of ``benchmarks/ps_messages.py`` (1 worker + 1 server, one thread each, tiny
``pull_dense`` and 4-row ``pull_rows`` requests, 2,002 served a run; ``benchmarks/ps-messages-2026-11-25.json``),
2026-11-25 18:14-18:19 UTC on the quiet 2-core EPYC this was written on (torch 2.13 CPU, gloo), run as
``PYTHONPATH=src .venv/bin/python benchmarks/ps_messages.py``. The mean, not the median: a step adds its requests
up, and the round trips have a long tail (median 380-700 us, mean 0.76-1.7 ms, p99 4-8 ms)."""
PS_WORKER_REQUEST_S = 0.3e-3
"""A worker's time per request (``Device.ps_worker_request_s``): the same runs' mean round trip less the raw gloo
ping-pong of a header (86-110 us, the two messages the link's latency prices) and the server's busy time, 251-373
us."""


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
    memory_gbs: float
    """Memory bandwidth streaming kernels sustain (GB/s): what the optimizer step and a forward/backward's
    reads of the weights run at. For a shared CPU host, the whole host's."""
    weight_passes: float = 3.0
    """Times a forward+backward streams the weights whatever the batch: read in forward, read in backward for
    the input gradient, gradient written (cuBLAS reads the operands in place). CPU BLAS also packs the weight
    operand of each matrix product into panels first, which makes it about twice as many."""
    mfu: float = 0.4
    """Sustained fraction of peak. Catalogue GPUs: what the matrix products reach (``MATMUL_EFFICIENCY``), with
    the elementwise work priced apart (``activation_passes``); otherwise, and once calibrated from a measured step
    or given with ``--mfu``, the whole step's (model FLOPs utilisation; 30-50% is typical for well-tuned
    transformer training on GPUs)."""
    activation_passes: float = 0.0
    """Memory passes a forward+backward makes over the activations it saves, for its elementwise work (norms,
    activation functions, residual adds, casts, rotary embeddings, the loss), at ``memory_gbs``. With it, ``mfu``
    is what the matrix products alone sustain; 0 folds that work into ``mfu``, as a measured calibration does."""
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
    cores: int | None = None
    """A CPU host's cores. Its processes share them: each of N gets cores/N of the host's compute and memory
    bandwidth, so beyond one process per core (oversubscription) a process computes N/cores times slower."""
    core_speedup: float | None = None
    """What all of a CPU host's cores compute together over one of them; default: the number of cores. Measured
    (``calibrated``'s ``host_step``) it is often less: cores share caches, memory channels or a physical core."""
    fsdp_call_s: float = 0.0
    """Seconds of FSDP's own machinery per wrap unit and collective call (all-gather or reduce-scatter), per
    micro-batch, beyond the copies the time model counts: its pre/post forward and backward hooks, DTensor
    bookkeeping and the sharded optimizer step's per-tensor work. Host-side Python, one thread: on a CPU host it is
    one core's time (``calibrated`` sets it from FSDP timed on a one-rank group against a plain step); on GPUs it
    runs ahead of the kernels it queues, so the catalogue leaves it at 0."""
    tp_call_s: float = 0.0
    """Seconds of DTensor's own machinery per tensor-parallel collective call, per micro-batch: the sharding
    propagation, redistribution and dispatch of the DTensor operations between two collectives. Host-side Python
    like ``fsdp_call_s``, set the same way on a CPU host (``Measured.tp_step_time``: a TP step on a fake
    group, where collectives return at once, against the plan's compute); 0 in the catalogue."""
    ps_server_request_s: float = PS_SERVER_REQUEST_S
    """Seconds a parameter server's loop spends on one request beyond its bytes and the link's latency: header
    parse, schema check, payload receive and unpack, the reply's ``isend``. A server answers one request at a time
    (asynchronous servers' threads take turns under one lock), so the busiest server pays it W x (requests per worker
    per step) times a step. Default ``PS_SERVER_REQUEST_S``, measured on a CPU host; the catalogue GPUs take the same:
    their servers are host processes running the same loop."""
    ps_worker_request_s: float = PS_WORKER_REQUEST_S
    """Seconds a worker's client spends on one request and its answer beyond the server's and the link's (packing,
    the header checks, copying the answer into place); default ``PS_WORKER_REQUEST_S``, as the server's."""

    def __post_init__(self) -> None:
        for name in ("memory_gib", "bf16_tflops", "fp32_tflops", "mfu", "memory_gbs"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"device {self.name}: {name} must be > 0, got {getattr(self, name)}")
        if self.mfu > 1:
            raise ConfigError(f"device {self.name}: mfu is a fraction of peak, must be <= 1, got {self.mfu}")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"device {self.name}: overlap must be in [0, 1], got {self.overlap}")
        if self.overhead_gib < 0:
            raise ConfigError(f"device {self.name}: overhead_gib must be >= 0, got {self.overhead_gib}")
        if self.weight_passes < 0:
            raise ConfigError(f"device {self.name}: weight_passes must be >= 0, got {self.weight_passes}")
        if self.core_speedup is not None and not self.core_speedup > 0:
            raise ConfigError(f"device {self.name}: core_speedup must be > 0, got {self.core_speedup}")
        for name in ("fsdp_call_s", "tp_call_s", "ps_server_request_s", "ps_worker_request_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"device {self.name}: {name} must be >= 0, got {getattr(self, name)}")

    def peak_tflops(self, precision: str) -> float:
        return self.fp32_tflops if precision == "fp32" else self.bf16_tflops

    def serial_slowdown(self, ranks: int) -> float:
        """How much slower one-threaded host work (Python, hooks) runs per rank than on one idle core: 1 on a GPU;
        on a CPU host, ranks / ``core_speedup`` when that is more than 1 (each rank gets 1/ranks of what the
        cores compute together)."""
        if not self.shared_by_ranks or not self.cores:
            return 1.0
        return max(1.0, ranks / (self.core_speedup or self.cores))


@dataclass(frozen=True, kw_only=True)
class Link:
    """A connection collectives run over, as an alpha-beta model: time = latency + bytes / bandwidth.

    ``bandwidth_gbs`` is the all-reduce's bus bandwidth (what ``paratrain doctor`` and nccl-tests report as
    busbw). The other collectives reach a fraction of it, their efficiency: about 1 for NCCL's rings (nccl-tests
    report similar busbw for all of them), far from 1 for gloo, whose all-gather and reduce-scatter are not
    rings and run 2-5x slower than its all-reduce on the same bytes.
    """

    name: str
    bandwidth_gbs: float
    """All-reduce bus bandwidth per rank in one direction (GB/s). For an inter-node link: what one node injects."""
    latency_us: float = 5.0
    """Per-message latency (microseconds); a ring collective pays it once per step of the ring."""
    p2p_gbs: float | None = None
    """Point-to-point bandwidth when it differs from the collectives' (gloo over loopback)."""
    p2p_latency_us: float | None = None
    """Point-to-point latency when it differs from the collectives' (measured apart: a blocking send waits for
    its receiver to be scheduled, which on an oversubscribed CPU host costs milliseconds)."""
    all_gather_eff: float = 1.0
    """All-gather's bus bandwidth over the all-reduce's."""
    reduce_scatter_eff: float = 1.0
    """Reduce-scatter's bus bandwidth over the all-reduce's."""
    broadcast_eff: float = 1.0
    """Broadcast's bus bandwidth (bytes broadcast / time) over the all-reduce's."""
    call_us: float | None = None
    """What one more call adds when a collective's bytes are split into one call per FSDP wrap unit (microseconds).
    None: a ring's latency per step, (N−1)·``latency_us``. Measured apart because on an oversubscribed CPU host a
    call costs far more than its ring steps' latency: every call waits for each rank to be scheduled."""

    def __post_init__(self) -> None:
        if not self.bandwidth_gbs > 0:
            raise ConfigError(f"link {self.name}: bandwidth must be > 0 GB/s, got {self.bandwidth_gbs}")
        for name in ("latency_us", "p2p_latency_us", "call_us"):
            if (getattr(self, name) or 0) < 0:
                raise ConfigError(f"link {self.name}: {name} must be >= 0, got {getattr(self, name)}")
        for name in ("all_gather_eff", "reduce_scatter_eff", "broadcast_eff"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"link {self.name}: {name} must be > 0, got {getattr(self, name)}")

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbs * GB

    @property
    def p2p_bytes_per_s(self) -> float:
        return (self.p2p_gbs or self.bandwidth_gbs) * GB

    @property
    def p2p_latency_s(self) -> float:
        return (self.latency_us if self.p2p_latency_us is None else self.p2p_latency_us) * 1e-6

    def call_s(self, ranks: int) -> float:
        """Seconds one more collective call costs on ``ranks`` ranks, beyond its bytes (see ``call_us``)."""
        return ((ranks - 1) * self.latency_us if self.call_us is None else self.call_us) * 1e-6


def _pcie(gen: int, lanes: int) -> Link:
    # ~0.985 GB/s per lane per direction at gen3 (8 GT/s, 128b/130b), doubling each generation.
    return Link(
        name=f"pcie{gen}" + ("" if lanes == 16 else f"-x{lanes}"),
        bandwidth_gbs=round(0.985 * 2 ** (gen - 3) * lanes, 1),
        latency_us=5.0,
    )


def _ethernet(gbit: int, roce: bool) -> Link:
    return Link(name=f"{'roce' if roce else 'eth'}-{gbit}g", bandwidth_gbs=gbit / 8, latency_us=5.0 if roce else 25.0)


MATMUL_EFFICIENCY = 0.7
"""What large bf16 matrix products sustain of the dense peak on A100/H100-class GPUs (cuBLAS reaches 80-90% on an
A100 and 60-75% on an H100 SXM in isolation); the rest of a step is priced apart: elementwise work
(``ACTIVATION_PASSES``), weights streamed, communication, bubbles."""
ACTIVATION_PASSES = 12.0
"""Memory passes over the saved activations a forward+backward of eager PyTorch makes (each unfused elementwise
kernel reads and writes its activation-sized operands, forward and backward). With the two, the sustained
fraction of peak falls with the model's width as measured: elementwise traffic grows with h per token, matmul FLOPs
with h² (GPT-2 on an H100 reaches 0.13-0.3, a 70B model 0.5-0.6: benchmarks/RESULTS.md §19 and §24)."""

DEVICES = MappingProxyType(
    {
        d.name: d
        for d in (
            Device(
                name="a100-40gb",
                memory_gib=40,
                bf16_tflops=312,
                fp32_tflops=19.5,
                memory_gbs=1555,
                intra_link="nvlink3",
                mfu=MATMUL_EFFICIENCY,
                activation_passes=ACTIVATION_PASSES,
                inter_link="ib-hdr",
            ),
            Device(
                name="a100-80gb",
                memory_gib=80,
                bf16_tflops=312,
                fp32_tflops=19.5,
                memory_gbs=2039,
                intra_link="nvlink3",
                mfu=MATMUL_EFFICIENCY,
                activation_passes=ACTIVATION_PASSES,
                inter_link="ib-hdr",
            ),
            Device(
                name="h100-80gb",
                memory_gib=79.6,
                bf16_tflops=989,
                fp32_tflops=67,
                memory_gbs=3350,
                intra_link="nvlink4",
                mfu=MATMUL_EFFICIENCY,
                activation_passes=ACTIVATION_PASSES,
                inter_link="ib-ndr",
            ),
            Device(
                name="h200-141gb",
                memory_gib=140.4,
                bf16_tflops=989,
                fp32_tflops=67,
                memory_gbs=4800,
                intra_link="nvlink4",
                mfu=MATMUL_EFFICIENCY,
                activation_passes=ACTIVATION_PASSES,
                inter_link="ib-ndr",
            ),
            Device(name="l4", memory_gib=22.5, bf16_tflops=121, fp32_tflops=30.3, memory_gbs=300, overhead_gib=0.6),
            Device(
                name="rtx-4090", memory_gib=24, bf16_tflops=165, fp32_tflops=82.6, memory_gbs=1008, overhead_gib=0.6
            ),
        )
    }
)
"""GPUs (SXM versions where there is a choice). Memory as ``nvidia-smi`` reports it; bandwidth the vendor's."""

DEVICE_ALIASES = MappingProxyType(
    {"a100": "a100-80gb", "h100": "h100-80gb", "h200": "h200-141gb", "4090": "rtx-4090", "rtx4090": "rtx-4090"}
)

CPU_GFLOPS_PER_CORE = 128.0
"""Peak fp32 GFLOP/s of one x86 core with two 256-bit FMA units (32 FLOP/cycle) at a 4 GHz boost clock. An MLP's
forward and backward sustained 77-96 GFLOP/s on one core of the 2-core EPYC this was written on, so the default
``mfu=0.6`` plans ~77 GFLOP/s per core; ``calibrated`` replaces it with a measured step."""
CPU_MEMORY_GBS_PER_CORE = 20.0
"""What one core streams through PyTorch's optimizer kernels (GB/s): a 3.96M-parameter Adam step (72 bytes per
parameter, see ``training.OPTIMIZER_STEP_BYTES``) took 13-14 ms on one thread of that EPYC."""
CPU_WEIGHT_PASSES = 7.0
"""Weight passes of a CPU forward+backward: that MLP's step time is affine in the batch (8-128 samples, one
thread), with 5-6 ms at batch 0 — seven passes over its 15.8 MB of weights at 20 GB/s."""

GLOO_ALL_GATHER_EFF, GLOO_REDUCE_SCATTER_EFF, GLOO_BROADCAST_EFF = 0.4, 0.3, 2.0
"""gloo on one host, world 2, 15.8 MB: all-reduce 10.6-15 ms, all-gather 15.8-24 ms, reduce-scatter 20.6-37 ms,
broadcast 6.1 ms (``benchmarks/planner_accuracy.py``'s link calibration and its probe; the larger times under
load). gloo broadcasts from the root to each peer in turn, so its broadcast efficiency falls as 1/(N-1)."""

LINKS = MappingProxyType(
    {
        link.name: link
        for link in (
            # NVLink: A100 600 GB/s and H100 900 GB/s in total, both directions: half each way.
            Link(name="nvlink3", bandwidth_gbs=300, latency_us=3.0),
            Link(name="nvlink4", bandwidth_gbs=450, latency_us=3.0),
            *(_pcie(gen, lanes) for gen in (3, 4, 5) for lanes in (16, 8, 4)),
            # InfiniBand, one port per node: HDR 200 Gb/s, NDR 400 Gb/s. Nodes with one NIC per GPU: --inter-bw-gbs.
            Link(name="ib-hdr", bandwidth_gbs=25, latency_us=2.0),
            Link(name="ib-ndr", bandwidth_gbs=50, latency_us=2.0),
            # Eight ports per node, one per GPU (DGX A100 / H100 and the like: NVIDIA's "rail-optimised" nodes).
            Link(name="ib-hdr-x8", bandwidth_gbs=200, latency_us=2.0),
            Link(name="ib-ndr-x8", bandwidth_gbs=400, latency_us=2.0),
            *(_ethernet(g, roce=False) for g in (10, 25, 100, 200, 400)),
            *(_ethernet(g, roce=True) for g in (10, 25, 100, 200, 400)),
            # gloo between processes of one host: all-reduce 1.0-1.5 GB/s, point-to-point 3-4 GB/s (FIELD-NOTES);
            # all-gather, reduce-scatter and broadcast of 15.8 MB at world 2 against the all-reduce
            # (docs/planner-model.md).
            Link(
                name="loopback-gloo",
                bandwidth_gbs=1.2,
                latency_us=100.0,
                p2p_gbs=3.5,
                all_gather_eff=GLOO_ALL_GATHER_EFF,
                reduce_scatter_eff=GLOO_REDUCE_SCATTER_EFF,
                broadcast_eff=GLOO_BROADCAST_EFF,
            ),
        )
    }
)
"""Links by name. PCIe names without a lane count are x16 (``pcie4``); others name it (``pcie4-x8``)."""


def cpu_host(*, cores: int | None = None, memory_gib: float | None = None) -> Device:
    """This machine's class: memory is host RAM, compute ``CPU_GFLOPS_PER_CORE`` x cores and memory bandwidth
    ``CPU_MEMORY_GBS_PER_CORE`` x cores; ranks share all three."""
    cores = cores if cores is not None else len(os.sched_getaffinity(0))
    if memory_gib is None:
        memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    tflops = cores * CPU_GFLOPS_PER_CORE / 1000
    return Device(
        name="cpu",
        memory_gib=memory_gib,
        bf16_tflops=tflops,
        fp32_tflops=tflops,
        mfu=0.6,
        memory_gbs=cores * CPU_MEMORY_GBS_PER_CORE,
        weight_passes=CPU_WEIGHT_PASSES,
        overhead_gib=0.25,
        intra_link="loopback-gloo",
        inter_link="eth-10g",
        overlap=0.0,
        shared_by_ranks=True,
        cores=cores,
    )


def device_names() -> list[str]:
    return [*DEVICES, "cpu"]


def get_device(name: str) -> Device:
    """The catalogue device called ``name`` (case-insensitive; ``h100`` is ``h100-80gb``)."""
    key = name.lower()
    key = DEVICE_ALIASES.get(key, key)
    if key == "cpu":
        return cpu_host()
    if key not in DEVICES:
        raise ConfigError(
            f"unknown GPU {name!r}; choose one of: {', '.join(device_names())} "
            "(or take the closest and override --gpu-mem-gb/--tflops)"
        )
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

    def stream_bytes_per_s(self, ranks_per_node: int | None = None) -> float:
        """Memory bandwidth of one rank, split among ranks on a shared host."""
        return self.device.memory_gbs * GB * self.share(ranks_per_node or self.ranks_per_node)

    def node_degrees(self, why_not: Callable[[int], str | None]) -> tuple[int, ...]:
        """The powers of two from 2 up to a node's ranks that divide it and that ``why_not`` (a model shape's
        refusal of a degree) accepts: the degrees the planner tries for a group kept within one node (tp, ep)."""
        degrees, d = [], 2
        while d <= self.ranks_per_node:
            if self.ranks_per_node % d == 0 and why_not(d) is None:
                degrees.append(d)
            d *= 2
        return tuple(degrees)

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
        return replace(
            self.inter,
            name=f"{self.inter.name} / {sharers}",
            bandwidth_gbs=self.inter.bandwidth_gbs / sharers,
            p2p_gbs=p2p,
        )


def degree_to_plan(flag: str, value: int | None, shape: object | None, missing: str) -> bool:
    """Whether a degree flag (``--tp``, ``--ep``, ``--cp``: ``value``, None when not given) leaves degrees to plan
    for a model whose shape for it is ``shape``: not at 1 (none asked), nor for a model without the shape unless
    asked; one line for a value below 1, and for a value asked of a model without the shape (``missing``: why, the
    rest of that line)."""
    if value is not None and value < 1:
        raise ConfigError(f"--{flag} must be >= 1, got {value}")
    if value == 1:
        return False
    if shape is None and value is not None:
        raise ConfigError(f"--{flag} {missing}")
    return shape is not None


def make_cluster(
    gpu: str = "h100",
    *,
    gpus: int = 1,
    nodes: int = 1,
    interconnect: str | None = None,
    inter_node: str | None = None,
    gpu_mem_gb: float | None = None,
    tflops: float | None = None,
    mfu: float | None = None,
    mem_bw_gbs: float | None = None,
    intra_bw_gbs: float | None = None,
    inter_bw_gbs: float | None = None,
) -> Cluster:
    """A cluster from catalogue names and optional overrides (``tflops`` replaces both peaks)."""
    device = get_device(gpu)
    changes: dict[str, float] = {}
    if mem_bw_gbs is not None:
        changes["memory_gbs"] = mem_bw_gbs
    if gpu_mem_gb is not None:
        changes["memory_gib"] = gpu_mem_gb
    if tflops is not None:
        changes.update(bf16_tflops=tflops, fp32_tflops=tflops)
    if mfu is not None:  # a whole step's fraction of peak: the elementwise work is in it
        changes.update(mfu=mfu, activation_passes=0.0)
    device = replace(device, **changes)
    intra = get_link(interconnect or device.intra_link, device)
    inter = get_link(inter_node or device.inter_link, device)
    if intra_bw_gbs is not None:
        intra = replace(intra, name=f"{intra.name} (override)", bandwidth_gbs=intra_bw_gbs, p2p_gbs=None)
    if inter_bw_gbs is not None:
        inter = replace(inter, name=f"{inter.name} (override)", bandwidth_gbs=inter_bw_gbs, p2p_gbs=None)
    return Cluster(device=device, ranks_per_node=gpus, nodes=nodes, intra=intra, inter=inter)


def calibrated(
    cluster: Cluster,
    *,
    flops_per_step: float,
    step_time_s: float,
    precision: str,
    streamed_bytes: float = 0.0,
    optimizer_bytes: float = 0.0,
    optimizer_s: float | None = None,
    threads: int | None = None,
    micro_step: tuple[float, float] | None = None,
    host_step: tuple[float, float] | None = None,
) -> Cluster:
    """The cluster with its device's MFU (and memory bandwidth) set from one rank's measured step.

    The step is modelled as the time model does (docs/planner-model.md): ``flops_per_step`` at the sustained rate plus
    ``streamed_bytes`` (the weights a forward+backward streams) and ``optimizer_bytes`` (the optimizer step's) at
    the memory bandwidth. ``optimizer_s``, the optimizer step timed apart, sets the bandwidth
    (``optimizer_bytes / optimizer_s``) and ``step_time_s`` is then the forward+backward alone; without it the
    catalogue bandwidth stands and ``step_time_s`` includes the optimizer step. ``threads``: on a CPU host, the
    cores the step ran on; the host's rates are cores/threads times theirs. A measured step is the best
    predictor of the sustained rate; the catalogue peak only fixes the scale. Raises when the measurement
    implies more than the catalogue peak (raise --tflops).

    ``micro_step`` (FLOPs, seconds): a smaller forward+backward timed the same way. Two batch sizes give the line
    time = FLOPs / rate + a fixed part; the fixed part (what a forward+backward costs whatever the batch) sets the
    weight passes, at the bandwidth above, instead of the catalogue's.

    ``host_step`` (forward+backward seconds, optimizer seconds): on a CPU host, the same two timed on all its
    cores (threads of one process). They set the host's rates instead of cores/threads times one thread's — cores
    that share caches, memory channels or a physical core (SMT) compute less together than apart — and
    ``Device.core_speedup``.
    """
    if step_time_s <= 0:
        raise ConfigError(f"--step-time must be > 0 seconds, got {step_time_s}")
    d = cluster.device
    scale = d.cores / threads if d.shared_by_ranks and d.cores and threads else 1.0
    if (micro_step is not None or host_step is not None) and optimizer_s is None:
        raise ConfigError(
            "a smaller or an all-cores forward+backward calibrates together with the optimizer step timed apart"
        )
    if optimizer_s is not None:
        if optimizer_s <= 0 or optimizer_bytes <= 0:
            raise ConfigError(
                f"a measured optimizer step needs its time and bytes > 0, got {optimizer_s} s, {optimizer_bytes} bytes"
            )
        bandwidth = optimizer_bytes / optimizer_s
        fixed_s = streamed_bytes / bandwidth
    else:
        bandwidth = d.memory_gbs * GB / scale
        fixed_s = (streamed_bytes + optimizer_bytes) / bandwidth
    if micro_step is not None:
        micro_flops, micro_s = micro_step
        if not 0 < micro_flops < flops_per_step or not 0 < micro_s < step_time_s or streamed_bytes <= 0:
            raise ConfigError(
                f"a smaller forward+backward ({micro_flops:.3g} FLOPs in {micro_s} s) calibrates "
                f"against the step ({flops_per_step:.3g} FLOPs in {step_time_s} s): it needs fewer "
                "FLOPs and less time"
            )
        fitted_s = step_time_s - flops_per_step * (step_time_s - micro_s) / (flops_per_step - micro_flops)
        if fitted_s <= 0:
            raise ConfigError(
                f"forward+backward {micro_s} s at {micro_flops:.3g} FLOPs and {step_time_s} s at "
                f"{flops_per_step:.3g} leave no batch-independent time; time both again"
            )
        d = replace(d, weight_passes=d.weight_passes * fitted_s / fixed_s)
        streamed_bytes *= fitted_s / fixed_s
        fixed_s = fitted_s
    compute_s = step_time_s - fixed_s
    if compute_s <= 0:
        raise ConfigError(
            f"a {step_time_s} s step is no longer than streaming the weights and optimizer state at "
            f"{bandwidth / GB:.3g} GB/s; check --step-time or raise --mem-bw-gbs"
        )
    rate, host_bandwidth = flops_per_step / compute_s * scale, bandwidth * scale
    if host_step is not None and d.shared_by_ranks:
        host_fb, host_opt = host_step
        if host_fb <= 0 or host_opt <= 0:
            raise ConfigError(f"an all-cores step needs times > 0, got {host_fb} s and {host_opt} s")
        host_bandwidth = optimizer_bytes / host_opt
        host_compute_s = host_fb - streamed_bytes / host_bandwidth
        if host_compute_s <= 0:
            raise ConfigError(
                f"an all-cores forward+backward of {host_fb} s is no longer than streaming the weights "
                f"at {host_bandwidth / GB:.3g} GB/s; time it again"
            )
        d = replace(d, core_speedup=compute_s / host_compute_s)
        rate = flops_per_step / host_compute_s
    if optimizer_s is not None:
        d = replace(d, memory_gbs=host_bandwidth / GB)
    peak = d.peak_tflops(precision) * 1e12
    if rate > peak:
        raise ConfigError(
            f"a {step_time_s} s step means {rate / 1e12:.1f} TFLOP/s, above "
            f"{d.name}'s peak {peak / 1e12:g}; check --step-time or raise --tflops"
        )
    return replace(cluster, device=replace(d, mfu=rate / peak, activation_passes=0.0))
