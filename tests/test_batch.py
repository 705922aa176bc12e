"""How ``forward_backward`` hands a micro-batch to the model and reads the loss a model computes itself
(:mod:`paratrain.batch`), in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.batch import ModelCall, counted, loss_of
from paratrain.errors import ConfigError


class TargetsInForward(nn.Module):
    """nanoGPT's contract: ``forward(idx, targets=None) -> (logits, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 6)
        self.head = nn.Linear(6, 10)

    def forward(self, idx, targets=None, *, scale=1.0):
        logits = self.head(self.emb(idx)) * scale
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        return logits, loss


def test_the_loss_is_read_from_every_kind_of_output():
    loss = torch.tensor(2.0)
    logits = torch.zeros(2, 3)
    assert loss_of((logits, loss)) is loss  # nanoGPT
    assert loss_of((loss, logits)) is loss  # transformers' return_dict=False
    assert loss_of({"loss": loss, "logits": logits}) is loss
    assert loss_of(type("Out", (), {"loss": loss})()) is loss  # a ModelOutput
    assert loss_of(loss) is loss


@pytest.mark.parametrize(
    "out, said",
    [
        ((torch.zeros(2, 3), None), "without a loss"),
        ((torch.tensor(1.0), torch.tensor(2.0)), "2 scalars"),
        (torch.zeros(2, 3), "without a loss"),
    ],
)
def test_an_output_without_one_loss_is_one_line(out, said):
    with pytest.raises(ConfigError, match=said):
        loss_of(out)


def test_targets_go_positionally_keywords_by_name_and_loss_inputs_apart():
    x, y, mask = torch.ones(1, 2), torch.zeros(1, 2), torch.ones(1, 2)
    call = ModelCall.of(x, y, None, {"attention_mask": mask, "labels": y})
    assert call.own_loss and call.args()[1] is y
    assert set(call.kwargs) == {"attention_mask"} and set(call.loss_kwargs) == {"labels"}
    batch = ModelCall.of({"input_ids": x, "labels": y}, None, None, {})  # a transformers batch dict
    assert batch.x is None and batch.first_tensor() is x and set(batch.loss_kwargs) == {"labels"}
    keywords = ModelCall.of(x, {"shift_labels": y}, None, {})
    assert keywords.args() == (x,) and set(keywords.loss_kwargs) == {"shift_labels"}
    with_fn = ModelCall.of(x, y, F.mse_loss, {})
    assert not with_fn.own_loss and with_fn.args() == (x,)


def test_forward_backward_trains_a_model_that_computes_its_own_loss():
    """The same gradients as the plain loop: loss inside forward, keywords passed on, accumulation divided."""
    idx, targets = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(1)), None
    targets = torch.randint(0, 10, (4, 5), generator=torch.Generator().manual_seed(2))
    plain = TargetsInForward()
    (plain(idx, targets, scale=2.0)[1] / 2).backward()
    model = TargetsInForward()
    par = paratrain.Parallel("single", accumulate=2, monitor=False)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with par.step(model, opt) as info:
        loss = par.forward_backward(model, idx, targets, scale=2.0)
        assert not info.sync
    assert torch.allclose(loss, plain(idx, targets, scale=2.0)[1])
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a.grad, b.grad)
    par.close()


def test_a_model_returning_no_loss_is_one_line():
    par = paratrain.Parallel("single", monitor=False)
    model = par.prepare(TargetsInForward())
    with pytest.raises(ConfigError, match="without a loss"):
        par.forward_backward(model, torch.zeros(1, 2, dtype=torch.long))
    par.close()


def test_a_loss_fns_mean_is_weighed_by_its_counted_targets():
    """A packed batch's ``loss_fn`` mean (``ModelCall.items`` set): its sum over the replica's share of the global
    count; targets below 0 count for nothing (torch's -100, nanoGPT's -1); a part with none counted adds 0, not nan;
    a floating target counts every element without a copy from the host (which would wait for a GPU's queue)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    logits, target = torch.randn(1, 6, 5), torch.tensor([[1, 2, -100, 3, -100, 4]])
    assert int(counted(torch.tensor([[1, 2, -100, 3, -1, 4]]))) == 4
    loss_fn = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    assert torch.equal(ModelCall(x=None, target=target, loss_fn=loss_fn).loss(logits), loss_fn(logits, target))
    weighed = ModelCall(x=None, target=target, loss_fn=loss_fn, items=torch.tensor(8.0))
    assert torch.allclose(weighed.loss(logits), loss_fn(logits, target) * 4 / 8)
    none = torch.full((1, 6), -100)
    assert float(weighed.weigh(F.cross_entropy(logits[0], none[0]), none)) == 0.0

    class Lifted(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Lifted.count += func is torch.ops.aten.lift_fresh.default
            return func(*args, **(kwargs or {}))

    with Lifted():
        assert int(counted(torch.randn(2, 3))) == 6
    assert Lifted.count == 0
