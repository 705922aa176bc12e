"""Published large training runs with their full configuration and measured speed (and memory, where given): what
the planner's closed forms are held to at cluster scale (benchmarks/RESULTS.md §19,
tests/planner/test_planner_published.py), and the mixture-of-experts presets' published parameter counts
(``MOE_COUNTS``, §19b).

Each run is pure data, quoted from its source (paper and table, or repository file and commit); ``predict`` plans
it with the published layout and nothing tuned to it: catalogue devices and links, the catalogue's matmul
efficiency and elementwise passes, a device figure only where the source gives one. What a source leaves unstated
and the plan assumes is said (``PublishedRun.assumed``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

from ..errors import ConfigError
from .estimates import Estimate, estimate
from .hardware import GIB, make_cluster
from .layout import Layout
from .training import Training
from .transformer import TRANSFORMERS, GPTConfig, transformer_params, transformer_stats

KORTHIKANTI = (
    "Korthikanti et al. 2022, Reducing Activation Recomputation in Large Transformer Models "
    "(arXiv 2205.05198), tables 3 and 4"
)
TORCHTITAN = "pytorch/torchtitan docs/performance.md (commit eaea6f6), table {}"
TORCHTITAN_A100 = "pytorch/torchtitan docs/performance.md (commit 0413364), table {} performance numbers: 64 A100 80GB"
LLM_FOUNDRY = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (commit 061f2c7), table H100 80GB BF16"
BLOOM = (
    "bigscience-workshop/bigscience train/tr11-176B-ml/README.md (commit 00327f8): replica setup, architecture, "
    "and iteration 85376 under 'Important checkpoints' (104.70 s per iteration at global batch 2048, 149.77 "
    "TFLOPs a GPU counting the recomputed forward)"
)


def _megatron_gpt(layers: int, hidden: int, heads: int) -> GPTConfig:
    """The Megatron papers' GPT: GPT-2's blocks (4h GELU MLP, biases, learned positions, tied head), 2048 tokens,
    a 51,200-token vocabulary."""
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=51200)


def _mpt(layers: int, hidden: int, heads: int) -> GPTConfig:
    """MosaicML's MPT as benchmarked: 4h GELU MLP, no biases, tied head, vocabulary 50,368 (its NumParams column
    grows by seq_len x hidden with the sequence, so a position table is counted)."""
    return GPTConfig(layers=layers, hidden=hidden, heads=heads, seq_len=2048, vocab=50368, bias=False)


@dataclass(frozen=True, kw_only=True)
class PublishedRun:
    """One published training run: its model, hardware, layout and setup, and what was measured."""

    name: str
    source: str
    model: GPTConfig
    gpu: str
    """Catalogue device (``hardware.DEVICES``)."""
    nodes: int
    gpus_per_node: int = 8
    inter_node: str = "ib-ndr-x8"
    dp: int = 1
    zero: int = 0
    """ZeRO stage of the data-parallel group (3: FSDP's full sharding)."""
    pp: int = 1
    tp: int = 1
    micro_batch: int
    global_batch: int
    recompute: str = "none"
    sequence_parallel: bool = True
    schedule: str = "1f1b"
    virtual_stages: int | None = None
    step_s: float
    """Seconds per optimizer step: published, or the published tokens per second turned into it
    (global batch x sequence / tokens per second)."""
    memory_gib: float | None = None
    """Peak memory per GPU as published (``memory_kind``), where it is."""
    memory_kind: str = ""
    gpu_mem_gb: float | None = None
    mem_bw_gbs: float | None = None
    tflops: float | None = None
    """The device's dense bf16 peak where the source says it differs from the catalogue's."""
    caveat: str = ""
    """What the plan cannot model about this run (it is then not held to the bounds)."""
    assumed: str = ""
    """What the source leaves unstated and the plan assumes (the run is still held to the bounds)."""

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def layout(self) -> Layout:
        if self.dp * self.pp * self.tp != self.world_size:
            raise ConfigError(f"published run {self.name}: dp x pp x tp != its {self.world_size} GPUs")
        name = (
            "tp"
            if self.dp == 1 and self.pp == 1
            else "pipeline"
            if self.dp == 1
            else "hybrid"
            if self.pp > 1
            else f"zero{self.zero}"
            if self.zero
            else "ddp"
        )
        return Layout.of(
            name=name, dp=self.dp, zero=self.zero, shard=self.dp if self.zero else 1, pp=self.pp, tp=self.tp
        )

    @property
    def training(self) -> Training:
        return Training(
            precision="bf16-mixed",
            optimizer="adam",
            micro_batch=self.micro_batch,
            global_batch=self.global_batch,
            recompute=self.recompute,
            sequence_parallel=self.sequence_parallel,
            schedule=self.schedule,
            virtual_stages=self.virtual_stages,
        )


def _korthikanti(
    size: str, cfg: GPTConfig, *, pp: int, batch: int, full_s: float, present_s: float
) -> list[PublishedRun]:
    """A row of Korthikanti et al.'s table 4, both ways: full recomputation with plain tensor parallelism, and
    their "present work" (selective recomputation with sequence parallelism). Table 3: tp 8, micro-batch 1, data
    parallelism 1, A100 80GB on Selene (DGX A100 nodes, eight 200 Gb/s HDR ports each)."""
    base = dict(
        source=KORTHIKANTI,
        model=cfg,
        gpu="a100-80gb",
        nodes=pp,
        inter_node="ib-hdr-x8",
        pp=pp,
        tp=8,
        micro_batch=1,
        global_batch=batch,
        assumed="1F1B without interleaving; the full-recompute baseline without sequence parallelism",
    )
    return [
        PublishedRun(name=f"megatron-{size} full", recompute="full", sequence_parallel=False, step_s=full_s, **base),
        PublishedRun(
            name=f"megatron-{size} selective+sp",
            recompute="selective",
            sequence_parallel=True,
            step_s=present_s,
            **base,
        ),
    ]


def _llama2(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int) -> GPTConfig:
    """Llama 2 (Touvron et al. 2023, table 1 and the released configs): 4096 tokens, a 32,000-token vocabulary."""
    return GPTConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        seq_len=4096,
        vocab=32000,
        ffn=ffn,
        gated=True,
        bias=False,
        learned_positions=False,
        tied=False,
    )


