"""Strategy names → factories. Unknown names are answered with the list of valid ones."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import UnknownStrategyError
from .base import Strategy

_FACTORIES: dict[str, Callable[..., Strategy]] = {}


def register(*names: str) -> Callable[[type[Strategy]], type[Strategy]]:
    """Class decorator: make a strategy constructible by each of ``names``."""

    def deco(cls: type[Strategy]) -> type[Strategy]:
        for n in names:
            if n in _FACTORIES:
                raise RuntimeError(f"strategy name {n!r} registered twice")
            _FACTORIES[n] = cls
        return cls

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


def check_world(name: str, world_size: int, **options: Any) -> None:
    """Raise the strategy's own one-line ``ConfigError`` unless ``name`` with ``options`` can run on
    ``world_size`` local processes (checked before anything is launched)."""
    from ..env import ClusterEnv
    from ..errors import ConfigError

    try:
        strategy = create(name, **options)
    except TypeError as err:
        raise ConfigError(f"bad option for strategy {name!r}: {err}") from None
    env = ClusterEnv(world_size=world_size, local_world_size=world_size, launched=True)
    strategy.validate(env)
    strategy.mesh_dims(env)  # degrees the world does not divide (tp=3 of 4) say so here
