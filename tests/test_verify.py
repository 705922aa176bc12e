"""``paratrain verify``: a correct setup passes under every strategy that runs at world 2 on a CPU, and each
planted bug fails with its own cause named. One job of 2 processes runs every world-2 case."""
from __future__ import annotations

import json

import pytest

from paratrain.cli.main import main
from paratrain.verify import Case, format_report, verify_cases

WORLD2_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "pipeline", "model_parallel")
BUGS = {  # factory -> (strategy, the cause verify must name, words of its fix)
    "unsharded": ("ddp", "data loader without distributed sampling", "prepare_loader"),
    "no_reshuffle": ("ddp", "missing per-epoch reshuffle", "par.epochs"),
    "undivided": ("ddp", "accumulation without loss division", "par.backward"),
    "batchnorm": ("ddp", "BatchNorm without synchronisation", "convert_sync_batchnorm"),
    "rank_seeded": ("zero3", "different initial weights across ranks", "seed identically"),
}


@pytest.fixture(scope="module")
def world2_reports() -> dict[tuple[str, str], object]:
    cases = [Case(factory="verify_cases:good", strategy=s) for s in WORLD2_STRATEGIES]
    cases += [Case(factory="verify_cases:good_accumulating", strategy="zero2"),
              Case(factory="verify_cases:rank_seeded", strategy="ddp")]
    cases += [Case(factory=f"verify_cases:{name}", strategy=strategy) for name, (strategy, _, _) in BUGS.items()]
    cases += [Case(factory="verify_cases:gpt2", strategy=s, steps=4) for s in ("ddp", "zero3", "tp")]
    cases += [Case(factory="verify_cases:split_tie", strategy="ddp", steps=4)]
    reports = verify_cases(cases, 2, timeout_s=150, accelerator="cpu")
    return {(c.factory.split(":")[1], c.strategy): r for c, r in zip(cases, reports)}


@pytest.mark.parametrize("strategy", WORLD2_STRATEGIES)
def test_a_correct_setup_passes_under_every_strategy(world2_reports, strategy):
    report = world2_reports[("good", strategy)]
    assert report.passed, format_report(report)
    assert report.findings == [] and report.warnings == []
    assert report.steps >= 8 and report.epochs == pytest.approx(2.0)  # two epochs: the reshuffle was checked
    assert report.max_param_diff < 1e-6
    assert format_report(report).splitlines()[1].startswith("PASS")


def test_accumulation_done_right_passes(world2_reports):
    report = world2_reports[("good_accumulating", "zero2")]
    assert report.passed and report.accumulate == 2, format_report(report)


@pytest.mark.parametrize("factory", BUGS)
def test_each_planted_bug_fails_with_its_cause(world2_reports, factory):
    strategy, cause, fix = BUGS[factory]
    report = world2_reports[(factory, strategy)]
    text = format_report(report)
    assert not report.passed and report.verdict == "FAIL", text
    assert [f.cause for f in report.findings] == [cause], text
    assert fix in report.findings[0].hint
    assert report.divergence is not None and report.parameters_apart is not None, text
    assert f"diverges at step {report.divergence.step}" in text and report.parameters_apart.parameter in text


@pytest.mark.parametrize("strategy", ["ddp", "zero3", "tp"])
def test_a_transformers_model_with_a_tied_head_passes(world2_reports, strategy):
    report = world2_reports[("gpt2", strategy)]
    assert report.passed, format_report(report)


def test_a_split_tie_is_named_with_the_parameter_it_left_untrained(world2_reports):
    report = world2_reports[("split_tie", "ddp")]
    text = format_report(report)
    assert not report.passed, text
    assert [f.cause for f in report.findings] == ["tied parameters split", "parameters never trained"], text
    assert "'lm_head.weight' and 'transformer.wte.weight'" in report.findings[0].evidence
    assert "lm_head.weight" in report.findings[1].evidence


def test_where_each_bug_first_shows(world2_reports):
    # every rank reads the same batch, so the very first loss is another batch's
    assert world2_reports[("unsharded", "ddp")].divergence.what == "loss"
    # epoch 0 is right; the first step of epoch 1 (4 steps of 2 x 8 samples into 64) re-reads epoch 0's order
    assert world2_reports[("no_reshuffle", "ddp")].divergence.step == 4
    # the gradients are twice the reference's from the first step on, the loss is not affected
    undivided = world2_reports[("undivided", "ddp")].divergence
    assert (undivided.step, undivided.what) == (0, "gradient norm")
    assert undivided.parallel == pytest.approx(2 * undivided.reference, rel=1e-4)


def test_different_initial_weights_are_a_warning_where_ddp_broadcasts_them(world2_reports):
    report = world2_reports[("rank_seeded", "ddp")]
    assert report.passed, format_report(report)
    assert [w.cause for w in report.warnings] == ["different initial weights across ranks"]
    assert "zero3" in report.warnings[0].evidence


@pytest.mark.slow
def test_world4_strategies_pass_through_the_cli(capsys):
    assert main(["verify", "verify_cases:good", "--strategy", "hsdp,hybrid", "-n", "4", "--timeout", "170",
                 "--accelerator", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("\nPASS: ") == 2 and "strategy hsdp, 4 processes" in out and "strategy hybrid" in out


def test_cli_exits_1_on_a_failure_and_prints_json(world2_reports, monkeypatch, capsys):
    import paratrain.verify.command as command

    found = [world2_reports[("good", "ddp")], world2_reports[("undivided", "ddp")]]
    monkeypatch.setattr(command, "verify_cases", lambda *a, **k: found)
    assert main(["verify", "verify_cases:undivided"]) == 1
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL: diverges at step 0: gradient norm" in out
    monkeypatch.setattr(command, "verify_cases", lambda *a, **k: found[:1])
    assert main(["verify", "verify_cases:good", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["verdict"] == "PASS"


@pytest.mark.parametrize("args, words", [
    (["verify_cases:good", "--strategy", "ddpp"], "unknown strategy 'ddpp'"),
    (["verify_cases:good", "--strategy", "hybrid"], "hybrid needs dp >= 2 and pp >= 2"),
    (["verify_cases:good", "-n", "1"], "use 2 or more processes"),
    (["verify_cases:good", "--steps", "0"], "steps must be >= 1"),
    (["verify_cases:not_a_spec"], "returned dict; return a paratrain.verify.VerifySpec"),
    (["no_such_module:build"], "cannot import 'no_such_module'"),
])
def test_bad_input_is_one_line_before_anything_starts(capsys, args, words):
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err