def _tokens(tokens_per_gpu_s: float, global_batch: int, seq_len: int, gpus: int) -> float:
    """Seconds per step from published tokens per second per GPU."""
    return global_batch * seq_len / (tokens_per_gpu_s * gpus)


_TITAN = dict(
    gpu="h100-80gb",
    gpu_mem_gb=95.0,
    mem_bw_gbs=2400.0,
    tflops=(989 + 835) / 2,
    inter_node="ib-ndr-x8",
    memory_kind="reserved",
)
"""torchtitan's Grand Teton hosts: H100 with 96 GB HBM2e (2.4 TB/s) at 500 W, NVLink, 400 Gb/s RDMA per GPU; their
peak is "between SXM and NVL" (989 and 835 dense bf16 TFLOP/s, its footnote 2): the middle is planned. Its logs
report ``torch.cuda.max_memory_reserved``."""

_TITAN_8B = (
    "predicted 19-22% fast and 14-15% under the reserved memory: the caching allocator's reserve is in the "
    "published figure, and the peak of these 500 W parts is only bounded by the source (the plan takes the "
    "middle of it); the plan's per-op AC halves the matmul outputs kept, torchtitan's list differs a little"
)
_FOUNDRY_LINKS = "inter-node links not stated: planned as 400 Gb/s a GPU"
_TITAN_A100 = dict(
    gpu="a100-80gb",
    nodes=8,
    dp=64,
    zero=3,
    inter_node="ib-hdr-x8",
    assumed="inter-node links not stated: planned as 200 Gb/s a GPU",
)
_BLOOM = GPTConfig(layers=70, hidden=14336, heads=112, seq_len=2048, vocab=250880, learned_positions=False)
"""BLOOM-176B: GPT-2's blocks (4h GELU MLP, biases, tied head), ALiBi instead of a position table; its embedding
LayerNorm (2h parameters) is left out."""
_LLAMA8 = TRANSFORMERS["llama3-8b"]
_LLAMA70 = TRANSFORMERS["llama3-70b"]
_LLAMA405 = TRANSFORMERS["llama3-405b"]

