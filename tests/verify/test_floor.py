"""The noise floor under a 16-bit compute dtype: the twin reference runs each forward on the parallel run's
micro-batches, so it rounds as the ranks do (src/paratrain/verify/floor.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratrain.precision import create_precision
from paratrain.verify.floor import NoiseFloor, Rounding, compute_rounding, rounding_dtype, split_forward
from paratrain.verify.record import Record


def _grads(model: nn.Module, calls: list[torch.Tensor]) -> torch.Tensor:
    """The weight gradient of the summed outputs of ``model`` over ``calls``."""
    model.zero_grad()
    for x in calls:
        model(x).sum().backward()
    return model.weight.grad.clone()


def test_the_twin_rounds_each_micro_batch_as_a_rank_does():
    torch.manual_seed(0)
    model, x = nn.Linear(64, 64), torch.randn(32, 64)
    create_precision("bf16-mixed").wrap_forward(model, torch.device("cpu"))  # as Parallel prepares it
    whole, ranks = _grads(model, [x]), _grads(model, list(x.split(8)))
    assert not torch.equal(whole, ranks)  # bf16 rounds each micro-batch's gradient: the floor a reorder cannot see
    split_forward(model, 8, torch.bfloat16)
    assert torch.equal(_grads(model, [x]), ranks)  # one call, the ranks' rounding
    model.eval()  # not a training call (evaluation): one forward
    assert torch.equal(_grads(model, [x]), whole)


def test_split_outputs_join_batches_and_weigh_a_models_own_loss():
    class OwnLoss(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, (x - y).square().mean()

    model = OwnLoss().train()
    split_forward(model, 3, torch.float32)
    x, y = torch.arange(7.0).requires_grad_(), torch.zeros(7)
    out, loss = model(x, y)
    assert torch.equal(out, x * 2)
    assert torch.allclose(loss, x.square().mean())  # micro-batches of 3, 3 and 1 weighed by their samples


def test_the_twin_casts_parameters_as_fsdp_does():
    """An embedding's gradient, which autocast leaves in fp32, rounds to bf16 under FSDP's mixed precision."""
    torch.manual_seed(0)
    model, ids = nn.Embedding(8, 16).train(), torch.randint(0, 8, (64,))
    exact = torch.autograd.grad(model(ids).square().sum(), model.weight)[0]
    split_forward(model, 32, torch.bfloat16)
    model(ids).float().square().sum().backward()
    assert model.weight.grad.dtype == torch.float32
    assert (model.weight.grad - exact).abs().max() > 2**-10 * exact.abs().max()  # bf16's rounding, not fp32's
    torch.testing.assert_close(model.weight.grad, exact, rtol=2**-6, atol=0)  # bf16 rounding, no more


def test_only_a_16bit_compute_dtype_without_batchnorm_is_split():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    dtypes = {name: rounding_dtype(mlp, create_precision(name)) for name in ("bf16-mixed", "fp16-mixed", "bf16-true")}
    assert dtypes == {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16, "bf16-true": torch.bfloat16}
    assert rounding_dtype(mlp, create_precision("fp32")) is None  # fp32: the floor as it was
    assert rounding_dtype(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), create_precision("bf16-mixed")) is None


def _run(*weights: float, loss: float = 2.0) -> Record:
    return Record(
        losses=[[loss]] * len(weights),
        grad_norms=[1.0] * len(weights),
        states=[{"w": torch.tensor([w]), "b": torch.tensor([0.05 * (s + 1)])} for s, w in enumerate(weights)],
    )


def test_a_16bit_compute_dtype_allows_its_rounding_beyond_the_measured_floor():
    ref, twin = _run(0.1, 0.2), _run(0.1 + 1e-4, 0.2)  # w's floor 1e-4, b's 0
    start = {"w": torch.tensor([0.0]), "b": torch.tensor([0.0])}  # updates: w 0.1 a step, b 0.05
    fp32 = NoiseFloor(ref, twin)
    bf16 = NoiseFloor(ref, twin, rounding=compute_rounding(create_precision("bf16-mixed")), start=start)
    assert compute_rounding(create_precision("fp32")) == Rounding()
    assert fp32.scalar("loss", 0, 2.0).allowed == pytest.approx(8 * 2 * 1.19e-7, rel=1e-2)
    # the loss and gradient norm: 1/32 of a bf16 ulp beside the floor; a missing division (2x) stays far outside
    assert bf16.scalar("loss", 0, 2.0).allowed == pytest.approx(fp32.scalar("loss", 0, 2.0).allowed + 2 / 4096)
    assert bf16.scalar("grad_norm", 0, 1.0).allowed < 1e-3
    # b: its own floor is 0; under bf16 the state's largest (w's), and 4 bf16 ulps of its largest update
    assert fp32.entry(0, "b", 0.05).floor == 0.0
    b = bf16.entry(1, "b", 0.1)
    assert b.floor == pytest.approx(1e-4, rel=1e-3)
    assert b.allowed == pytest.approx(10 * 1e-4 + 8 * 1.19e-7 + 4 * 2**-7 * 0.05, rel=1e-3)
    bf16_true = compute_rounding(create_precision("bf16-true"))  # its loss itself is bf16: two of its ulps
    assert bf16_true.scalars == pytest.approx(2 * 2**-7)
    ulp_apart = NoiseFloor(_run(0.1, loss=1.5), _run(0.1, loss=1.5 + 2**-7), rounding=bf16_true)
    assert ulp_apart.unrepeatable(_run(0.1, loss=1.5)) is None  # one bf16 ulp: rounding, not randomness
    assert NoiseFloor(_run(0.1, loss=1.5), _run(0.1, loss=1.5 + 2**-7)).unrepeatable(_run(0.1)) is not None
