"""A plan as a table for people or as JSON for programs."""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from ..lr import scale_lr
from ..sizes import format_bytes
from .estimates import Estimate
from .hardware import GIB, Device, Link
from .layout import Layout
from .memory import activation_figures
from .recommend import Plan
from .timing import bubble_fraction
from .training import Training

_BREAKDOWN = (
    ("params", "parameters"),
    ("grads", "gradients"),
    ("optim", "optimizer_states"),
    ("acts", "activations"),
    ("temp", "transient"),
    ("buffers", "buffers"),
    ("overhead", "overhead"),
)


def _count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def _link(link: Link) -> str:
    return f"{link.name} {link.bandwidth_gbs:g} GB/s"


def _fits(e: Estimate) -> str:
    """yes, tight, or no with the GiB over what a rank may use."""
    if e.fits:
        return "tight" if e.tight else "yes"
    over = e.over / GIB
    return f"no +{over:.0f}" if over >= 100 else f"no +{over:.1f}"


def _flops(n: float) -> str:
    for unit, size in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:g} FLOP"


def format_plan(plan: Plan, *, breakdown: bool = False) -> str:
    """The plan as text: model, cluster, one row per strategy, the recommendation and what to change."""
    s, c, t = plan.stats, plan.cluster, plan.training
    d = c.device
    rank = "process" if d.shared_by_ranks else "GPU"
    act = activation_figures(s, t, Layout.of(name="single"))[0]
    built = ", ".join(f"{k} {format_bytes(v)}" for k, v in s.param_bytes.items())
    lines = [
        f"model     {s.name}: {_count(s.params)} parameters"
        + (f", {_count(s.moe.active)} active per token" if s.moe is not None else "")
        + f" ({built} as built); {s.source}",
        f"          largest layer {s.largest_layer[0]} ({_count(s.largest_layer[1])}), largest wrap unit "
        f"{s.largest_unit[0]} ({_count(s.largest_unit[1])}); per sample {_flops(s.flops_per_sample)} forward+backward, "
        f"{format_bytes(act)} of activations",
        *(f"warning:  {text}" for text in s.warnings),
        f"cluster   {c.world_size} x {d.name}"
        + (" process" if d.shared_by_ranks else "")
        + f" on {c.nodes} node{'s' if c.nodes > 1 else ''} ({d.memory_gib:.3g} GiB, {d.peak_tflops(t.precision):g} "
        f"TFLOP/s peak x {_efficiency(d)}); intra-node {_link(c.intra)}"
        + (f", inter-node {_link(c.inter)}" if c.nodes > 1 else ""),
        f"training  {t.precision}, {t.optimizer}{_recompute(t)}; "
        f"micro-batch {t.micro_batch} per {rank}, global batch {plan.global_batch}"
        + (f", rows packed with documents of {t.document_tokens} tokens" if t.document_tokens is not None else "")
        + (
            f", pipeline schedule {t.schedule}"
            + (f" ({t.stages_per_rank} stages per rank)" if t.stages_per_rank > 1 else "")
            if any(e.layout.pp > 1 for e in plan.estimates)
            else ""
        )
        + (
            ""
            if t.sequence_parallel or all(e.layout.tp == 1 for e in plan.estimates)
            else ", tensor parallelism without sequence parallelism"
        ),
        "",
    ]
    return "\n".join(lines + _table(plan, breakdown) + _recommended(plan))


