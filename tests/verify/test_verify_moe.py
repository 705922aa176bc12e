"""``paratrain verify`` on a mixture of experts whose loss includes its router's load-balancing loss: it passes with
``moe_aux_loss="global"``, and without it fails naming the per-rank router loss and the option."""

from __future__ import annotations

import pytest

from paratrain.verify import Case, verify_cases


@pytest.fixture(scope="module")
def reports():
    cases = [
        Case(factory=f"helpers.verify_cases:{name}", strategy=s, steps=3)
        for name in ("mixtral_aux", "mixtral_aux_global")
        for s in ("ddp", "zero3")
    ]
    found = verify_cases(cases, 2, timeout_s=150, accelerator="cpu")
    return {(r.factory.split(":")[1], r.strategy): r for r in found}


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_the_global_router_loss_passes(reports, strategy):
    report = reports[("mixtral_aux_global", strategy)]
    assert report.passed, (report.divergence, report.findings, report.error)


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_a_per_rank_router_loss_fails_naming_the_option(reports, strategy):
    report = reports[("mixtral_aux", strategy)]
    assert not report.passed and report.divergence is not None
    assert [f.cause for f in report.findings] == ["router load-balancing loss per rank"]
    assert "moe_aux_loss='global'" in report.findings[0].hint
