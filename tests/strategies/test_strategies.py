import pytest
import torch
from torch import nn

import paratrain
from paratrain import ClusterEnv, ConfigError, UnknownStrategyError
from paratrain.strategies import available, create
from paratrain.testing.host_syncs import HostSyncs


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
        paratrain.Parallel("single", job=paratrain.JobConfig(env=env))


def test_ddp_options_are_validated():
    with pytest.raises(ConfigError, match="bucket_cap_mb"):
        paratrain.Parallel("ddp", bucket_cap_mb=0)
    with pytest.raises(ConfigError, match="bad option"):
        paratrain.Parallel("ddp", no_such_option=1)


def test_every_data_and_tp_strategy_is_a_row_of_the_preset_table():
    """One class runs every preset; what tells ddp from zero3 or tp is the row and the options, and the documented
    constructors build exactly what the name does."""
    from paratrain import strategies

    env = ClusterEnv(world_size=4, local_world_size=4, launched=True)
    for name, preset in strategies.PRESETS.items():
        built = create(name)
        assert type(built) is strategies.Composed and built.preset is preset
    assert create("fsdp").preset is strategies.PRESETS["zero3"]
    documented = {
        "single": strategies.SingleDevice,
        "ddp": strategies.DDPStrategy,
        "zero1": strategies.Zero1Strategy,
        "zero2": strategies.Zero2Strategy,
        "zero3": strategies.Zero3Strategy,
        "hsdp": strategies.HSDPStrategy,
        "tp": strategies.TPStrategy,
    }
    assert set(documented) == set(strategies.PRESETS)
    for name, constructor in documented.items():
        assert constructor().describe() == create(name).describe()
        if name != "single":
            assert constructor().dims(env) == create(name).dims(env)
    config = strategies.DDPStrategy(paratrain.DDPConfig(bucket_cap_mb=50))
    assert config.describe() == "ddp(bucket_cap_mb=50)"
    with pytest.raises(ConfigError, match="beside a config object"):
        strategies.DDPStrategy(paratrain.DDPConfig(), bucket_cap_mb=50)
    with pytest.raises(ConfigError, match="bad option for strategy 'tp'"):
        paratrain.Parallel("tp", bucket_cap_mb=1)
    with pytest.raises(ConfigError, match="'hsdp' does not take tp"):
        create("hsdp", tp=2)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"accumulate": 0}, "accumulate"),
        ({"precision": "fp8"}, "precision"),
        ({"accelerator": "tpu"}, "accelerator"),
        ({"job": {"timeout_s": 60}}, "job= takes a paratrain.JobConfig"),
    ],
)
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
    assert repr(par.sum(59)) == "59" and repr(par.sum(59.0)) == "59.0" and repr(par.mean(3)) == "3.0"


def test_prepare_rejects_foreign_objects_and_optimizer_first():
    par = paratrain.Parallel()
    with pytest.raises(ConfigError, match="takes nn.Module"):
        par.prepare(object())
    model = nn.Linear(1, 1)
    with pytest.raises(ConfigError, match="model first"):
        par.prepare(torch.optim.SGD(model.parameters(), lr=1.0), model)


def test_a_loss_without_a_graph_is_one_line():
    par = paratrain.Parallel("single", monitor=False)
    model = par.prepare(nn.Linear(2, 2))
    with torch.no_grad():
        loss = model(torch.ones(1, 2)).sum()
    with pytest.raises(ConfigError, match=r"does not require grad \(detached, or computed under torch.no_grad\(\)"):
        par.backward(loss)


def test_logger_lines_carry_the_rank(capsys):
    par = paratrain.Parallel()
    par.logger.info("hello")
    assert "[rank 0/1] INFO hello" in capsys.readouterr().err


def _env(world: int) -> ClusterEnv:
    return ClusterEnv(rank=0, world_size=world, local_world_size=world, master_port=1, launched=True)


