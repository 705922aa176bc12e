"""A spec's ``Parallel`` keywords (``VerifySpec.options``), and which of the two runs each one reaches.

A check is only worth its verdict when both runs train the script's own math: its clipping, its seed, its precision,
its global batch. So a spec takes any keyword the script gives ``Parallel`` and verify sorts them:

* ``Parallel``'s own keywords (``clip_grad_norm``, ``seed``, ``precision``, ``model=ModelConfig(...)``,
  ``job=JobConfig(deterministic=True)``, or their former flat spellings) shape the math of any run: both runs get them.
* A global batch (``accumulate=GlobalBatch(...)``, or ``global_batch`` and ``micro_batch``) goes to the parallel run;
  the reference takes the accumulation it comes to there, as it takes ``VerifySpec.accumulate`` (one batch per
  window where it can).
* Every other keyword is an option of the strategy (``tp_plan``, ``microbatches``, ``bucket_cap_mb``): it means
  something only across ranks, so the parallel run alone gets it, merged with the command's own (``--tp``).
* The keywords verify sets itself are refused, each with where to say it instead.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..loop import GlobalBatch
from ..parallel import Parallel
from ..settings import MOVED, regroup

OWN_KEYWORDS = frozenset(
    name
    for name, p in inspect.signature(Parallel.__init__).parameters.items()
    if p.kind is inspect.Parameter.KEYWORD_ONLY
) | frozenset(MOVED)
"""``Parallel``'s own keywords, also as formerly spelled: the rest of what it takes are strategy options."""
BATCH_KEYWORDS = ("global_batch", "micro_batch")
SET_BY_VERIFY = {
    "strategy": "pass the strategies to verify (--strategy)",
    "accumulate": "use VerifySpec.accumulate",
    "accelerator": "pass --accelerator (accelerator= from Python)",
    "env": "verify places both runs itself",
    "monitor": "verify turns the monitor off: it compares the arithmetic",
    **dict.fromkeys(
        ("checkpoint", "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume"),
        "verify trains a few steps from the factory's weights; leave checkpoints to the script",
    ),
    "init_fn": "verify starts both runs from the weights the factory built; build the model off the meta device",
}
"""Keywords verify decides, and where the user says them instead."""


@dataclass(frozen=True, kw_only=True)
class RunOptions:
    """``VerifySpec.options`` sorted by the run they reach (see the module docstring)."""

    shared: Mapping[str, Any]
    """``Parallel``'s own keywords: both runs."""
    batch: Mapping[str, Any]
    """``global_batch``/``micro_batch``: the parallel run; the reference takes the accumulation they give."""
    strategy: Mapping[str, Any]
    """Strategy options: the parallel run alone."""

    @classmethod
    def of(cls, options: Mapping[str, Any], *, accumulate: int, micro_batch: int | None) -> RunOptions:
        """Sort ``options``; one line for a keyword verify sets itself or a batch that contradicts the spec's."""
        if not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options):
            raise ConfigError(
                "VerifySpec.options must be a dict of Parallel keywords, e.g. {'clip_grad_norm': 1.0, 'seed': 1337}"
            )
        options = dict(options)
        if isinstance(options.get("accumulate"), GlobalBatch):  # the global batch, not an accumulation count
            given = options.pop("accumulate")
            options.update({"global_batch": given.size, **({"micro_batch": given.micro} if given.micro else {})})
        grouped = regroup({k: v for k, v in options.items() if k not in BATCH_KEYWORDS})
        job, model = grouped["job"], grouped["model"]
        for key in [
            *options,
            *(["env"] if job is not None and job.env is not None else []),
            *(["init_fn"] if model is not None and model.init_fn is not None else []),
        ]:
            if key in SET_BY_VERIFY:
                raise ConfigError(f"VerifySpec.options cannot set {key!r}: {SET_BY_VERIFY[key]}")
        batch = {k: options[k] for k in BATCH_KEYWORDS if k in options}
        _check_batch(batch, accumulate, micro_batch)
        return cls(
            shared={k: v for k, v in grouped.items() if k in OWN_KEYWORDS and k != "accumulate" and v is not None},
            batch=batch,
            strategy={k: v for k, v in grouped.items() if k not in OWN_KEYWORDS},
        )

    def parallel(self, accumulate: int, micro_batch: int | None) -> dict[str, Any]:
        """``Parallel``'s keywords in the parallel run, strategy options aside: the global batch, when given, with
        the loader's batch as its micro-batch (what ``prepare_loader`` would read), else ``accumulate``."""
        if "global_batch" in self.batch:
            micro = self.batch.get("micro_batch", micro_batch)  # without a loader: the options' micro_batch
            return {**self.shared, "accumulate": GlobalBatch(self.batch["global_batch"], micro)}
        return {**self.shared, "accumulate": accumulate}

    def described(self, strategy_options: Mapping[str, Any]) -> dict[str, str]:
        """Every option the parallel run got (with ``strategy_options``, the merged ones), for the report."""
        return {k: repr(v) for k, v in {**self.shared, **self.batch, **strategy_options}.items()}


def _check_batch(batch: Mapping[str, Any], accumulate: int, micro_batch: int | None) -> None:
    if "micro_batch" in batch and "global_batch" not in batch:
        raise ConfigError("VerifySpec.options has micro_batch without global_batch; give both, or neither")
    if "global_batch" in batch and accumulate != 1:
        raise ConfigError(
            f"VerifySpec.accumulate={accumulate} given with options global_batch="
            f"{batch['global_batch']}; give one of them (with global_batch, accumulate follows from "
            "the layout)"
        )
    if micro_batch is None and "global_batch" in batch and "micro_batch" not in batch:
        raise ConfigError(
            f"VerifySpec.options global_batch={batch['global_batch']} without a loader needs micro_batch: the "
            "per-rank batch your loop draws"
        )
    if micro_batch is not None and batch.get("micro_batch", micro_batch) != micro_batch:
        raise ConfigError(
            f"VerifySpec.options micro_batch={batch['micro_batch']} but the loader's batch size is "
            f"{micro_batch}: the loader is built at the per-rank micro-batch; make them equal"
        )


def merged_strategy_options(spec: Mapping[str, Any], command: Mapping[str, Any]) -> dict[str, Any]:
    """The spec's strategy options with the command's (``--tp``); one line when both set a key to other values."""
    for key in spec.keys() & command.keys():
        if spec[key] != command[key]:
            flag = f"--tp {command[key]}" if key == "tp" else f"the command's {key}={command[key]!r}"
            raise ConfigError(f"{flag} and VerifySpec.options {key}={spec[key]!r} disagree; give it once")
    return {**spec, **command}
