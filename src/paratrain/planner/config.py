"""What ``paratrain plan`` plans for, in one validated object: the model named, the cluster, the training setup, the
layouts searched and the figures that calibrate the plan. Its fields are the command's flags (:mod:`paratrain.flags`):
a flag added to ``plan`` is a field added here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from ..dims import ParallelDims
from ..errors import ConfigError
from ..flags import NO_FLAG, at_least, flag, positive
from .hardware import Cluster, get_device, make_cluster
from .layout import exact_layout, layout_strategy
from .training import Training


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model the flags name; ``workloads.model_names.resolve_model`` builds it (the planner never builds by
    name)."""

    model: str | None = None
    """mlp, cnn, gpt2[-medium|-large|-xl], llama-7b, gpt3-175b, llama3-8b/70b/405b, mistral-7b, qwen2-7b,
    mixtral-8x7b, qwen3-30b-a3b, gpt-oss-20b, or module:factory."""
    input_spec: str | None = field(default=None, metadata=flag("--input", metavar="SHAPE"))
    """One sample's input for module:factory, e.g. 3x224x224 or long:1024."""
    targets: str | None = field(default=None, metadata=flag("--targets", metavar="SHAPE"))
    """One sample's targets for the forward's targets/labels parameter (long:1024, or long for one class id); none:
    trace the forward on its input alone. Default: given when the forward takes them."""
    model_config: str | None = field(default=None, metadata=flag("--model-config", metavar="PATH"))
    """A transformers config.json (or its checkpoint directory): llama, mistral, qwen2, qwen3, mixtral, qwen2_moe,
    qwen3_moe or gpt2."""
    params: str | None = None
    """Plan a transformer of this many parameters, e.g. 7.5B (no --model)."""
    layers: int | None = None
    """Transformer blocks (overrides a built-in GPT's or a config's)."""
    hidden: int | None = None
    """Transformer width (overrides a built-in GPT's or a config's)."""
    heads: int | None = None
    """Attention heads (overrides a built-in GPT's or a config's)."""
    kv_heads: int | None = None
    """Key/value heads of grouped-query attention (overrides a built-in GPT's or a config's)."""
    ffn_hidden: int | None = None
    """MLP width (overrides a built-in GPT's or a config's)."""
    seq_len: int | None = None
    """Sequence length (overrides a built-in GPT's or a config's)."""
    vocab: int | None = None
    """Vocabulary size (overrides a built-in GPT's or a config's)."""
    tied: bool | None = field(default=None, metadata=flag("--tied", negative="--untied"))
    """The output head shares the token embedding's weights (--untied: a head of its own)."""

    def __post_init__(self) -> None:
        at_least(self, dict.fromkeys(("layers", "hidden", "heads", "kv_heads", "ffn_hidden", "seq_len", "vocab"), 1))

    @property
    def shape(self) -> dict[str, int | bool]:
        """The transformer shape the flags give (the names ``GPTConfig`` takes), the ones not given left out."""
        given = dict(
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            seq_len=self.seq_len,
            vocab=self.vocab,
            ffn=self.ffn_hidden,
            kv_heads=self.kv_heads,
            tied=self.tied,
        )
        return {k: v for k, v in given.items() if v is not None}


