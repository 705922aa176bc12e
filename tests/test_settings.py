"""``Parallel``'s keywords: the common case flat, the rest in ``ModelConfig``, ``JobConfig`` and ``GlobalBatch``;
the former flat spellings still work, with one warning naming what to write instead (:mod:`paratrain.settings`)."""

from __future__ import annotations

import inspect
import warnings

import pytest

import paratrain
from paratrain import GlobalBatch, JobConfig, ModelConfig, Parallel
from paratrain.errors import ConfigError
from paratrain.settings import MOVED, Settings, regroup


def test_the_constructor_takes_the_common_case_flat_and_the_rest_grouped():
    keywords = [
        n
        for n, p in inspect.signature(Parallel.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert keywords == [
        "accelerator",
        "precision",
        "accumulate",
        "clip_grad_norm",
        "seed",
        "checkpoint",
        "log_with",
        "monitor",
        "guard",
        "model",
        "job",
    ]
    assert not set(MOVED) & set(keywords)


def test_the_former_spellings_work_with_one_warning_naming_the_new_one():
    with pytest.warns(FutureWarning) as said:
        par = Parallel(
            "single",
            accelerator="cpu",
            monitor=False,
            timeout_s=30.0,
            deterministic=False,
            loss_chunk=64,
            global_batch=8,
            micro_batch=2,
        )
    assert len(said) == 1
    line = str(said[0].message)
    assert "\n" not in line and said[0].filename == __file__  # the user's line, not ours
    for spelled in (
        "job=paratrain.JobConfig(timeout_s=30.0, deterministic=False)",
        "model=paratrain.ModelConfig(loss_chunk=64)",
        "accumulate=paratrain.GlobalBatch(8, micro=2)",
    ):
        assert spelled in line
    assert (par.accumulate, par._loss.chunk) == (4, 64)
    par.close()


def test_the_new_spelling_is_quiet_and_means_the_same():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        par = Parallel(
            "single",
            accelerator="cpu",
            monitor=False,
            accumulate=GlobalBatch(8, micro=2),
            job=JobConfig(timeout_s=30.0),
            model=ModelConfig(loss_chunk=64, activation_checkpointing=2),
        )
    assert (par.accumulate, par._loss.chunk, par.transforms.checkpoint_every) == (4, 64, 2)
    par.close()


@pytest.mark.parametrize(
    "keywords, said",
    [
        ({"timeout_s": 3, "job": JobConfig()}, "Parallel got job= and the former timeout_s=; give them all in job="),
        (
            {"compile": True, "model": ModelConfig()},
            "Parallel got model= and the former compile=; give them all in model=",
        ),
        ({"global_batch": 8, "accumulate": 2}, "accumulate=2 given with global_batch=8; give one of them"),
    ],
)
def test_a_setting_given_both_ways_is_one_line(keywords, said):
    with pytest.raises(ConfigError) as err, pytest.warns(FutureWarning):
        Parallel("single", **keywords)
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "build, said",
    [
        (lambda: ModelConfig(activation_checkpointing=0.5), "activation_checkpointing must be True, False or k >= 1"),
        (lambda: ModelConfig(loss_chunk=0), "loss_chunk must be a whole number of tokens >= 1"),
        (lambda: JobConfig(timeout_s=0), "JobConfig.timeout_s must be a number of seconds > 0"),
        (lambda: GlobalBatch(0), "GlobalBatch's size must be an integer >= 1"),
    ],
)
def test_a_bad_config_is_refused_where_it_is_built(build, said):
    with pytest.raises(ConfigError, match=said):
        build()


def test_the_strategy_options_are_what_is_left_once():
    with pytest.warns(FutureWarning, match="checkpoint keywords are deprecated"):
        settings = Settings.parse(
            accumulate=1,
            model=None,
            job=None,
            checkpoint=None,
            options={"bucket_cap_mb": 5.0, "moe_aux_loss": "global", "checkpoint_dir": "ckpt", "checkpoint_every": 3},
        )
    assert settings.strategy_options == {"bucket_cap_mb": 5.0}
    assert (settings.moe_aux_loss, settings.checkpoint.every) == ("global", 3)


def test_regroup_moves_the_former_keywords_without_warning():
    grouped = regroup({"seed": 1, "init_fn": "empty", "env": None, "global_batch": 16})
    assert grouped == {
        "seed": 1,
        "model": ModelConfig(init_fn="empty"),
        "job": JobConfig(env=None),
        "accumulate": GlobalBatch(16),
    }


def test_the_configs_are_exported():
    assert {"ModelConfig", "JobConfig", "GlobalBatch"} <= set(paratrain.__all__)


@pytest.mark.parametrize(
    "keywords, said",
    [
        ({"model": {"compile": True}}, "model= takes a paratrain.ModelConfig(...)"),
        ({"job": 60}, "job= takes a paratrain.JobConfig(...), got int"),
    ],
)
def test_a_group_that_is_not_its_config_is_one_line(keywords, said):
    with pytest.raises(ConfigError, match=said.replace("(", r"\(").replace(")", r"\)")):
        Parallel("single", **keywords)
