"""Where the parallel run left the single-process one, and why: each cause is named from evidence gathered in
the run (which samples each rank read, the gradient scale, BatchNorm statistics, initial-weight digests),
not guessed from the symptom."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from ..data import ShardSampler
from .distributed import DataSetup, RankEvidence
from .floor import Judge
from .record import Record, feed_digest


@dataclass(frozen=True, kw_only=True)
class Finding:
    """A cause, the evidence for it, and the fix."""

    cause: str
    evidence: str
    hint: str


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """The first place the parallel run differs from the reference by more than is allowed."""

    step: int
    """Optimizer step, from 0."""
    what: str
    """``loss`` (before the step), ``gradient norm`` (before the step) or ``parameters`` (after it)."""
    parallel: float
    reference: float
    parameter: str | None = None
    """For ``parameters``: the entry of the state dict furthest beyond what is allowed."""
    max_diff: float = 0.0
    allowed: float = 0.0
    """The largest difference counted as equal there (the tolerance, or the margin times the noise floor)."""
    floor: float | None = None
    """The measured noise floor there; None under a fixed tolerance."""


def parallel_losses(ranks: list[RankEvidence], steps: int) -> list[float | None]:
    """Per step: the mean loss over the ranks that computed one (a pipeline's last stages)."""
    out: list[float | None] = []
    for s in range(steps):
        means = [statistics.fmean(r.record.losses[s]) for r in ranks if s < len(r.record.losses) and r.record.losses[s]]
        out.append(statistics.fmean(means) if means else None)
    return out


def _entries_apart(
    mine: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], step: int, judge: Judge
) -> tuple[Divergence | None, float]:
    """(the entry furthest beyond what ``judge`` allows, if any; the largest |difference| of any entry)."""
    worst: tuple[float, Divergence] | None = None
    largest = 0.0
    for key in sorted(mine.keys() & ref.keys()):
        theirs = ref[key].double()
        if not theirs.numel():
            continue
        diff = float((mine[key].double() - theirs).abs().max())
        largest = max(largest, diff)
        bound = judge.entry(step, key, float(theirs.abs().max()))
        if diff > bound.allowed and (worst is None or diff / bound.allowed > worst[0]):
            worst = (
                diff / bound.allowed,
                Divergence(
                    step=step,
                    what="parameters",
                    parallel=diff,
                    reference=0.0,
                    parameter=key,
                    max_diff=diff,
                    allowed=bound.allowed,
                    floor=bound.floor,
                ),
            )
    return (worst[1] if worst else None), largest


def _scalar_apart(what: str, step: int, mine: float, theirs: float, judge: Judge) -> Divergence | None:
    bound = judge.scalar(what, step, theirs)
    if abs(mine - theirs) <= bound.allowed:
        return None
    return Divergence(
        step=step,
        what=what,
        parallel=mine,
        reference=theirs,
        max_diff=abs(mine - theirs),
        allowed=bound.allowed,
        floor=bound.floor,
    )


def first_divergence(
    ranks: list[RankEvidence], ref: Record, judge: Judge
) -> tuple[Divergence | None, Divergence | None, float]:
    """(the first step where loss, gradient norm or parameters differ by more than ``judge`` allows; the first
    step where parameters do; the largest parameter difference seen)."""
    main = ranks[0].record
    steps = min(main.steps, ref.steps)
    losses = parallel_losses(ranks, steps)
    largest = 0.0
    found: Divergence | None = None
    apart: Divergence | None = None
    for s in range(steps):
        mine = losses[s]
        theirs = statistics.fmean(ref.losses[s]) if ref.losses[s] else None
        entry, diff = _entries_apart(main.states[s], ref.states[s], s, judge)
        largest = max(largest, diff)
        apart = apart or entry
        if found is not None:
            continue
        if mine is not None and theirs is not None:
            found = _scalar_apart("loss", s, mine, theirs, judge)
        found = found or _scalar_apart("gradient norm", s, main.grad_norms[s], ref.grad_norms[s], judge) or apart
    return found, apart, largest


# ----------------------------------------------------------------------------------------------- evidence
def expected_order(data: DataSetup, replica: int, length: int, *, reshuffle: bool = True) -> list[int]:
    """The first ``length`` indices a distributed sampler hands ``replica``, epoch after epoch."""
    sampler = ShardSampler(
        range(data.size),
        num_replicas=data.replicas,
        rank=replica,
        shuffle=data.shuffle,
        seed=data.seed,
        drop_last=data.drop_last,
    )
    usable = sampler.num_samples - (sampler.num_samples % data.micro_batch if data.drop_last else 0)
    out: list[int] = []
    epoch = 0
    while len(out) < length and usable > 0:
        sampler.set_epoch(epoch if reshuffle else 0)
        out += list(sampler)[:usable]
        epoch += 1
    return out[:length]


