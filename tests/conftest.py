"""Shared fixtures: every test starts with a clean environment and no process group, and leaves none."""

from __future__ import annotations

import os

import pytest
from helpers import unit_lane
from helpers.cli import PARATRAIN

from paratrain.testing import preload

# imported once, in the fork server every launched job's ranks start from (the zoo's models: seconds a rank)
ZOO_MODULES = ("gpt2", "llama", "mixtral", "qwen2", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "bert")
preload("transformers", *(f"transformers.models.{m}.modeling_{m}" for m in ZOO_MODULES))

_LAUNCH_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_RESTART_COUNT",
    "OMP_NUM_THREADS",
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """In the unit lane a test not marked ``launched`` may start no process (helpers/unit_lane.py)."""
    if not unit_lane.guarded(item):
        return (yield)
    with unit_lane.no_process(item.nodeid):
        return (yield)


@pytest.fixture(autouse=True)
def clean_distributed_env():
    saved = dict(os.environ)
    for key in _LAUNCH_VARS:
        os.environ.pop(key, None)
    # a suite run inside a SLURM allocation or a Kubernetes pod (Kubeflow's PET_* are torchrun's flags)
    for key in [k for k in os.environ if k.startswith(("SLURM_", "PET_", "KUBERNETES_"))]:
        del os.environ[key]
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture
def paratrain_cmd() -> list[str]:
    """The CLI as a subprocess command, from this interpreter's environment."""
    return list(PARATRAIN)
