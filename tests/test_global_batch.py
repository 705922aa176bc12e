"""The global batch stated once: ``Parallel(accumulate=GlobalBatch(size, micro=))`` and the accumulation that follows
from the layout (:class:`paratrain.loop.GlobalBatch`)."""

from __future__ import annotations

import pytest
import torch

import paratrain
from paratrain.errors import ConfigError
from paratrain.loop import GlobalBatch


def test_accumulation_follows_from_the_replicas():
    batch = GlobalBatch(480, 12)
    assert batch.accumulate(1, None) == 40
    assert batch.accumulate(8, None) == 5
    assert GlobalBatch(480).accumulate(4, 12) == 10  # the micro-batch from a loader


@pytest.mark.parametrize(
    "size, micro, replicas, said",
    [
        (100, 12, 2, "GlobalBatch(100) does not divide into micro-batches of 12 x 2 data-parallel replica(s) = 24"),
        (100, None, 2, "needs micro="),
    ],
)
def test_a_batch_that_does_not_divide_is_one_line(size, micro, replicas, said):
    with pytest.raises(ConfigError) as err:
        GlobalBatch(size, micro).accumulate(replicas, None)
    assert said in str(err.value) and "\n" not in str(err.value)


def test_the_hint_names_a_micro_batch_that_fits():
    with pytest.raises(ConfigError, match=r"micro=10 fits"):
        GlobalBatch(100, 12).accumulate(1, None)


def test_bad_combinations_are_one_line():
    with pytest.raises(ConfigError, match="give one of them"), pytest.warns(FutureWarning):
        paratrain.Parallel("single", accumulate=4, global_batch=64, micro_batch=8, monitor=False)
    with pytest.raises(ConfigError, match="without global_batch"), pytest.warns(FutureWarning):
        paratrain.Parallel("single", micro_batch=8, monitor=False)
    with pytest.raises(ConfigError, match="size must be an integer >= 1"):
        paratrain.Parallel("single", monitor=False, accumulate=paratrain.GlobalBatch(0))


def test_one_process_accumulates_the_whole_global_batch():
    par = paratrain.Parallel("single", monitor=False, accumulate=paratrain.GlobalBatch(64, micro=8))
    assert par.accumulate == 8
    par.close()


def test_the_micro_batch_may_come_from_the_loader():
    par = paratrain.Parallel("single", monitor=False, accumulate=paratrain.GlobalBatch(64))
    model = torch.nn.Linear(2, 1)
    data = torch.utils.data.TensorDataset(torch.zeros(64, 2), torch.zeros(64, 1))
    model, opt, loader = par.prepare(
        model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(data, batch_size=16)
    )
    assert par.accumulate == 4
    par.close()


def test_a_step_before_the_micro_batch_is_known_is_one_line():
    par = paratrain.Parallel("single", monitor=False, accumulate=paratrain.GlobalBatch(64))
    model = torch.nn.Linear(2, 1)
    model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ConfigError, match="needs micro="):
        with par.step(model, opt):
            pass
    par.close()
