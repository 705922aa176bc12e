"""Registered strategies. Importing this package registers every built-in one."""
from .base import Runtime, Strategy
from .ddp import DDPConfig, DDPStrategy, apply_ddp
from .registry import available, check_name, create, register
from .single import SingleDevice

__all__ = ["Runtime", "Strategy", "DDPConfig", "DDPStrategy", "apply_ddp", "SingleDevice", "available", "check_name", "create", "register"]
