"""A pipeline lays each stage out with the data engine the presets use (``strategies/data_engines.py``), held as an
object and called for each stage, never chosen by comparing the engine's name (``fsdp`` is zero3's engine): one
fake rank of a 4-process ``hybrid`` job (dp=2 x pp=2) on the fake process group, no process started."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

import paratrain
from paratrain import ClusterEnv
from paratrain.planner.transformer import GPTConfig
from paratrain.strategies import PRESETS, create
from paratrain.strategies.data_engines import Shards
from paratrain.workloads.gpt import GPT

ENV = ClusterEnv(rank=0, local_rank=0, world_size=4, local_world_size=4, launched=True)


def _hybrid(**options: object) -> paratrain.Parallel:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)  # the autouse fixture destroys it
    return paratrain.Parallel(
        "hybrid", accelerator="cpu", monitor=False, precision="bf16-mixed", job=paratrain.JobConfig(env=ENV), **options
    )


def _stages(par: paratrain.Parallel) -> tuple[list[torch.nn.Module], torch.optim.Optimizer]:
    """This rank's prepared stages and optimizer."""
    model = GPT(GPTConfig(layers=4, hidden=32, heads=4, seq_len=16, vocab=64))
    model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters()))
    return [part for _, part in model.parts], optimizer


@pytest.mark.parametrize("data, preset", [("ddp", "ddp"), ("zero1", "zero1"), ("zero3", "zero3"), ("fsdp", "zero3")])
def test_hybrid_holds_the_engine_of_the_preset_its_data_names(data, preset):
    par = _hybrid(data=data)
    assert type(par.strategy.data) is PRESETS[preset].engine
    assert par.strategy.dims(ENV).zero == create(preset).dims(ENV).zero
    stages, optimizer = _stages(par)
    if preset == "zero3":  # each block a unit, the stage's root handing its outputs on in fp32
        assert all(isinstance(s, FSDPModule) and isinstance(s.stage.blocks[0], FSDPModule) for s in stages)
        assert {s._get_fsdp_state()._mp_policy.output_dtype for s in stages} == {torch.float32}
    else:  # DDP whose forward never prepares the reducer (the stage does, before the last backward chunk)
        assert all(isinstance(s, DDP) and not s.require_backward_grad_sync for s in stages)
    assert isinstance(optimizer, ZeroRedundancyOptimizer) == (preset == "zero1")


def test_hybrid_lays_its_stages_out_with_the_engine_it_holds_not_by_its_name():
    """Told data='ddp' but holding zero3's engine, a hybrid plans ZeRO-3 and shards its stages: the engine decides."""
    par = _hybrid(data="ddp")
    par.strategy.data = Shards({}, split=False)
    assert par.strategy.dims(ENV).zero == 3
    stages, optimizer = _stages(par)
    assert all(isinstance(s, FSDPModule) for s in stages) and not isinstance(optimizer, ZeroRedundancyOptimizer)


def test_a_pipeline_of_one_replica_lays_out_nothing():
    """``pipeline`` has no dp ranks to lay a stage out across, whatever ``data`` says."""
    assert type(create("pipeline", data="zero3").data) is PRESETS["single"].engine