@pytest.mark.parametrize(
    "strategy, options, world, words",
    [
        ("dp", {}, 2, "use strategy 'ddp'"),
        ("hybrid", {"dp": 3}, 4, "cannot split 4 processes into dp=3"),
        ("hybrid", {}, 2, "needs dp >= 2 and pp >= 2"),
        ("hsdp", {"shard_size": 3}, 4, "shard groups of 3"),
        ("hsdp", {}, 2, "at least 4 processes"),
        ("pipeline", {}, 1, "at least 2 pipeline stages"),
        ("pipeline", {"schedule": "zigzag"}, 2, "unknown pipeline schedule"),
        ("pipeline", {"schedule": "gpipe", "stages_per_rank": 2}, 2, "one stage per rank"),
        ("pipeline", {"schedule": "zbv", "stages_per_rank": 3}, 2, "exactly 2 stages per rank"),
        ("pipeline", {"schedule": "dualpipev"}, 8, r"at least as many micro-batches as stages \(16\)"),
        ("hybrid", {"schedule": "interleaved-zb", "microbatches": 5}, 4, "in 2 equal rounds over 2 ranks"),
        ("zero3", {"min_params": 0}, 2, "min_params"),
        ("ddp", {"comm_hook": "int8"}, 2, "unknown comm_hook"),
    ],
)
def test_bad_strategy_setups_are_one_line_errors_before_any_process_group(strategy, options, world, words):
    with pytest.raises(ConfigError, match=words) as info:
        paratrain.Parallel(strategy, job=paratrain.JobConfig(env=_env(world)), **options)
    assert "\n" not in str(info.value)


def test_fp16_mixed_needs_cuda():
    with pytest.raises(ConfigError, match="fp16-mixed' needs CUDA.*use 'bf16-mixed'"):
        paratrain.Parallel(precision="fp16-mixed", accelerator="cpu")


def test_model_parallel_split_must_fit_the_model():
    from paratrain.model.cuts import balance, stage_of_layers

    with pytest.raises(ConfigError, match="does not fit a model with 3 layers"):
        stage_of_layers(3, [5])
    with pytest.raises(ConfigError, match="at most 2 stages"):
        balance([1, 1], 3)
    assert balance([4, 1, 1, 1, 1], 2) == [1]  # the big first layer stands alone
    assert stage_of_layers(5, [1, 3]) == [0, 1, 1, 2, 2]


def test_model_parallel_processes_bind_their_first_stage_gpu(monkeypatch):
    """Two stages per process, four processes on an 8-GPU node: local rank 1 owns cuda:2 and cuda:3, so its process
    group and current device are cuda:2, not cuda:1 (local rank 0's second stage); five processes do not fit."""
    from dataclasses import replace

    from paratrain import session

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    bound: list[torch.device] = []
    monkeypatch.setattr(session, "start_process_group", lambda env, device, *args: bound.append(device) or False)
    env = ClusterEnv(rank=1, local_rank=1, world_size=4, local_world_size=4, master_port=1, launched=True)
    par = paratrain.Parallel("model_parallel", stages=2, monitor=False, job=paratrain.JobConfig(env=env))
    assert bound == [torch.device("cuda", 2)] and par.device == torch.device("cuda", 2)
    assert current == [torch.device("cuda", 2)]  # made current before the group starts, not cuda:1
    assert par.strategy.stage_devices(par._runtime(), 2) == [torch.device("cuda", 2), torch.device("cuda", 3)]
    with pytest.raises(ConfigError, match="2 stages per process on 5 process.*needs 10 GPUs, 8 visible") as info:
        paratrain.Parallel(
            "model_parallel", stages=2, monitor=False, job=paratrain.JobConfig(env=replace(env, local_world_size=5))
        )
    assert "\n" not in str(info.value)


def test_lr_scaling_and_warmup():
    assert paratrain.scale_lr(0.1, 4) == pytest.approx(0.4)
    assert paratrain.scale_lr(0.1, 4, rule="sqrt") == pytest.approx(0.2)
    opt = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1.0)
    sched = paratrain.linear_warmup(opt, 4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0])