def _table(plan: Plan, breakdown: bool) -> list[str]:
    """One row per estimate; a row that does not fit says by how many GiB (``Estimate.over``)."""
    c = plan.cluster
    rank = "process" if c.device.shared_by_ranks else "GPU"
    head = f"{'strategy':<18} {'layout':<24} {'fits':<8} {f'GiB/{rank}':>11}"
    if breakdown:
        head += "".join(f" {short:>8}" for short, _ in _BREAKDOWN) + f" {'peak':>4}"
    head += f" {'micro x n':>10} {'step ms':>9} {'samples/s':>10} {'speedup':>8} {'eff':>5}"
    with_cp = any(e.layout.cp > 1 for e in plan.estimates)
    head += f" {'cp a2a ms':>9}" if with_cp else ""
    lines = [head, "-" * len(head)]
    for e in plan.estimates:
        name = e.name + (f" (1 {rank})" if e.name == "single" and c.world_size > 1 else "")
        row = f"{name:<18} {e.layout.describe():<24} {_fits(e):<8} {e.memory.total / GIB:>11.1f}"
        if breakdown:
            row += "".join(f" {getattr(e.memory, key) / GIB:>8.2f}" for _, key in _BREAKDOWN)
            row += f" {'bwd' if e.memory.phase == 'backward' else 'opt':>4}"
        step_ms = e.time.step_s * 1e3
        row += (
            f" {f'{e.batch.micro_batch:g} x {e.batch.micro_batches}':>10} "
            f"{f'{step_ms:.1f}' if step_ms < 1e6 else f'{step_ms:.3g}':>9} "
            f"{e.samples_per_s:>10,.1f} {e.speedup:>7.2f}x {e.efficiency:>5.0%}"
        )
        if with_cp:  # context parallelism's all-to-alls per step (its degree is in the layout column)
            row += f" {f'{e.time.cp_comm_s * 1e3:.1f}' if e.layout.cp > 1 else '-':>9}"
        lines.append(row)
    return lines + [_ps_line(e) for e in plan.estimates if e.serving is not None]


def _recommended(plan: Plan) -> list[str]:
    """The recommendation and its reason (none when the layout asked for fits in no way), what to change, the LR
    and the notes."""
    ch, t = plan.choice, plan.training
    if ch is None:
        lines = ["", f"recommended: none — {plan.reason}"]
    else:
        how = f"{ch.layout.describe()}, micro-batch {ch.batch.micro_batch:g} x {ch.batch.micro_batches}"
        if ch.checkpointing and not t.checkpointing:
            how += ", activation checkpointing"
        if ch is not next(e for e in plan.estimates if e.name == ch.name):  # re-planned to fit
            how += f"; {ch.memory.total / GIB:.1f} GiB, {ch.samples_per_s:,.1f} samples/s"
        if ch.layout.pp > 1:
            bubble = bubble_fraction(ch.layout.pp, ch.batch.micro_batches, t.stages_per_rank, t.schedule)
            how += f", bubble {bubble:.0%}"
        lines = ["", f"recommended: {ch.name} ({how}) — {plan.reason}"]
    lines += [f"  - {text}" for text in plan.suggestions]
    lines.append(_lr_line(plan))
    return lines + [f"note: {text}" for text in plan.notes]


def _ps_line(e: Estimate) -> str:
    """A ``ps`` row's servers: their memory and the bytes of a step, which the busiest server's link carries."""
    sv, tr, lay = e.serving, e.serving.traffic, e.layout
    rows = ", ".join(f"{r:,.0f}" for r in tr.rows)
    touched = f" and the {rows} table rows it touches" if tr.rows else ""
    return (
        f"  ps: a worker {sv.worker.total / GIB:.2f} GiB (no table, no optimizer state), the busiest server "
        f"{sv.server.total / GIB:.2f} GiB ({_count(sv.dense_share)} dense parameters, {_count(sv.table_rows)} "
        f"table elements, their optimizer states); per step a worker sends {format_bytes(tr.worker_sent)} and "
        f"receives {format_bytes(tr.worker_received)} (dense {format_bytes(tr.dense)} each way{touched}); "
        f"the busiest server receives {format_bytes(tr.server_received)} and sends "
        f"{format_bytes(tr.server_sent)} from and to "
        f"{lay.dp} workers over {_link(sv.link)} in {lay.dp * sv.requests} requests: its link and its serving "
        f"loop are the bottleneck ({e.time.exposed_comm_s * 1e3:.3g} ms, of which {sv.requests_s * 1e3:.3g} ms "
        f"the requests' host work; its optimizer step {e.time.optimizer_s * 1e3:.3g} ms)"
    )


def _efficiency(d: Device) -> str:
    if d.activation_passes:
        return f"{d.mfu:.2g} in matmuls, elementwise work {d.activation_passes:g} passes over the activations"
    return f"MFU {d.mfu:.2g}"


def _recompute(t: Training) -> str:
    return {
        "full": ", activation checkpointing",
        "selective": ", selective recomputation (attention core)",
        "op": ", per-operation selective recomputation",
    }.get(t.recompute_mode, "")


