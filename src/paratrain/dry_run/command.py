"""``paratrain dry-run``: lay a model out as ``prepare`` would at any world size, in this process
(:mod:`.probe`), and print what each rank holds or the error a launch would hit."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..cuda_step import StepResult, first_steps
from ..errors import ConfigError
from ..flags import at_least, flag
from ..planner.training import OPTIMIZER_STATES, PRECISIONS
from .probe import dry_run, model_builder


@dataclass(frozen=True, kw_only=True)
class DryRunConfig:
    """One layout to try: a model, a strategy and a world size."""

    model: str | None = None
    """A built-in model (mlp, cnn, gpt2, llama-7b, ...) or module:factory."""
    model_config: str | None = field(default=None, metadata=flag("--model-config", metavar="PATH"))
    """A transformers config.json (or its checkpoint directory): the real class (GPT-2, Llama, ...)."""
    world: int = field(metadata=flag("--world", metavar="N"))
    """The number of processes to lay the model out over."""
    per_node: int = field(default=8, metadata=flag("--per-node", metavar="N"))
    """Processes per node (a node's ranks are its local world)."""
    strategy: str = "zero3"
    """The strategy to lay out."""
    tp: int | None = None
    """Tensor-parallel degree inside the strategy."""
    dp: int | None = None
    """Data-parallel degree of a hybrid layout: how many times its pipeline is replicated."""
    ep: int | None = None
    """Expert-parallel degree: data-parallel ranks splitting a mixture of experts' experts (ddp, zero2, zero3,
    hybrid)."""
    precision: str = field(default="fp32", metadata=flag(choices=PRECISIONS))
    """The precision the parameters are kept in."""
    optimizer: str = field(default="adamw", metadata=flag(choices=OPTIMIZER_STATES))
    """The optimizer whose states each rank holds."""
    cpu_offload: bool = False
    """Offload parameters, gradients and optimizer states to the host (zero2, zero3)."""
    step: bool = False
    """Also run each probed rank's first training step on fake CUDA devices (``cuda:LOCAL_RANK``), in a child
    process: does it pass, and how much memory does the rank peak at (:mod:`paratrain.cuda_step`)."""
    input: str | None = None
    """One sample's input for --step (e.g. long:1024, 3x224x224); default: the built-in's own, else token ids."""
    micro_batch: int = field(default=1, metadata=flag("--micro-batch", metavar="N"))
    """Samples per rank in --step's forward."""
    seq_len: int = field(default=1024, metadata=flag("--seq-len", metavar="N"))
    """Tokens per sample in --step's forward (token-id input)."""
    json: bool = False
    """Print the layout as JSON."""

    def __post_init__(self) -> None:
        from ..strategies import check_name

        at_least(self, {"world": 1, "per_node": 1, "tp": 1, "dp": 1, "ep": 1, "micro_batch": 1, "seq_len": 1})
        check_name(self.strategy)
        if self.model is not None and self.model_config is not None:
            raise ConfigError("give --model or --model-config, not both")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of: {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}")

    @property
    def options(self) -> dict[str, int | bool]:
        """The strategy's options the flags give."""
        given = {k: v for k, v in (("tp", self.tp), ("dp", self.dp), ("ep", self.ep)) if v is not None}
        return {**given, "cpu_offload": True} if self.cpu_offload else given


def run_dry_run(config: DryRunConfig) -> int:
    """Lay the model out, print the layout; exit code 1 when the layout fails as a launch would."""
    result = dry_run(
        model_builder(config.model, config.model_config),
        world=config.world,
        strategy=config.strategy,
        options=config.options,
        precision=config.precision,
        optimizer=config.optimizer,
        per_node=config.per_node,
    )
    steps = first_steps([step_spec(config, r.rank) for r in result.ranks]) if config.step and not result.error else []
    if config.json:
        print(json.dumps({**result.as_dict(), "steps": [asdict(s) for s in steps]}, indent=2))
    else:
        print("\n".join([result.table(), *([steps_table(steps)] if steps else [])]))
    return 1 if result.error is not None or any(s.ran and not s.passed for s in steps) else 0


def step_spec(config: DryRunConfig, rank: int) -> dict[str, object]:
    """What ``--step`` runs for ``rank`` (see :func:`paratrain.cuda_step.first_steps`)."""
    return {
        "rank": rank,
        "world": config.world,
        "per_node": config.per_node,
        "strategy": config.strategy,
        "options": config.options,
        "precision": config.precision,
        "model": config.model,
        "model_config": config.model_config,
        "input": config.input,
        "batch": config.micro_batch,
        "seq_len": config.seq_len,
        "clip": 1.0,
    }


def steps_table(steps: list[StepResult]) -> str:
    """Each probed rank's first step on fake CUDA: passes or fails, its peak memory, then each failure's line."""
    lines = [
        "first training step on fake CUDA devices (clipped AdamW, CUDA's foreach path, the job's backend)",
        f"{'rank':>6} {'device':>8} {'first step':>11} {'peak GiB':>9}",
    ]
    lines += [
        f"{s.rank:>6} {s.device:>8} {'passes' if s.passed else 'FAILS' if s.ran else 'not run':>11} "
        f"{(f'{s.peak / 2**30:.3f}' if s.passed else '-'):>9}"
        for s in steps
    ]
    lines += [f"rank {s.rank}: {s.error}" for s in steps if not s.passed]
    lines += [f"rank {s.rank}: note: {s.note}" for s in steps if s.note]
    return "\n".join(lines)