RUNS: tuple[PublishedRun, ...] = (
    *_korthikanti("22b", _megatron_gpt(48, 6144, 64), pp=1, batch=4, full_s=1.42, present_s=1.10),
    *_korthikanti("175b", _megatron_gpt(96, 12288, 96), pp=8, batch=64, full_s=18.13, present_s=13.75),
    *_korthikanti("530b", _megatron_gpt(105, 20480, 128), pp=35, batch=280, full_s=49.05, present_s=37.83),
    *_korthikanti("1t", _megatron_gpt(128, 25600, 160), pp=64, batch=512, full_s=94.42, present_s=71.49),
    PublishedRun(
        name="torchtitan llama3.1-8b fsdp 8",
        source=TORCHTITAN.format(1),
        model=_LLAMA8,
        nodes=1,
        dp=8,
        zero=3,
        micro_batch=2,
        global_batch=16,
        recompute="op",
        step_s=_tokens(5762, 16, 8192, 8),
        memory_gib=82.4,
        caveat=_TITAN_8B,
        **_TITAN,
    ),
    PublishedRun(
        name="torchtitan llama3.1-8b fsdp 128",
        source=TORCHTITAN.format(3),
        model=_LLAMA8,
        nodes=16,
        dp=128,
        zero=3,
        micro_batch=2,
        global_batch=256,
        recompute="op",
        step_s=_tokens(5605, 256, 8192, 128),
        memory_gib=67.0,
        caveat=_TITAN_8B,
        **_TITAN,
    ),
    PublishedRun(
        name="torchtitan llama3.1-70b fsdp 32 x tp 8",
        source=TORCHTITAN.format(4),
        model=_LLAMA70,
        nodes=32,
        dp=32,
        zero=3,
        tp=8,
        micro_batch=16,
        global_batch=512,
        recompute="full",
        step_s=_tokens(829, 512, 8192, 256),
        memory_gib=71.9,
        **_TITAN,
        caveat="Float8 matmuls and torch.compile: faster than the bf16 the plan models",
    ),
    PublishedRun(
        name="torchtitan llama3.1-405b fsdp 8 x tp 8 x pp 8, 1f1b",
        source=TORCHTITAN.format(5),
        model=_LLAMA405,
        nodes=64,
        dp=8,
        zero=3,
        pp=8,
        tp=8,
        micro_batch=1,
        global_batch=256,
        recompute="full",
        step_s=_tokens(100, 256, 8192, 512),
        memory_gib=82.5,
        **_TITAN,
        caveat="Float8 matmuls, torch.compile and async TP (overlapped): faster than the plan models",
    ),
    PublishedRun(
        name="torchtitan llama3.1-405b fsdp 8 x tp 8 x pp 8, interleaved",
        source=TORCHTITAN.format(5),
        model=_LLAMA405,
        nodes=64,
        dp=8,
        zero=3,
        pp=8,
        tp=8,
        micro_batch=1,
        global_batch=256,
        recompute="full",
        schedule="interleaved-1f1b",
        virtual_stages=2,
        step_s=_tokens(128, 256, 8192, 512),
        memory_gib=72.7,
        **_TITAN,
        caveat="Float8 matmuls, torch.compile and async TP (overlapped): faster than the plan models; "
        "stages per rank not published (2 planned)",
    ),
    PublishedRun(
        name="torchtitan llama3-8b fsdp 64 a100",
        source=TORCHTITAN_A100.format("Llama 3"),
        model=_LLAMA8,
        micro_batch=1,
        global_batch=64,
        recompute="op",
        step_s=_tokens(2973, 64, 8192, 64),
        **_TITAN_A100,
    ),
    PublishedRun(
        name="torchtitan llama3-70b fsdp 64 a100",
        source=TORCHTITAN_A100.format("Llama 3"),
        model=_LLAMA70,
        micro_batch=1,
        global_batch=64,
        recompute="full",
        step_s=_tokens(331, 64, 8192, 64),
        **_TITAN_A100,
    ),
    PublishedRun(
        name="torchtitan llama2-13b fsdp 64 a100",
        source=TORCHTITAN_A100.format("Llama 2"),
        model=_llama2(40, 5120, 40, 40, 13824),
        micro_batch=2,
        global_batch=128,
        step_s=_tokens(2162, 128, 4096, 64),
        **_TITAN_A100,
    ),
    PublishedRun(
        name="torchtitan llama2-13b fsdp 64 a100, op AC",
        source=TORCHTITAN_A100.format("Llama 2"),
        model=_llama2(40, 5120, 40, 40, 13824),
        micro_batch=2,
        global_batch=128,
        recompute="op",
        step_s=_tokens(1904, 128, 4096, 64),
        **_TITAN_A100,
    ),
    PublishedRun(
        name="torchtitan llama2-70b fsdp 64 a100, op AC",
        source=TORCHTITAN_A100.format("Llama 2"),
        model=_llama2(80, 8192, 64, 8, 28672),
        micro_batch=1,
        global_batch=64,
        recompute="op",
        step_s=_tokens(355, 64, 4096, 64),
        **_TITAN_A100,
    ),
    PublishedRun(
        name="torchtitan llama2-70b fsdp 64 a100, full AC",
        source=TORCHTITAN_A100.format("Llama 2"),
        model=_llama2(80, 8192, 64, 8, 28672),
        micro_batch=2,
        global_batch=128,
        recompute="full",
        step_s=_tokens(353, 128, 4096, 64),
        **_TITAN_A100,
    ),
    PublishedRun(
        name="llm-foundry mpt-7b fsdp 8",
        source=LLM_FOUNDRY,
        model=_mpt(32, 4096, 32),
        gpu="h100-80gb",
        nodes=1,
        dp=8,
        zero=3,
        micro_batch=6,
        global_batch=48,
        assumed=_FOUNDRY_LINKS,
        step_s=_tokens(10643, 48, 2048, 8),
    ),
    PublishedRun(
        name="llm-foundry mpt-13b fsdp 64",
        source=LLM_FOUNDRY,
        model=_mpt(40, 5120, 40),
        gpu="h100-80gb",
        nodes=8,
        dp=64,
        zero=3,
        micro_batch=2,
        global_batch=128,
        assumed=_FOUNDRY_LINKS,
        step_s=_tokens(4800, 128, 2048, 64),
        caveat="not explained: the plan hides FSDP's collectives (0.21 s a step over 8 nodes) behind 0.65 s "
        "of compute; at 2 samples a GPU the published run is 23% slower than that",
    ),
    PublishedRun(
        name="llm-foundry mpt-30b fsdp 32",
        source=LLM_FOUNDRY,
        model=_mpt(48, 7168, 64),
        gpu="h100-80gb",
        nodes=4,
        dp=32,
        zero=3,
        micro_batch=14,
        global_batch=1344,
        recompute="full",
        assumed=_FOUNDRY_LINKS,
        step_s=_tokens(2308, 1344, 2048, 32),
    ),
    PublishedRun(
        name="llm-foundry mpt-70b fsdp 64",
        source=LLM_FOUNDRY,
        model=_mpt(80, 8192, 64),
        gpu="h100-80gb",
        nodes=8,
        dp=64,
        zero=3,
        micro_batch=8,
        global_batch=2048,
        recompute="full",
        assumed=_FOUNDRY_LINKS,
        step_s=_tokens(1039, 2048, 2048, 64),
    ),
    PublishedRun(
        name="bloom-176b zero1 8 x pp 12 x tp 4",
        source=BLOOM,
        model=_BLOOM,
        gpu="a100-80gb",
        nodes=48,
        inter_node="ib-ndr",
        dp=8,
        zero=1,
        pp=12,
        tp=4,
        micro_batch=2,
        global_batch=2048,
        recompute="full",
        sequence_parallel=False,
        step_s=104.70,
        assumed="four 100 Gb/s Omni-Path links a node, planned as one 400 Gb/s port (ib-ndr); 1F1B; the "
        "pipeline's embedding counted on the first stage (BLOOM balanced it as a block); no memory "
        "figure published",
    ),
)
"""The runs of benchmarks/RESULTS.md §19."""


