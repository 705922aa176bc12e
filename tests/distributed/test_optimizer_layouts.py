"""CUDA's optimizer paths over param groups that mix plain tensors and DTensors of several layouts
(``paratrain.distributed.optimizer.step_by_layout``, ``paratrain.precision.ScalerByLayout``), on a one-rank mesh in
this process (and on a GPU where there is one): multi-tensor (``foreach``) and ``fused`` steps with the numbers of
plain tensors, the user's param groups unchanged around them (LR schedulers, edits, state dicts, a step that
raises), and fp16's grad scaler. With experts under ``Parallel("ddp", ep=2)`` at world 2: the launched job of
tests/distributed/test_expert_parallel.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from paratrain.distributed.optimizer import step_by_layout
from paratrain.precision import ScalerByLayout

PLACEMENTS = (None, Shard(0), Replicate(), None)  # plain, DTensor, DTensor laid out otherwise, plain


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
)


@pytest.fixture(params=["cpu", CUDA])
def mesh(request):
    """A one-rank mesh on the CPU (gloo) and, where there is one, on a GPU (NCCL, CUDA's kernels)."""
    backend = "gloo" if request.param == "cpu" else "nccl"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return init_device_mesh(request.param, (1,))


def _mixed(mesh) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """Plain parameters, and the same values laid out as :data:`PLACEMENTS` says."""
    torch.manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(4, 3).to(mesh.device_type)) for _ in PLACEMENTS]
    mixed = [
        torch.nn.Parameter(p.detach().clone() if pl is None else distribute_tensor(p.detach().clone(), mesh, [pl]))
        for p, pl in zip(plain, PLACEMENTS, strict=True)
    ]
    return plain, mixed


def _grads(plain: list[torch.nn.Parameter], mixed: list[torch.nn.Parameter], step: int) -> None:
    for i, (p, m) in enumerate(zip(plain, mixed, strict=True)):
        p.grad = torch.full_like(p, 0.5 + step + i)
        m.grad = (
            p.grad.clone()
            if not isinstance(m, DTensor)
            else distribute_tensor(p.grad.clone(), m.device_mesh, m.placements)
        )


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@pytest.mark.parametrize("path", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
def test_multi_tensor_steps_over_mixed_layouts_equal_plain_tensors(mesh, path):
    plain, mixed = _mixed(mesh)
    reference = torch.optim.AdamW(plain, lr=0.1, **path)
    opt = step_by_layout(torch.optim.AdamW(mixed, lr=0.1, **path))
    groups, params = opt.param_groups, list(opt.param_groups[0]["params"])
    seen = []
    opt.register_step_pre_hook(lambda o, args, kwargs: seen.append(len(o.param_groups)))
    for step in range(3):
        _grads(plain, mixed, step)
        opt.step()
        reference.step()
    for p, m in zip(plain, mixed, strict=True):
        assert torch.equal(_local(m).detach(), p.detach())
    assert seen == [3] * 3, "one group per layout in the step: plain, Shard(0), Replicate()"
    assert opt.param_groups is groups and opt.param_groups[0]["params"] == params, "the user's group after it"


def test_the_users_groups_stay_what_schedulers_edits_and_state_dicts_see(mesh):
    plain, mixed = _mixed(mesh)
    opt = step_by_layout(
        torch.optim.SGD([{"params": mixed[:2], "lr": 0.1}, {"params": mixed[2:], "lr": 0.2}], foreach=True)
    )
    reference = torch.optim.SGD([{"params": plain[:2], "lr": 0.1}, {"params": plain[2:], "lr": 0.2}])
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.5**s, lambda s: 1.0]) for o in (opt, reference)]
    for step in range(3):
        if step == 1:
            for o in (opt, reference):
                o.param_groups[1]["lr"] = 0.05  # the user's edit reaches the whole group's step (then LambdaLR's)
        _grads(plain, mixed, step)
        for o, scheduler in zip((opt, reference), schedulers, strict=True):
            o.step()
            scheduler.step()
    for p, m in zip(plain, mixed, strict=True):
        assert torch.allclose(_local(m).detach(), p.detach())
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in reference.param_groups] == [0.1 * 0.5**3, 0.2]
    assert len(opt.state_dict()["param_groups"]) == 2, "checkpoints hold the user's groups"


class _Counting(torch.optim.SGD):
    """An optimizer that keeps a count of its steps in each param group, as some do."""

    def step(self, closure=None):
        for group in self.param_groups:
            group["steps"] = group.get("steps", 0) + 1
        return super().step(closure)


def test_what_the_step_writes_into_a_group_is_written_back_once(mesh):
    _, mixed = _mixed(mesh)
    opt = step_by_layout(_Counting(mixed, lr=0.1, foreach=True))
    for step in range(2):
        _grads(mixed, mixed, step)
        opt.step()
    assert len(opt.param_groups) == 1 and opt.param_groups[0]["steps"] == 2


def test_a_step_that_raises_leaves_the_users_groups(mesh):
    _, mixed = _mixed(mesh)
    opt = step_by_layout(torch.optim.SGD(mixed, lr=0.1, foreach=True))
    groups = opt.param_groups

    def fail(o, args, kwargs):
        raise RuntimeError("step failed")

    opt.register_step_pre_hook(fail)
    with pytest.raises(RuntimeError, match="step failed"):
        opt.step()
    assert opt.param_groups is groups and len(groups[0]["params"]) == len(PLACEMENTS)


@pytest.mark.parametrize("inf", [False, True], ids=["finite", "inf-in-a-dtensor"])
def test_the_grad_scaler_unscales_mixed_layouts_and_skips_on_any_inf(mesh, inf):
    plain, mixed = _mixed(mesh)
    device = mesh.device_type
    scaler, reference_scaler = ScalerByLayout(device, init_scale=4.0), torch.amp.GradScaler(device, init_scale=4.0)
    opt = step_by_layout(torch.optim.AdamW(mixed, lr=0.1, foreach=True))
    reference = torch.optim.AdamW(plain, lr=0.1, foreach=True)
    _grads(plain, mixed, 0)
    if inf:
        plain[1].grad[0, 0] = mixed[1].grad.to_local()[0, 0] = float("inf")
    for s, o in ((scaler, opt), (reference_scaler, reference)):
        s.scale(torch.ones((), device=device))  # the gradients above stand for scaled ones
        s.unscale_(o)
        s.step(o)
        s.update()
    for p, m in zip(plain, mixed, strict=True):
        assert torch.equal(_local(m).detach(), p.detach())
    assert scaler.get_scale() == reference_scaler.get_scale() == (2.0 if inf else 4.0)
    torchs = torch.amp.GradScaler(device)
    torchs.scale(torch.ones((), device=device))
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):  # what torch's own scaler does
        torchs.unscale_(opt)