@pytest.mark.parametrize("strategy", ["ddp", "zero1", "zero3", "model_parallel"])
def test_distributed_strategies_run_as_one_plain_process_and_equal_single(strategy):
    """`python train.py` with a distributed strategy: a private one-rank group, the same math as 'single'."""

    def train(name: str) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        with paratrain.Parallel(name) as par:
            model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
            model, opt = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for i in range(3):
                x = torch.randn(6, 4, generator=torch.Generator().manual_seed(i))
                with par.step(model, opt):
                    par.backward(model(x).square().mean())
            return par.full_state_dict(model)

    ours, single = train(strategy), train("single")
    assert all(torch.equal(ours[k], single[k]) for k in single)
    assert not torch.distributed.is_initialized()


def test_hsdp_needs_four_processes():
    with pytest.raises(ConfigError, match="at least 4 processes"):
        paratrain.Parallel("hsdp")


def test_clipping_matches_torch_clip_grad_norm():
    """The reference is torch's own clip_grad_norm_: once, to exactly max_norm."""
    from paratrain.distributed.grad_norm import clip_grads_with_norm, global_grad_norm

    def grads() -> list[nn.Parameter]:
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(7))]
        for p in params:
            p.grad = torch.randn_like(p) * 10
        return params

    ours, ref = grads(), grads()
    with HostSyncs() as syncs:
        norm = global_grad_norm(ours).detach()
        clip_grads_with_norm(ours, 1.0, norm)
    assert syncs.count == 0, f"clipping read the device on the host: {dict(syncs.calls)}"
    ref_norm = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert isinstance(norm, torch.Tensor) and norm.dim() == 0 and not norm.requires_grad
    assert norm == pytest.approx(float(ref_norm))
    assert all(torch.allclose(a.grad, b.grad) for a, b in zip(ours, ref))
    assert float(torch.nn.utils.get_total_norm([p.grad for p in ours])) == pytest.approx(1.0, rel=1e-5)


def test_a_clipped_step_waits_for_no_norm_until_it_is_read():
    """``par.last_grad_norm`` is a 0-d tensor: the step reads nothing on the host, the user's format does."""
    par = paratrain.Parallel("single", clip_grad_norm=0.1, monitor=False)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model, optimizer = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # SGD: no .item() of its own
    with HostSyncs() as syncs, par.step(model, optimizer):
        par.backward(model(torch.randn(8, 4)).square().mean())
    assert syncs.count == 0, dict(syncs.calls)
    assert isinstance(par.last_grad_norm, torch.Tensor) and float(par.last_grad_norm) > 0.1
    assert f"{par.last_grad_norm:.3f}" == f"{float(par.last_grad_norm):.3f}"


def test_deterministic_kernels_are_switched_on_when_asked(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    try:
        paratrain.Parallel("single", job=paratrain.JobConfig(deterministic=True))
        assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
        assert not torch.backends.cudnn.benchmark
        import os

        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = before[2], before[3]


@pytest.mark.parametrize("strategy, options", [("zero3", {}), ("model_parallel", {"stages": 2})])
def test_prepare_finds_the_models_blocks_and_ties_once(monkeypatch, strategy, options):
    """ModelFacts are found once per prepare and handed down: the wrap policy, the stage cutter and the tensor-parallel
    plan read them instead of walking the model again."""
    import sys

    from paratrain.model import structure, ties
    from paratrain.workloads.gpt import GPT, GPTConfig

    calls = {"find_blocks": 0, "find_ties": 0}

    def counted(name, real):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        return wrapper

    wrappers = {
        "find_blocks": counted("find_blocks", structure.find_blocks),
        "find_ties": counted("find_ties", ties.find_ties),
    }
    for module in [m for n, m in sys.modules.items() if n.startswith("paratrain")]:
        for name, wrapper in wrappers.items():
            if hasattr(module, name):
                monkeypatch.setattr(module, name, wrapper)
    model = GPT(GPTConfig(layers=2, hidden=16, heads=2, seq_len=8, vocab=32))
    with paratrain.Parallel(strategy, accelerator="cpu", monitor=False, **options) as par:
        par.prepare(model, torch.optim.AdamW(model.parameters()))
    assert calls == {"find_blocks": 1, "find_ties": 1}
