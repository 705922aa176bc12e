"""How the model is trained: precision, optimizer and batch sizes, and the bytes per parameter they imply."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType

from ..errors import ConfigError
from ..flags import NO_FLAG, flag
from ..options import MULTI_STAGE, SCHEDULES, V_SHAPED, stages_per_rank_of


@dataclass(frozen=True, kw_only=True)
class PrecisionBytes:
    """Bytes per parameter under one precision.

    Mixed precision follows the ZeRO paper (Rajbhandari et al. 2020, section 3.1): 16-bit parameters and
    gradients plus an fp32 master copy the optimizer updates. (PyTorch autocast keeps fp32 parameters and
    gradients instead, 4 + 4 bytes, and no master copy: the same 8 bytes for SGD and the same 16 for Adam.)
    """

    param: int
    grad: int
    master: int


PRECISIONS = MappingProxyType(
    {
        "fp32": PrecisionBytes(param=4, grad=4, master=0),
        "bf16-mixed": PrecisionBytes(param=2, grad=2, master=4),
        "fp16-mixed": PrecisionBytes(param=2, grad=2, master=4),
    }
)

OPTIMIZER_STATES = MappingProxyType({"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2})
"""Parameter-sized state tensors each optimizer the planner knows keeps: none for plain SGD, a momentum buffer, or
Adam's two moments. The one table: the planner's memory, the dry run's bytes and the names a user's optimizer is
planned as (``optimizers.planned``) all read it."""

OPTIMIZER_BY_STATES = MappingProxyType({n: name for name, n in reversed(OPTIMIZER_STATES.items())})
"""The planner's optimizer for a number of states (the first listed for it: ``adam`` for two)."""

OPTIMIZER_STEP_BYTES = MappingProxyType({"sgd": 12, "sgd-momentum": 32, "adam": 72, "adamw": 80})
"""Bytes the optimizer step streams per parameter, counting each elementwise kernel of PyTorch's default
(unfused: for-each on GPUs, one tensor at a time on CPU) implementation as a read of its inputs and a write of
its output, fp32: SGD ``p -= lr*g`` 12; momentum ``buf = m*buf + g`` then ``p -= lr*buf`` 32; Adam lerp of the
first moment 12, the second moment's mul and addcmul 20, sqrt, divide and add-eps of the denominator 24, and
``addcdiv`` into the parameters 16: 72; AdamW's decoupled weight decay multiplies the parameters first, 8 more.
(``fused=True`` Adam reads parameter, gradient and both moments and writes three of them: 28.)"""

OPTIMIZER_TEMP_BYTES = MappingProxyType({"sgd": 0, "sgd-momentum": 0, "adam": 4, "adamw": 4})
"""Bytes per parameter the optimizer step allocates for its duration: Adam's for-each step computes the
denominator sqrt(v) into a new list of parameter-sized fp32 tensors; SGD works in place."""

TABLE_STATES = MappingProxyType({"sgd": 0, "adagrad": 1, "adam": 2})
"""fp32 states per element a parameter server's table optimizer keeps: plain SGD none, Adagrad its sum, SparseAdam
two moments (``Parallel("ps", table_optimizer=...)``)."""

RECOMPUTE = ("none", "selective", "op", "full")
"""Activation recomputation: ``full`` keeps each block's input and recomputes the block in backward (one more
forward pass); ``selective`` recomputes only the attention core (Korthikanti et al. 2022, section 5: the
softmax and the two attention products, whose s x s tensors dominate a block's activations when they are
stored; a fused attention kernel stores none and recomputes them anyway); ``op`` is torchtitan's per-operation
selective AC (``torch.utils.checkpoint``'s selective policy): every other matrix product's output and the
attention kernel's are kept, the other products and all elementwise work recomputed."""


