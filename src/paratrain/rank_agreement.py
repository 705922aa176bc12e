"""Every rank of a job must be configured alike; check it once, when ``Parallel()`` starts.

Ranks built with different options (rank 0 on ``ddp``, rank 1 on ``zero3``; different ``accumulate`` or
precision) otherwise call different collectives: a gloo rank aborts with SIGABRT, an NCCL job hangs until its
timeout, or worse, the collectives happen to match and the ranks train different things. One small
``all_gather_object`` of a few strings at construction (a few milliseconds on two CPU ranks, see
benchmarks/RESULTS.md) turns that into one line naming the ranks and their values.
"""

from __future__ import annotations

from collections.abc import Mapping

from .errors import ConfigError


def check_ranks_agree(values: Mapping[str, str], rank: int, world_size: int) -> None:
    """Raise ``ConfigError`` on every rank when any rank's ``values`` differ from the others' (collective)."""
    if world_size < 2:
        return
    import torch.distributed as dist

    gathered: list[dict[str, str] | None] = [None] * world_size
    dist.all_gather_object(gathered, dict(values))
    problems = disagreements(gathered)  # type: ignore[arg-type]
    if problems:
        raise ConfigError(
            f"the ranks of this job disagree: {'; '.join(problems)}; give every rank the same "
            "Parallel(...) options (and launch them with the same flags)"
        )


def disagreements(per_rank: list[Mapping[str, str]]) -> list[str]:
    """``"strategy: 'ddp' on rank 0, 'zero3' on rank 1"`` for every key whose value differs across ranks."""
    problems = []
    for key in per_rank[0]:
        by_value: dict[str, list[int]] = {}
        for r, values in enumerate(per_rank):
            by_value.setdefault(str(values.get(key)), []).append(r)
        if len(by_value) > 1:
            parts = [f"{value!r} on {_ranks(ranks)}" for value, ranks in by_value.items()]
            problems.append(f"{key}: {', '.join(parts)}")
    return problems


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:6])) + (f" … ({len(ranks)} ranks)" if len(ranks) > 6 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