@dataclass(frozen=True, kw_only=True)
class Measured:
    """Figures measured elsewhere that replace the catalogue's (``benchmarks/planner_accuracy*.py`` time them)."""

    link_timings: Mapping[str, tuple[float, ...]] | None = None
    """Collective name -> (bytes, seconds) on the node's ranks: the intra-node link (``collectives.measured_link``)."""
    micro_step_time: tuple[float, float] | None = None
    """(samples, seconds) of a smaller forward+backward timed as ``step_time``: sets the weight passes' share."""
    host_step_time: tuple[float, float] | None = None
    """(forward+backward, optimizer) seconds of the step on all of a CPU host's cores (``hardware.calibrated``)."""
    fsdp_overhead: Mapping[str, float] | None = None
    """``zero2``/``zero3`` -> seconds that strategy's step on a one-rank group added: sets ``Device.fsdp_call_s``."""
    tp_step_time: float | None = None
    """A tensor-parallel step over a node's ranks on a fake group: sets ``Device.tp_call_s``."""


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """A plan's options: ``make_plan(model, config)`` plans ``model`` (``model_spec`` resolved) on this cluster."""

    model_spec: ModelSpec = field(default_factory=ModelSpec, metadata=flag(title="model"))
    """The model the command plans (``make_plan`` takes it built)."""
    gpu: str = "h100"
    """a100-40gb, a100-80gb, h100-80gb, h200-141gb, l4, rtx-4090, cpu."""
    gpus: int = 1
    """GPUs (or CPU processes) per node."""
    nodes: int = 1
    """Nodes of --gpus each."""
    interconnect: str | None = None
    """Link within a node: nvlink, nvlink3, nvlink4, pcie3/4/5[-x8|-x4], loopback-gloo."""
    inter_node: str | None = None
    """Link between nodes: ib-hdr, ib-ndr (one port a node), ib-hdr-x8, ib-ndr-x8 (one a GPU),
    eth-10g/25g/100g/200g/400g, roce-*."""
    gpu_mem_gb: float | None = None
    """Device memory (GiB), instead of the catalogue's."""
    tflops: float | None = None
    """Peak TFLOP/s, instead of the catalogue's."""
    mfu: float | None = None
    """A whole step's sustained fraction of peak (default: A100/H100/H200 0.7 in matmuls plus elementwise passes,
    other GPUs 0.4, CPU 0.6)."""
    mem_bw_gbs: float | None = None
    """Device memory bandwidth (GB/s), instead of the catalogue's."""
    intra_bw_gbs: float | None = None
    """Intra-node bandwidth (GB/s, one direction), instead of the link's."""
    inter_bw_gbs: float | None = None
    """Inter-node bandwidth (GB/s per node), instead of the link's."""
    measure: bool = False
    """Run the model here: on the CPU for its activations and step time (calibrates --gpu cpu); on this machine's
    GPU, timed steps calibrate that GPU's compute and bandwidth."""
    step_time: float | None = field(default=None, metadata=flag("--step-time", metavar="SECONDS"))
    """Measured seconds of one training step of --batch on one device: calibrates the MFU."""
    optimizer_time: float | None = field(default=None, metadata=flag("--optimizer-time", metavar="SECONDS"))
    """The optimizer step of that measurement timed apart (then --step-time is forward+backward alone): calibrates
    the memory bandwidth too."""
    threads: int | None = None
    """With --gpu cpu: the cores the measured step ran on."""
    measured: Measured | None = field(default=None, metadata=NO_FLAG)
    """Figures measured elsewhere (Python only)."""
    training: Training = field(default_factory=lambda: Training(precision="auto"))
    """How the model is trained; precision auto: fp32 on a CPU host, where 16-bit brings no speed, else bf16-mixed."""
    tp: int | None = None
    """Tensor-parallel degree to plan (default: every one that divides a node and the model; 1: none; more than a
    node's GPUs is planned but slow)."""
    ep: int | None = None
    """Expert-parallel degree to plan for a mixture of experts (default: every one that divides a node's GPUs and
    the experts; 1: none): that many data-parallel ranks split each MoE block's experts."""
    cp: int | None = None
    """Context-parallel degree to plan for a transformer (default: every one that its heads and key/value heads
    take with each tp within a node; 1: none): that many ranks split each sequence (long --seq-len)."""
    dp: int | None = None
    """With --pp and/or --tp: plan exactly this layout (dp x pp x tp = all GPUs) instead of searching."""
    pp: int | None = None
    """Pipeline stages of the exact layout (default 1 with --dp)."""
    layout: str | None = None
    """The exact layout in one flag, e.g. dp=8,pp=12,tp=4 (ep=E carves expert parallelism out of dp; cp=C adds
    C ranks per replica splitting each sequence: dp=4,cp=2 on 8 GPUs); naming a data-parallel strategy plans it
    alone, its dp the GPUs left (zero3,cp=2)."""
    ps_servers: int = field(default=1, metadata=flag("--ps-servers", metavar="S"))
    """Servers of the ps row (parameter servers: the other GPUs are workers; 0: no ps row)."""
    breakdown: bool = False
    """Show memory per category."""
    json: bool = False
    """Print the plan as JSON."""

    def __post_init__(self) -> None:
        at_least(
            self, {"gpus": 1, "nodes": 1, "threads": 1, "tp": 1, "ep": 1, "cp": 1, "dp": 1, "pp": 1, "ps_servers": 0}
        )
        positive(
            self,
            (
                "gpu_mem_gb",
                "tflops",
                "mfu",
                "mem_bw_gbs",
                "intra_bw_gbs",
                "inter_bw_gbs",
                "step_time",
                "optimizer_time",
            ),
        )
        if self.mfu is not None and self.mfu > 1:
            raise ConfigError(f"--mfu is a fraction of peak, at most 1, got {self.mfu:g}")
        if self.training.checkpointing and self.training.recompute not in (None, "full"):
            raise ConfigError(
                f"--checkpointing is --recompute full; give one of --checkpointing or --recompute "
                f"{self.training.recompute}"
            )
        if self.measure and self.training.document_tokens is not None:
            raise ConfigError(
                "--measure times unpacked rows; with --document-tokens give --step-time of a packed step instead"
            )
        if self.optimizer_time is not None and self.step_time is None:
            raise ConfigError("--optimizer-time calibrates together with --step-time (the forward+backward alone)")
        _ = self.exact  # the layout flags read now, not when planning
        if self.training.precision == "auto":
            cpu = get_device(self.gpu).shared_by_ranks  # 16-bit brings no speed on a CPU host
            object.__setattr__(self, "training", replace(self.training, precision="fp32" if cpu else "bf16-mixed"))

    @property
    def exact(self) -> ParallelDims | None:
        """The degrees ``--layout`` (or ``--dp``/``--pp`` with ``--tp``, ``--ep``, ``--cp``) pin, or None: search."""
        return exact_layout(
            self.layout, dp=self.dp, pp=self.pp, tp=self.tp, ep=self.ep, cp=self.cp, world=self.gpus * self.nodes
        )

    @property
    def exact_strategy(self) -> str | None:
        """The strategy ``--layout`` names (``zero3,cp=2``), or None: every way of running the exact layout."""
        return layout_strategy(self.layout)

    def cluster(self) -> Cluster:
        """The cluster the hardware flags describe."""
        return make_cluster(
            self.gpu,
            gpus=self.gpus,
            nodes=self.nodes,
            interconnect=self.interconnect,
            inter_node=self.inter_node,
            gpu_mem_gb=self.gpu_mem_gb,
            tflops=self.tflops,
            mfu=self.mfu,
            mem_bw_gbs=self.mem_bw_gbs,
            intra_bw_gbs=self.intra_bw_gbs,
            inter_bw_gbs=self.inter_bw_gbs,
        )