def _lr_line(plan: Plan) -> str:
    """How to scale the user's LR, from the global batch it was tuned at; without that batch, how to ask."""
    k, t = plan.lr_factor, plan.training
    if k is None:
        return (
            f"LR: an LR tuned at another global batch than {plan.global_batch} wants scaling: --base-batch N "
            "(that batch) says how"
        )
    if k == 1:
        return f"LR: the global batch {plan.global_batch} is the one the LR was tuned at: keep it"
    if t.base_lr is None:
        rates = f"by {k:.3g} (linear rule, with warmup) or {math.sqrt(k):.3g} (sqrt rule, safer for Adam)"
    else:
        rates = (
            f"{t.base_lr:g} → {scale_lr(t.base_lr, k, 'linear'):.3g} (linear rule, with warmup) or "
            f"{scale_lr(t.base_lr, k, 'sqrt'):.3g} (sqrt rule, safer for Adam)"
        )
    return (
        f"LR: global batch {plan.global_batch} is {k:.3g}x the {t.base_batch} the LR was tuned at: scale it "
        f"{rates}; paratrain.lr.scale_lr does this"
    )


def _estimate_json(e: Estimate) -> dict[str, Any]:
    return {
        "name": e.name,
        "strategy": e.layout.name,
        "layout": e.layout.degrees(),
        "fits": e.fits,
        "tight": e.tight,
        "checkpointing": e.checkpointing,
        "micro_batch": e.batch.micro_batch,
        "micro_batches": e.batch.micro_batches,
        "memory_bytes": e.memory.as_dict(),
        "memory_peak": e.memory.phase,
        "capacity_bytes": e.capacity,
        "over_bytes": e.over,
        "time": e.time.as_dict(),
        "samples_per_s": e.samples_per_s,
        "speedup": e.speedup,
        "efficiency": e.efficiency,
        **({"ps": e.serving.as_dict()} if e.serving is not None else {}),
    }


def plan_to_json(plan: Plan) -> dict[str, Any]:
    """The plan as plain data: per strategy the per-rank memory breakdown in bytes and the step times."""
    s, c, t = plan.stats, plan.cluster, plan.training
    return {
        "model": {
            "name": s.name,
            "params": s.params,
            "param_bytes": dict(s.param_bytes),
            "source": s.source,
            "largest_layer": {"name": s.largest_layer[0], "params": s.largest_layer[1]},
            "largest_unit": {"name": s.largest_unit[0], "params": s.largest_unit[1]},
            "units": len(s.units),
            "flops_per_sample": s.flops_per_sample,
            "warnings": list(s.warnings),
            "moe": None
            if s.moe is None
            else {
                "experts": s.moe.experts,
                "top_k": s.moe.top_k,
                "layers": s.moe.layers,
                "active_params": s.moe.active,
                "expert_params": s.moe.expert_params,
            },
            "activation_bytes_per_sample": activation_figures(s, t, Layout.of(name="single"))[0],
        },
        "cluster": {
            "device": asdict(c.device),
            "ranks_per_node": c.ranks_per_node,
            "nodes": c.nodes,
            "world_size": c.world_size,
            "intra": asdict(c.intra),
            "inter": asdict(c.inter),
        },
        "training": {**asdict(t), "global_batch": plan.global_batch},
        "strategies": [_estimate_json(e) for e in plan.estimates],
        "recommendation": {
            **({"name": None} if plan.choice is None else _estimate_json(plan.choice)),
            "reason": plan.reason,
        },
        "suggestions": list(plan.suggestions),
        "notes": list(plan.notes),
        "lr_scaling": _lr_json(plan),
    }


def _lr_json(plan: Plan) -> dict[str, Any] | None:
    """The LR scaling factors from ``Training.base_batch`` (None without it), and the scaled ``base_lr``."""
    k, t = plan.lr_factor, plan.training
    if k is None:
        return None
    lr: dict[str, Any] = {"base_batch": t.base_batch, "factor": k, "linear": k, "sqrt": math.sqrt(k)}
    if t.base_lr is not None:
        lr.update(base_lr=t.base_lr, linear_lr=scale_lr(t.base_lr, k, "linear"), sqrt_lr=scale_lr(t.base_lr, k, "sqrt"))
    return lr