@dataclass(frozen=True, kw_only=True)
class Prediction:
    run: PublishedRun
    estimate: Estimate

    @property
    def step_s(self) -> float:
        return self.estimate.time.step_s

    @property
    def step_ratio(self) -> float:
        """Predicted over published step time."""
        return self.step_s / self.run.step_s

    @property
    def memory_gib(self) -> float:
        """Predicted peak per GPU, overhead included (what ``max_memory_reserved`` sees, less fragmentation)."""
        return self.estimate.memory.total / GIB

    @property
    def memory_ratio(self) -> float | None:
        return None if self.run.memory_gib is None else self.memory_gib / self.run.memory_gib


def predict(run: PublishedRun) -> Prediction:
    """The planner's memory and step time for ``run``'s published layout and setup."""
    cluster = make_cluster(
        run.gpu,
        gpus=run.gpus_per_node,
        nodes=run.nodes,
        inter_node=run.inter_node,
        gpu_mem_gb=run.gpu_mem_gb,
        mem_bw_gbs=run.mem_bw_gbs,
        tflops=run.tflops,
    )
    stats = transformer_stats(run.model, name=run.name)
    return Prediction(run=run, estimate=estimate(stats, run.layout, run.training, cluster))


@dataclass(frozen=True, kw_only=True)
class PublishedCount:
    """A mixture of experts' published parameter counts, which its preset (``TRANSFORMERS``) is held to within 2%."""

    total: float
    active: float
    """Parameters a token uses, as the source counts them."""
    source: str
    active_without_lookups: bool = False
    """The source's active count leaves out the token embedding table (a lookup, no matmul): OpenAI's does."""