@dataclass(frozen=True, kw_only=True)
class Training:
    """The training setup a plan is made for."""

    precision: str = "bf16-mixed"
    """fp32, bf16-mixed or fp16-mixed; auto, a plan's default: fp32 on a CPU host, else bf16-mixed."""
    optimizer: str = "adamw"
    """adamw, adam, sgd or sgd-momentum."""
    micro_batch: int = field(default=8, metadata=flag("--batch"))
    """Per-GPU micro-batch: samples per forward pass."""
    global_batch: int | None = None
    """Samples per optimizer step over the whole job; default: the micro-batch x world size."""
    micro_batches: int | None = None
    """Pipeline micro-batches per step; default global batch / (dp x micro_batch)."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``1f1b`` keeps at most p micro-batches in flight, ``gpipe`` all m, ``interleaved-1f1b``
    (Narayanan et al. 2021) gives each rank ``virtual_stages`` stages in a loop: a bubble v times smaller for v
    times the stage-to-stage sends. The zero-bubble ones run weight gradients in the bubble: ``interleaved-zb``
    (looped, a third of interleaved 1F1B's bubble), ``zbv`` (two stages per rank in a V, none when forward, input
    and weight gradients cost alike) and ``dualpipev`` (a V, a third of 1F1B's)."""
    virtual_stages: int | None = None
    """Stages each pipeline rank holds under ``interleaved-1f1b`` or ``interleaved-zb`` (default 2, as the runtime's
    ``stages_per_rank``); 2 under ``zbv`` and ``dualpipev``, 1 for the other schedules."""
    checkpointing: bool = False
    """Activation checkpointing of every wrap unit: far less activation memory for one more forward pass (recompute
    full)."""
    recompute: str | None = field(default=None, metadata=flag(choices=RECOMPUTE))
    """``none``, ``selective``, ``op`` or ``full`` (``RECOMPUTE``); default ``full`` with ``checkpointing``, else
    ``none``. ``full`` turns ``checkpointing`` on, and ``checkpointing`` (the fallback ``recommend`` tries when
    nothing fits) overrides the others."""
    sequence_parallel: bool = True
    """Tensor parallelism shards the activations between its split regions on the sequence (norms, residuals:
    Korthikanti et al. 2022), as paratrain's tensor-parallel plan does; off: they are kept whole on every tp rank
    (Megatron's plain tensor parallelism, all-reduces instead of all-gather/reduce-scatter pairs)."""
    bucket_mb: float = field(default=25.0, metadata=NO_FLAG)
    """DDP gradient bucket size (MiB); DDP keeps two buckets in flight."""
    rows_per_step: int | None = field(default=None, metadata=flag("--ps-rows-per-step", metavar="R"))
    """Under ps: rows of each table one worker's step touches; default: the distinct rows of its samples' lookups,
    ids drawn uniformly (the most a step moves)."""
    table_optimizer: str | None = field(default=None, metadata=flag("--ps-table-optimizer", choices=TABLE_STATES))
    """Under ps: what updates the table rows on the servers; default: the training optimizer's states (adam is
    SparseAdam)."""
    base_batch: int | None = field(default=None, metadata=flag("--base-batch", metavar="N"))
    """The global batch your LR was tuned at: the plan says how to scale it to this global batch. None: no advice,
    since a script's LR may already be tuned for the batch it runs."""
    base_lr: float | None = None
    """With --base-batch: that learning rate, printed scaled."""
    document_tokens: int | None = field(default=None, metadata=flag("--document-tokens", metavar="L"))
    """Each row (sample) is packed with documents of L tokens, attention kept within each: a row of S tokens
    computes S·L of attention, not S² (documents of different lengths: the sum of their squares over the sum of
    their lengths). None, or L >= S: one sequence a row."""

    def __post_init__(self) -> None:
        if self.precision not in (*PRECISIONS, "auto"):
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of: {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"unknown pipeline schedule {self.schedule!r}; choose one of: {', '.join(SCHEDULES)}")
        if self.recompute is not None and self.recompute not in RECOMPUTE:
            raise ConfigError(f"unknown recompute {self.recompute!r}; choose one of: {', '.join(RECOMPUTE)}")
        if self.recompute == "full" and not self.checkpointing:
            object.__setattr__(self, "checkpointing", True)
        if self.virtual_stages is not None:
            if self.schedule in V_SHAPED and self.virtual_stages != 2:
                raise ConfigError(f"--virtual-stages: the {self.schedule} schedule runs exactly 2 stages per rank")
            if self.schedule not in MULTI_STAGE + V_SHAPED and self.virtual_stages != 1:
                raise ConfigError(
                    f"--virtual-stages {self.virtual_stages} needs --schedule interleaved-1f1b or interleaved-zb "
                    f"(the {self.schedule} schedule runs one stage per rank)"
                )
            if self.schedule in MULTI_STAGE and self.virtual_stages < 2:
                raise ConfigError(f"--virtual-stages must be >= 2 with {self.schedule}, got {self.virtual_stages}")
        for name, option in (
            ("micro_batch", "--batch"),
            ("global_batch", "--global-batch"),
            ("micro_batches", "--micro-batches"),
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{option} must be >= 1, got {value}")
        if self.bucket_mb <= 0:
            raise ConfigError(f"bucket size must be > 0 MiB, got {self.bucket_mb}")
        if self.rows_per_step is not None and self.rows_per_step < 0:
            raise ConfigError(f"--ps-rows-per-step must be >= 0, got {self.rows_per_step}")
        self._check_lr_base()
        self._check_document_tokens()
        if self.table_optimizer is not None and self.table_optimizer not in TABLE_STATES:
            raise ConfigError(
                f"unknown table optimizer {self.table_optimizer!r}; choose one of: {', '.join(TABLE_STATES)}"
            )

    def _check_lr_base(self) -> None:
        if self.base_batch is not None and self.base_batch < 1:
            raise ConfigError(f"--base-batch must be >= 1, got {self.base_batch}")
        if self.base_lr is not None and not self.base_lr > 0:
            raise ConfigError(f"--base-lr must be > 0, got {self.base_lr}")
        if self.base_lr is not None and self.base_batch is None:
            raise ConfigError(
                f"--base-lr {self.base_lr:g} is scaled from the global batch it was tuned at; give that "
                "batch too (--base-batch N)"
            )

    def _check_document_tokens(self) -> None:
        tokens = self.document_tokens
        if tokens is not None and (isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1):
            raise ConfigError(
                f"--document-tokens is the tokens of a packed row's documents, a whole number >= 1; got {tokens!r}"
            )

    @property
    def bytes(self) -> PrecisionBytes:
        if self.precision == "auto":
            raise ConfigError(
                "precision auto is decided by the plan's device (PlanConfig); give fp32, bf16-mixed or "
                "fp16-mixed to a Training planned alone"
            )
        return PRECISIONS[self.precision]

    @property
    def recompute_mode(self) -> str:
        """``full``, ``op``, ``selective`` or ``none``: what backward recomputes."""
        return "full" if self.checkpointing else (self.recompute or "none")

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages one rank holds: ``virtual_stages`` (default 2) under the interleaved schedules, 2 in a V,
        else 1 (the runtime's :func:`~paratrain.options.stages_per_rank_of`)."""
        return stages_per_rank_of(self.schedule, self.virtual_stages if self.schedule in MULTI_STAGE else None)

    @property
    def flops_factor(self) -> float:
        """Training FLOPs over forward+backward's: checkpointing recomputes the forward (1/3 of them)."""
        return 4 / 3 if self.checkpointing else 1.0

    @property
    def optimizer_bytes(self) -> int:
        """Bytes per parameter the optimizer step needs besides the gradient: fp32 master copy plus states."""
        return self.bytes.master + self.state_bytes

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of the optimizer's fp32 states."""
        return 4 * OPTIMIZER_STATES[self.optimizer]

    @property
    def optimizer_step_bytes(self) -> int:
        """Bytes per parameter one optimizer step streams through memory."""
        return OPTIMIZER_STEP_BYTES[self.optimizer]

    @property
    def optimizer_temp_bytes(self) -> int:
        """Bytes per parameter the optimizer step holds while it runs."""
        return OPTIMIZER_TEMP_BYTES[self.optimizer]

    @property
    def table_states(self) -> int:
        """fp32 states per table element on the servers: ``table_optimizer``'s, else the training optimizer's as
        the runtime steps tables (SGD as given, with its momentum buffer if any; Adam and AdamW as SparseAdam)."""
        if self.table_optimizer is not None:
            return TABLE_STATES[self.table_optimizer]
        return OPTIMIZER_STATES[self.optimizer]

    def global_for(self, world_size: int) -> int:
        return self.global_batch if self.global_batch is not None else self.micro_batch * world_size


@dataclass(frozen=True, kw_only=True)
class Batching:
    """How one replica's share of the global batch is cut: ``micro_batches`` forwards of ``micro_batch``."""

    micro_batch: float
    micro_batches: int
    """Gradient-accumulation steps, or a pipeline's micro-batches."""


def batching(training: Training, *, dp: int, pp: int, world_size: int) -> Batching:
    """Micro-batch size and count for ``dp`` replicas: the largest micro-batch <= ``training.micro_batch``
    that divides a replica's share of the global batch; a pipeline takes ``--micro-batches`` when given."""
    per_replica = training.global_for(world_size) / dp
    if pp > 1 and training.micro_batches is not None:
        count = training.micro_batches
    elif per_replica.is_integer():
        size = next(d for d in range(min(training.micro_batch, int(per_replica)), 0, -1) if per_replica % d == 0)
        count = int(per_replica) // size
    else:
        count = max(1, math.ceil(per_replica / training.micro_batch))
    return Batching(micro_batch=per_replica / count, micro_batches=count)


def batch_split_error(training: Training, *, dp: int, pp: int, world_size: int) -> str | None:
    """Why the global batch cannot be cut for ``dp`` replicas (of ``pp`` stages), or None.

    Each data-parallel replica takes an equal share of the global batch, whatever tensor and pipeline parallelism
    do inside it (a 384-GPU job of dp=8 x pp=12 x tp=4 takes 2048 samples as 8 x 256); a pipeline given
    ``--micro-batches`` cuts its share into that many equal micro-batches."""
    g = training.global_for(world_size)
    m = training.micro_batches if pp > 1 and training.micro_batches is not None else 1
    if g % (dp * m) == 0:
        return None
    lower, upper = g // (dp * m) * dp * m, (g // (dp * m) + 1) * dp * m
    split = f"dp={dp} replicas" + (f" x {m} micro-batches" if m > 1 else "")
    return (
        f"--global-batch {g} does not split evenly over {split} ({g / (dp * m):g} samples each); use a "
        f"multiple of {dp * m}, e.g. {f'{lower} or {upper}' if lower else upper}"
        + (", or change --micro-batches" if m > 1 else "")
    )
