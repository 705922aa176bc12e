"""The doctor's report on one screen (a check/status/evidence/fix table, then the bandwidth table) or as JSON."""

from __future__ import annotations

import json
import textwrap

from ..sizes import format_bytes
from . import DoctorReport
from .bandwidth import BandwidthResult
from .checks import Status

MIN_WIDTH = 80
MAX_WIDTH = 160


def render_json(report: DoctorReport) -> str:
    return json.dumps(report.to_dict(), indent=2, ensure_ascii=False)


def render_text(report: DoctorReport, width: int = 100) -> str:
    """A compact table wrapped to ``width`` columns; the fix column is filled for warn and fail only."""
    width = max(MIN_WIDTH, min(width, MAX_WIDTH))
    name_w = max(len("check"), *(len(c.name) for c in report.checks))
    status_w = len("STATUS")
    text_w = width - name_w - status_w - 6
    any_fix = any(c.status is not Status.OK for c in report.checks)
    evidence_w = text_w * 11 // 20 if any_fix else text_w
    fix_w = text_w - evidence_w - 2
    lines = [f"paratrain doctor — {report.title}", ""]
    lines.append(
        f"{'CHECK':<{name_w}}  {'STATUS':<{status_w}}  {'EVIDENCE':<{evidence_w}}  {'FIX' if any_fix else ''}".rstrip()
    )
    for check in report.checks:
        evidence = textwrap.wrap(check.evidence, evidence_w, break_long_words=False) or [""]
        fix = textwrap.wrap(check.fix, fix_w, break_long_words=False) if check.status is not Status.OK else []
        for i in range(max(len(evidence), len(fix))):
            name, status = (check.name, check.status.value) if i == 0 else ("", "")
            cell = evidence[i] if i < len(evidence) else ""
            lines.append(
                f"{name:<{name_w}}  {status:<{status_w}}  {cell:<{evidence_w}}  "
                f"{fix[i] if i < len(fix) else ''}".rstrip()
            )
    if report.bandwidth is not None:
        lines += ["", *_bandwidth_table(report.bandwidth)]
    counts = report.counts()
    lines += [
        "",
        f"{len(report.checks)} checks: {counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail "
        f"→ exit {report.exit_code}",
    ]
    return "\n".join(lines)


def _bandwidth_table(b: BandwidthResult) -> list[str]:
    where = f"{b.world_size} GPUs" if b.device == "cuda" else f"{b.world_size} CPU processes"
    lines = [
        f"all-reduce over {b.backend}, {where} (algbw = bytes/time; busbw = algbw × 2(n-1)/n)",
        f"{'size':>9}  {'time':>10}  {'algbw GB/s':>10}  {'busbw GB/s':>10}",
    ]
    for row in b.rows:
        lines.append(
            f"{format_bytes(row.size_bytes, digits=6):>9}  {_duration(row.seconds):>10}  "
            f"{row.algbw_gbps:>10.3f}  {row.busbw_gbps:>10.3f}"
        )
    return lines


def _duration(seconds: float) -> str:
    return f"{seconds * 1e6:.0f} us" if seconds < 1e-3 else f"{seconds * 1e3:.2f} ms"
