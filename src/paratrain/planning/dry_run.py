"""``paratrain dry-run``: lay a model out as ``prepare`` would at any world size, in this process
(:mod:`paratrain.dry_run`), and print what each rank holds or the error a launch would hit."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..dry_run import dry_run, model_builder
from ..errors import ConfigError
from ..flags import at_least, flag
from ..planner.training import OPTIMIZER_STATES, PRECISIONS


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
    json: bool = False
    """Print the layout as JSON."""

    def __post_init__(self) -> None:
        from ..strategies import check_name

        at_least(self, {"world": 1, "per_node": 1, "tp": 1, "dp": 1, "ep": 1})
        check_name(self.strategy)
        if self.model is not None and self.model_config is not None:
            raise ConfigError("give --model or --model-config, not both")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"unknown precision {self.precision!r}; choose one of: {', '.join(PRECISIONS)}")
        if self.optimizer not in OPTIMIZER_STATES:
            raise ConfigError(f"unknown optimizer {self.optimizer!r}; choose one of: {', '.join(OPTIMIZER_STATES)}")

    @property
    def options(self) -> dict[str, int]:
        """The strategy's options the flags give."""
        return {k: v for k, v in (("tp", self.tp), ("dp", self.dp), ("ep", self.ep)) if v is not None}


def run_dry_run(config: DryRunConfig) -> int:
    """Lay the model out, print the layout; exit code 1 when the layout fails as a launch would."""
    result = dry_run(model_builder(config.model, config.model_config), world=config.world, strategy=config.strategy,
                     options=config.options, precision=config.precision, optimizer=config.optimizer,
                     per_node=config.per_node)
    print(json.dumps(result.as_dict(), indent=2) if config.json else result.table())
    return 1 if result.error is not None else 0
