"""Functions the user names on the command line as ``package.module:function`` (models, workloads, setups)."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from .errors import ConfigError


def load_callable(path: str, what: str) -> Callable[..., Any]:
    """The function named by ``package.module:function`` (the working directory is importable)."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ConfigError(f"{what} {path!r}: write module:function, e.g. mymodels:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ConfigError(f"{what} {path!r}: cannot import {module_name!r} ({err})") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{what} {path!r}: {module_name} has no function {attr!r}")
    return factory
