"""Strategy names → factories. Unknown names are answered with the list of valid ones."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..composition import refuse_degree
from ..env import ClusterEnv
from ..errors import ConfigError, UnknownStrategyError
from .base import Strategy

_FACTORIES: dict[str, Callable[..., Strategy]] = {}
AROUND = frozenset({"moe_aux_loss"})
"""Options of any strategy that the job applies around it (:class:`~paratrain.strategies.chosen.ChosenStrategy`
takes them out first), not the strategy's own constructor."""


def register(*names: str) -> Callable[[Callable[..., Strategy]], Callable[..., Strategy]]:
    """Decorator of a strategy class (or any factory of one): make it constructible by each of ``names``."""

    def deco(factory: Callable[..., Strategy]) -> Callable[..., Strategy]:
        for n in names:
            if n in _FACTORIES:
                raise RuntimeError(f"strategy name {n!r} registered twice")
            _FACTORIES[n] = factory
        return factory

    return deco


def available() -> list[str]:
    """Every registered strategy name, plus 'auto'."""
    return sorted(_FACTORIES) + ["auto"]


def check_name(name: str) -> None:
    """Raise ``UnknownStrategyError`` listing the valid names unless ``name`` is one of them."""
    if name not in _FACTORIES and name != "auto":
        raise UnknownStrategyError(f"unknown strategy {name!r}; choose one of: {', '.join(available())}")


def create(name: str, **options: Any) -> Strategy:
    """Build the strategy registered as ``name`` with its options."""
    check_name(name)
    return _FACTORIES[name](**options)


def strategy_for(spec: str | Strategy, env: ClusterEnv, options: dict[str, Any]) -> Strategy:
    """The strategy ``Parallel(strategy=spec, **options)`` asks for; ``auto`` stands for ``single`` in one process
    and for ``ddp`` until ``prepare`` chooses (:mod:`paratrain.strategies.auto`)."""
    if isinstance(spec, Strategy):
        if options:
            raise ConfigError(f"strategy options {sorted(options)} given with a Strategy instance; set them on it")
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"strategy must be a name or a Strategy, got {type(spec).__name__}")
    if spec == "auto":
        spec = "ddp" if env.world_size > 1 else "single"
    try:
        return create(spec, **options)
    except TypeError as e:
        raise ConfigError(_bad_option(spec, options, e)) from None


def check_world(name: str, world_size: int, **options: Any) -> None:
    """Raise the strategy's own one-line ``ConfigError`` unless ``name`` with ``options`` can run on
    ``world_size`` local processes (checked before anything is launched)."""
    try:
        strategy = create(name, **_own(options))
    except TypeError as err:
        raise ConfigError(_bad_option(name, options, err)) from None
    env = ClusterEnv(world_size=world_size, local_world_size=world_size, launched=True)
    strategy.validate(env)
    strategy.dims(env)  # degrees the world does not divide (tp=3 of 4) say so here


def _bad_option(name: str, options: dict[str, Any], err: TypeError) -> str:
    """The line for options strategy ``name`` refused: ``ep`` named for what it is when it alone was the problem (a
    strategy that takes no options says only that)."""
    if options.get("ep", 1) != 1:
        try:
            create(name, **{k: v for k, v in options.items() if k != "ep"})
        except TypeError:
            pass
        else:
            return refuse_degree(name, "ep", options["ep"])
    return f"bad option for strategy {name!r}: {err}"


def serves(name: str) -> bool:
    """Whether strategy ``name`` has ranks that serve the others instead of training (parameter servers)."""
    return create(name).server.serves


def sends_host_tensors(name: str, **options: Any) -> bool:
    """Whether strategy ``name`` with ``options`` sends host tensors through its group (CPU offload, parameter
    servers): :attr:`~paratrain.strategies.base.Strategy.host_tensors`."""
    return create(name, **_own(options)).host_tensors


def check_every_rank_trains(name: str, **options: Any) -> None:
    """Raise a one-line ``ConfigError`` when ``name`` has ranks that serve instead of training (parameter servers):
    tools that compare every rank's steps (``paratrain verify``) cannot run it."""
    try:
        strategy = create(name, **_own(options))
    except TypeError as err:
        raise ConfigError(_bad_option(name, options, err)) from None
    if strategy.server.serves:
        raise ConfigError(
            f"strategy {name!r} has ranks that serve instead of training, and this tool compares "
            "every rank's steps; tests prove it equal to one process, and 'paratrain bench "
            "--strategies ddp,ps' measures it against ddp"
        )


def _own(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` but those applied around the strategy (:data:`AROUND`)."""
    return {k: v for k, v in options.items() if k not in AROUND}