def data_findings(ranks: list[RankEvidence], data: DataSetup) -> tuple[list[Finding], list[str]]:
    """Causes in the samples each replica read, and notes on what could not be checked."""
    fetched: dict[int, list[int]] = {}
    for r in ranks:
        fetched.setdefault(r.replica, r.fetched)
    notes = []
    per_epoch = data.per_replica
    longest = max(len(f) for f in fetched.values())
    if data.shuffle and longest <= per_epoch:
        notes.append(
            "the per-epoch reshuffle was not checked: the steps compared stay inside the first epoch "
            "(pass more --steps or use a smaller dataset)"
        )
    expected = {rep: expected_order(data, rep, len(f)) for rep, f in fetched.items()}
    if all(f == expected[rep] for rep, f in fetched.items()):
        return [], notes
    stale = {rep: expected_order(data, rep, len(f), reshuffle=False) for rep, f in fetched.items()}
    if data.shuffle and all(f == stale[rep] for rep, f in fetched.items()):
        rep = next(iter(fetched))
        first = next(i for i, (a, b) in enumerate(zip(fetched[rep], expected[rep])) if a != b)
        return [
            Finding(
                cause="missing per-epoch reshuffle",
                evidence=f"epoch 1 repeated epoch 0's sample order on every rank (replica {rep}, sample {first}: index "
                f"{fetched[rep][first]}, a reshuffled epoch gives {expected[rep][first]})",
                hint="loop over epochs with `for epoch in par.epochs(n)`, which sets the epoch of every prepared "
                "loader's sampler, or call loader.sampler.set_epoch(epoch) at the start of each epoch",
            )
        ], notes
    if len(fetched) > 1:
        window = {rep: set(f[:per_epoch]) for rep, f in fetched.items()}
        reps = sorted(window)
        if all(fetched[rep][:per_epoch] == fetched[reps[0]][:per_epoch] for rep in reps):
            evidence = f"every rank read the same samples in the same order (first: {fetched[reps[0]][:4]})"
        else:
            shared = len(window[reps[0]] & window[reps[1]])
            evidence = (
                f"ranks of replicas {reps[0]} and {reps[1]} read {shared} of the same samples within one "
                f"epoch's share ({per_epoch} samples each); a distributed sampler gives each a disjoint shard"
            )
        if len(set().union(*window.values())) < sum(len(w) for w in window.values()):
            return [
                Finding(
                    cause="data loader without distributed sampling",
                    evidence=evidence,
                    hint="shard the loader: par.prepare(model, optimizer, loader) or par.prepare_loader(loader) (not "
                    "shard=False), or give it a DistributedSampler(dataset) yourself",
                )
            ], notes
    rep = next(rep for rep, f in fetched.items() if f != expected[rep])
    first = next((i for i, (a, b) in enumerate(zip(fetched[rep], expected[rep])) if a != b), len(expected[rep]))
    return [
        Finding(
            cause="data order",
            evidence=f"replica {rep} read other samples than a distributed sampler (seed {data.seed}) gives it, from "
            f"sample {first} on",
            hint="let paratrain shard the loader (par.prepare_loader), or use a DistributedSampler with the same "
            "seed on every rank, and call set_epoch each epoch",
        )
    ], notes


def fed_findings(ranks: list[RankEvidence]) -> tuple[list[Finding], list[str]]:
    """Causes in what each replica fed its model (the loop read from something other than the spec's loader):
    every replica feeding the same batch in a micro-step, compared by digest."""
    first: dict[int, list[list[str]]] = {}
    for r in ranks:
        if r.replica not in first:
            first[r.replica] = [[feed_digest(call) for call in step] for step in r.record.inputs]
    if len(first) < 2:
        return [], []
    fed = list(first.values())
    for step in range(min(len(f) for f in fed)):
        for call in range(min(len(f[step]) for f in fed)):
            if len({f[step][call] for f in fed}) == 1:
                return [
                    Finding(
                        cause="every rank reads the same data",
                        evidence=f"all {len(fed)} replicas fed the model the same batch in step {step}, "
                        f"micro-step {call} (compared by digest)",
                        hint="give each replica its own data: offset the reads by par.data_parallel_rank (of "
                        "par.data_parallel_size), or seed the draws per replica (seed + par.data_parallel_rank), or "
                        "read through a loader prepared with par.prepare_loader",
                    )
                ], []
    return [], []


