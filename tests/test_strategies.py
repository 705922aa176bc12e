import pytest
import torch
from torch import nn

import paratrain
from paratrain import ClusterEnv, ConfigError, UnknownStrategyError
from paratrain.strategies import available, create


def test_registry_lists_builtin_strategies():
    assert {"single", "ddp", "auto"} <= set(available())


def test_unknown_strategy_names_the_valid_ones():
    with pytest.raises(UnknownStrategyError, match="choose one of: .*ddp.*single") as info:
        create("ddpp")
    assert "\n" not in str(info.value)
    with pytest.raises(UnknownStrategyError):
        paratrain.Parallel("nope")


def test_auto_is_single_in_one_process():
    par = paratrain.Parallel("auto")
    assert par.strategy.name == "single" and par.mesh is None


def test_single_refuses_a_multi_process_job():
    env = ClusterEnv(rank=0, world_size=2, local_world_size=2, master_port=1, launched=True)
    with pytest.raises(ConfigError, match="independent copies"):
        paratrain.Parallel("single", env=env)


def test_ddp_options_are_validated():
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        paratrain.Parallel("ddp", bucket_cap_mb=0)
    with pytest.raises(ConfigError, match="bad option"):
        paratrain.Parallel("ddp", no_such_option=1)


@pytest.mark.parametrize("kwargs, words", [({"accumulate": 0}, "accumulate"), ({"precision": "fp8"}, "precision"),
                                           ({"accelerator": "tpu"}, "accelerator"), ({"timeout_s": 0}, "timeout")])
def test_bad_parallel_options(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        paratrain.Parallel(**kwargs)


def test_single_process_accumulation_steps_every_k_micro_batches():
    par = paratrain.Parallel("single", accumulate=3)
    model = nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = par.prepare(model, opt)
    before = model.weight.detach().clone()
    syncs = []
    for i in range(3):
        with par.step(model, opt) as step:
            par.backward(model(torch.ones(1, 2)).sum())
        syncs.append(step.sync)
        changed = not torch.equal(before, model.weight)
        assert changed == (i == 2)
    assert syncs == [False, False, True]
    assert model.weight.grad is None  # zeroed after the optimizer step


def test_metrics_reduce_in_one_process():
    par = paratrain.Parallel()
    assert par.mean(2.5) == 2.5 and par.sum(3) == 3.0
    t = par.mean(torch.tensor([1.0, 2.0]))
    assert t.dtype == torch.float32 and t.tolist() == [1.0, 2.0]
    assert par.sum(torch.tensor(4)).dtype == torch.int64


def test_prepare_rejects_foreign_objects_and_optimizer_first():
    par = paratrain.Parallel()
    with pytest.raises(ConfigError, match="takes nn.Module"):
        par.prepare(object())
    model = nn.Linear(1, 1)
    with pytest.raises(ConfigError, match="model first"):
        par.prepare(torch.optim.SGD(model.parameters(), lr=1.0), model)


def test_logger_lines_carry_the_rank(capsys):
    par = paratrain.Parallel()
    par.logger.info("hello")
    assert "[rank 0/1] INFO hello" in capsys.readouterr().err
