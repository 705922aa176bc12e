"""The optimizer step over replicated DTensor parameters on their local tensors
(``paratrain.distributed.tensor_parallel.local_step``), on a one-rank mesh in this process: the same numbers as plain
tensors, DTensors again after the step (also when it raises), and no swap where torch would step every parameter in
a few multi-tensor ops. Equality with one process at world 2 and 4, checkpoints and FSDP over ``(dp, tp)``: the
launched jobs of tests/distributed/test_tp_auto.py and tests/distributed/test_tensor_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from paratrain.distributed.tensor_parallel.local_step import replicated_locally


@pytest.fixture
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh("cpu", (1,))


def _params(mesh, **options) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter], torch.optim.Optimizer]:
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    dtensors = [
        torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [pl]))
        for p, pl in zip(plain, (Shard(0), Replicate()))
    ]
    return plain, dtensors, torch.optim.AdamW(dtensors, lr=0.1, **options)


def _grads(plain: list[torch.nn.Parameter], dtensors: list[torch.nn.Parameter], step: int, mesh) -> None:
    for p, d in zip(plain, dtensors):
        p.grad = torch.full_like(p, 0.5 + step)
        d.grad = distribute_tensor(p.grad.clone(), mesh, d.placements)


def test_replicated_parameters_step_on_local_tensors_with_the_same_numbers(mesh):
    plain, dtensors, opt = _params(mesh)
    reference = torch.optim.AdamW(plain, lr=0.1)
    seen = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append([isinstance(p, DTensor) for p in o.param_groups[0]["params"]])
    )
    for step in range(3):
        _grads(plain, dtensors, step, mesh)
        with replicated_locally(opt):
            opt.step()
        reference.step()
    assert seen == [[True, True]] + [[True, False]] * 2  # the first step makes the state, as DTensors
    for p, d in zip(plain, dtensors):
        assert torch.equal(d.to_local(), p.detach())
        assert isinstance(d.grad, DTensor) and all(
            isinstance(v, DTensor) for k, v in opt.state[d].items() if k != "step"
        )
        assert torch.equal(opt.state[d]["exp_avg_sq"].to_local(), reference.state[p]["exp_avg_sq"])
    assert len(opt.state) == 2  # no local tensor left as a key


def test_multi_tensor_steps_keep_dtensors(mesh):
    plain, dtensors, opt = _params(mesh, foreach=True)
    seen = []
    opt.register_step_pre_hook(
        lambda o, args, kwargs: seen.append(all(isinstance(p, DTensor) for p in o.param_groups[0]["params"]))
    )
    for step in range(2):
        _grads(plain, dtensors, step, mesh)
        with replicated_locally(opt):
            opt.step()
    assert seen == [True, True]


def test_a_step_that_raises_puts_the_dtensors_back(mesh):
    plain, dtensors, opt = _params(mesh)
    _grads(plain, dtensors, 0, mesh)
    opt.step()
    opt.register_step_pre_hook(lambda o, args, kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError), replicated_locally(opt):
        opt.step()
    assert all(p is d for p, d in zip(opt.param_groups[0]["params"], dtensors))
    assert len(opt.state) == 2 and all(isinstance(opt.state[d]["exp_avg"], DTensor) for d in dtensors)