def _apart_from_rank0(digests: list[str]) -> str | None:
    """'rank 1' / 'ranks 1, 3': the ranks whose digest differs from rank 0's, or None when all agree."""
    others = [str(i) for i, d in enumerate(digests) if d != digests[0]]
    return None if not others else f"rank{'s' if len(others) > 1 else ''} {', '.join(others)}"


def ranks_apart(ranks: list[RankEvidence]) -> str | None:
    """The ranks whose model differed from rank 0's before ``prepare`` (state digests compared), or None."""
    return _apart_from_rank0([r.init_digest for r in ranks])


def gradient_scale_finding(ranks: list[RankEvidence], ref: Record, accumulate: int, replicas: int) -> Finding | None:
    """The first step's gradient norm (before clipping) against one process's on the global batch: ``accumulate``
    times it (the loss not divided by the accumulation count), 1/``accumulate`` with the same loss (divided twice:
    the loop's own division and ``par.backward``'s), or 1 over the micro-batches that make the global batch, the loss
    too (a loss summed over the batch: each piece's sum is averaged). One process's numbers: one backward outside
    the loop on the first global batch when the reference replayed (whatever the loop divides by); else the
    reference's first step, which takes ``ref.window`` micro-batches of every replica as one batch."""
    if not ranks[0].record.steps or not ref.steps:
        return None
    loss, norm = ref.global_first or (statistics.fmean(ref.losses[0]) if ref.losses[0] else None, ref.grad_norms[0])
    if not norm:
        return None
    ratio = ranks[0].record.grad_norms[0] / norm
    mine = parallel_losses(ranks, 1)[0]
    loss_ratio = mine / loss if mine is not None and loss else None
    window = accumulate if ref.global_first else ref.window
    parts = replicas * window
    if accumulate > 1 and _near(ratio, accumulate):
        return Finding(
            cause="accumulation without loss division",
            evidence=f"the first step's gradient norm is {ratio:.3f}x the single-process one: the "
            f"accumulation count is {accumulate}",
            hint="divide each micro-batch's loss by the accumulation count: par.backward(loss) and "
            "par.forward_backward(...) do; loss.backward() inside par.step does not",
        )
    if accumulate > 1 and window == accumulate and _near(ratio, 1 / accumulate) and _near(loss_ratio or 1, 1):
        return Finding(
            cause="loss divided twice",
            evidence=f"the first step's gradient norm is 1/{accumulate} of the single-process one, its loss the "
            f"same: the accumulation count is {accumulate}",
            hint="drop the loop's own division of the loss by the accumulation count (loss / grad_accum_steps): "
            "par.backward(loss) and par.forward_backward(...) divide it already",
        )
    if parts > 1 and _near(ratio, 1 / parts) and _near(loss_ratio or 1 / parts, 1 / parts):
        counted = f"{replicas} replicas x {window} micro-batches" if window > 1 else f"{replicas} replicas"
        return Finding(
            cause="summed loss",
            evidence=f"the first step's loss and gradient norm are 1/{parts} of the single-process ones ({counted} "
            "make one step's batch): each piece's sum is averaged where one process sums the whole batch",
            hint="use a loss that averages over the batch (reduction='mean'): paratrain averages gradients over the "
            "replicas and the micro-steps, as one process averages over the global batch",
        )
    return None


def _near(ratio: float, expected: float) -> bool:
    return abs(ratio / expected - 1) < 0.02