MOE_COUNTS = MappingProxyType(
    {
        "mixtral-8x7b": PublishedCount(
            total=46.7e9,
            active=12.9e9,
            source="Mistral AI, 'Mixtral of experts' (2023-12-11) "
            "and the mistralai/Mixtral-8x7B-v0.1 model card: 46.7B total, 12.9B per token",
        ),
        "qwen3-30b-a3b": PublishedCount(
            total=30.5e9,
            active=3.3e9,
            source="the Qwen/Qwen3-30B-A3B model card: 30.5B in total, 3.3B activated, 29.9B non-embedding",
        ),
        "gpt-oss-20b": PublishedCount(
            total=20.91e9,
            active=3.61e9,
            active_without_lookups=True,
            source="OpenAI, gpt-oss-120b & gpt-oss-20b model card (arXiv 2508.10925), table 1 "
            "(the openai/gpt-oss-20b page rounds them to 21B and 3.6B)",
        ),
    }
)


def preset_counts(name: str) -> tuple[int, int]:
    """(total, active) parameters of the preset ``name`` as its published count counts them (``MOE_COUNTS``)."""
    cfg = TRANSFORMERS[name]
    counts = transformer_params(cfg)
    lookups = cfg.vocab * cfg.hidden if MOE_COUNTS[name].active_without_lookups else 0
    return counts["total"], counts["active"] - lookups
