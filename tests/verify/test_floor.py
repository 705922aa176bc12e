"""The noise floor under a 16-bit compute dtype: the twin reference runs each forward on the parallel run's
micro-batches, so it rounds as the ranks do (src/paratrain/verify/floor.py)."""

from __future__ import annotations

import torch
from torch import nn

from paratrain.precision import create_precision
from paratrain.verify.floor import rounds_per_micro_batch, split_forward


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
    split_forward(model, 8)
    assert torch.equal(_grads(model, [x]), ranks)  # one call, the ranks' rounding
    model.eval()  # not a training call (evaluation): one forward
    assert torch.equal(_grads(model, [x]), whole)


def test_split_outputs_join_batches_and_weigh_a_models_own_loss():
    class OwnLoss(nn.Module):
        def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, (x - y).square().mean()

    model = OwnLoss().train()
    split_forward(model, 3)
    x, y = torch.arange(7.0).requires_grad_(), torch.zeros(7)
    out, loss = model(x, y)
    assert torch.equal(out, x * 2)
    assert torch.allclose(loss, x.square().mean())  # micro-batches of 3, 3 and 1 weighed by their samples


def test_only_a_16bit_compute_dtype_without_batchnorm_is_split():
    mlp = nn.Sequential(nn.Linear(4, 4), nn.Tanh())
    for name in ("bf16-mixed", "fp16-mixed", "bf16-true"):
        assert rounds_per_micro_batch(mlp, create_precision(name)), name
    assert not rounds_per_micro_batch(mlp, create_precision("fp32"))  # fp32: the floor as it was
    assert not rounds_per_micro_batch(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), create_precision("bf16-mixed"))