def batchnorm_finding(ranks: list[RankEvidence], ref: Record, tolerance: float, window: int = 1) -> Finding | None:
    """A BatchNorm whose input statistics on a rank differ from the global batch's. ``window``: micro-batches per
    reference batch (the reference takes a whole accumulation window at once, see verify/reference.py)."""
    worst: tuple[float, str] | None = None
    for name, theirs in ref.batchnorm_means.items():
        for r in ranks:
            mine = r.record.batchnorm_means.get(name)
            if mine is not None and mine.shape == theirs.shape:
                diff = float((mine - theirs).abs().max())
                if diff > tolerance * max(1.0, float(theirs.abs().max())) and (worst is None or diff > worst[0]):
                    worst = (diff, name)
    if worst is None:
        return None
    if window > 1:
        return Finding(
            cause="BatchNorm under gradient accumulation",
            evidence=f"BatchNorm '{worst[1]}' normalised each micro-batch with its own statistics, one "
            f"process normalises the global batch of {window} micro-batches at once (channel "
            f"means apart by up to {worst[0]:.3g}): accumulation is not the global batch's math",
            hint="verify with accumulate=1, or use GroupNorm or LayerNorm, which do not mix samples",
        )
    return Finding(
        cause="BatchNorm without synchronisation",
        evidence=f"BatchNorm '{worst[1]}' normalised each rank's micro-batch with that rank's own "
        f"statistics: its input's channel means differ from the global batch's by up to "
        f"{worst[0]:.3g}",
        hint="convert it before prepare: model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model) "
        "(torch's SyncBatchNorm runs on GPUs only; on a CPU use GroupNorm or LayerNorm, or accept "
        "per-rank statistics)",
    )


def router_loss_finding(ranks: list[RankEvidence], replicas: int) -> Finding | None:
    """A mixture of experts' router load-balancing loss that each replica computed on its own slice."""
    local = ranks[0].router_loss
    if local is None or replicas < 2:
        return None
    return Finding(
        cause="router load-balancing loss per rank",
        evidence=f"the model adds its router's load-balancing loss ({local}) computed on each rank's slice: "
        "its expert shares are that slice's, where one process takes the global batch's",
        hint="Parallel(..., moe_aux_loss='global') (in a VerifySpec: options={'moe_aux_loss': 'global'}) "
        "sums the expert counts over the data-parallel ranks, as one process computes the loss",
    )


def replicas_finding(ranks: list[RankEvidence]) -> Finding | None:
    apart = _apart_from_rank0([r.final_digest for r in ranks])
    if apart is None:
        return None
    return Finding(
        cause="replicas drifted apart",
        evidence=f"at the end, {apart} hold other parameters than rank 0",
        hint="gradients or parameters changed on one rank outside paratrain's step (a second optimizer over "
        "the unwrapped model, a no_sync block left open, rank-dependent code)",
    )


def _changed(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape != b.shape or not torch.equal(a, b)


def untrained_finding(ranks: list[RankEvidence], ref: Record) -> Finding | None:
    """Parameters the reference moved that the parallel run never moved: the optimizer lost them (a parameter
    left out of a rebuilt optimizer, the second name of a tie that was split into two tensors)."""
    mine = ranks[0].record.states
    if len(mine) < 2 or len(ref.states) < 2:
        return None
    stuck = [
        k
        for k in ref.states[0].keys() & mine[0].keys()
        if ref.states[0][k].is_floating_point()
        and _changed(ref.states[0][k], ref.states[-1][k])
        and not _changed(mine[0][k], mine[-1][k])
    ]
    if not stuck:
        return None
    return Finding(
        cause="parameters never trained",
        evidence=f"{len(stuck)} parameter(s) changed in the single-process run but not in the parallel one "
        f"({', '.join(sorted(stuck)[:3])}{', …' if len(stuck) > 3 else ''})",
        hint="every trainable parameter must be in the prepared optimizer: build the optimizer from the "
        "model passed to prepare() and pass both to prepare(); do not re-tie or replace parameters "
        "after prepare()",
    )


def tie_finding(ranks: list[RankEvidence], ref: Record) -> Finding | None:
    """Entries that are one tensor in the reference (equal at every step though training moved them) but that
    the parallel run ended with different values: a tied embedding and head split into two tensors."""
    mine, theirs = ranks[0].record.states, ref.states
    if not mine or len(theirs) < 2:
        return None
    first, last = theirs[0], theirs[-1]
    keys = sorted(k for k in first.keys() & mine[-1].keys() if first[k].is_floating_point())
    for i, a in enumerate(keys):
        for b in keys[i + 1 :]:
            tied = not _changed(first[a], first[b]) and not _changed(last[a], last[b]) and _changed(first[a], last[a])
            if tied and _changed(mine[-1][a], mine[-1][b]):
                return Finding(
                    cause="tied parameters split",
                    evidence=f"'{a}' and '{b}' are one tensor in the single-process run but ended with "
                    "different values in the parallel one",
                    hint="keep ties through prepare(): tie the weights before prepare() and never re-tie or "
                    "resize embeddings after it; report it if prepare() itself split them",
                )
    return None
