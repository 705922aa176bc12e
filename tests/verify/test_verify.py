"""``paratrain verify``: a correct setup passes under every strategy that runs at world 2 on a CPU, and each
planted bug fails with its own cause named. One job of 2 processes runs every world-2 case."""

from __future__ import annotations

import json

import pytest
import torch

from paratrain import ClusterEnv, GlobalBatch, JobConfig
from paratrain.cli.main import main
from paratrain.verify import Case, format_report, verify_cases
from paratrain.verify.diagnose import first_divergence
from paratrain.verify.distributed import RankEvidence
from paratrain.verify.floor import NoiseFloor, Tolerance
from paratrain.verify.record import Record

WORLD2_STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "pipeline", "model_parallel")
BUGS = {  # factory -> (strategy, the cause verify must name, words of its fix)
    "unsharded": ("ddp", "data loader without distributed sampling", "prepare_loader"),
    "no_reshuffle": ("ddp", "missing per-epoch reshuffle", "par.epochs"),
    "undivided": ("ddp", "accumulation without loss division", "par.backward"),
    "batchnorm": ("ddp", "BatchNorm without synchronisation", "convert_sync_batchnorm"),
    "dropout": ("ddp", "randomness in the training step", "dropout"),
    "batchnorm_accumulating": ("ddp", "BatchNorm under gradient accumulation", "accumulate=1"),
}
OWN_BUGS = {  # a loop with a loader class of its own: factory -> (strategy, the cause verify names, its fix)
    "own_undivided": ("ddp", "accumulation without loss division", "par.backward(loss)"),
    "own_undivided_a4": ("zero3", "accumulation without loss division", "par.backward(loss)"),
    "own_double": ("ddp", "loss divided twice", "drop the loop's own division"),
    "own_double_a2": ("ddp", "loss divided twice", "drop the loop's own division"),
    "own_summed": ("ddp", "summed loss", "reduction='mean'"),
    "own_summed_a1": ("ddp", "summed loss", "reduction='mean'"),
    "own_summed_a4_unclipped": ("ddp", "summed loss", "reduction='mean'"),
    "own_same_offsets": ("ddp", "every rank reads the same data", "par.data_parallel_rank"),
    "own_unsharded": ("ddp", "data loader without distributed sampling", "prepare_loader"),
}
"""Each bug in the shape of a GPT-2 script (tests/helpers/verify_cases.py): accumulation 1, 2 and 4 at world 2,
the gradient norm clipped at 1.0 (unclipped where the name says)."""
OWN_GOOD = [("own_loader", "ddp"), ("own_loader", "zero3"), ("own_loader", "tp"), ("own_loader_a4", "ddp")]
BF16_GOOD = [
    ("good_bf16", "ddp"),
    ("gpt2_bf16", "tp"),
    ("good_bf16_a1", "zero3"),
    ("own_loader_bf16", "zero3"),
    ("own_loader_bf16", "tp"),
    ("own_loader_a1_bf16", "ddp"),
    ("good_bf16_true", "ddp"),
]
"""Correct code under bf16-mixed, accumulation 2 and 1, through a DataLoader and through a loader class of its own;
bf16-true, whose loss is bf16."""
BF16_BUGS = ("own_undivided", "own_summed", "own_same_offsets", "own_unsharded")
"""Planted bugs that must keep their cause under bf16-mixed (``<name>_bf16`` in tests/helpers/verify_cases.py)."""
NOISY = {"adamw": ("ddp", "zero3"), "adadelta": ("ddp",), "scheduled": ("ddp",)}
"""Correct setups whose rounding an optimizer amplifies, or whose loop steps a scheduler: they must pass."""


@pytest.fixture(scope="module")
def world2_reports() -> dict[tuple[str, str], object]:
    cases = [Case(factory="helpers.verify_cases:good", strategy=s) for s in WORLD2_STRATEGIES]
    cases += [
        Case(factory="helpers.verify_cases:good_accumulating", strategy="zero2"),
        Case(factory="helpers.verify_cases:global_batch", strategy="ddp"),
        Case(factory="helpers.verify_cases:rank_seeded", strategy="ddp"),
        Case(factory="helpers.verify_cases:rank_seeded", strategy="zero3"),
    ]
    cases += [
        Case(factory=f"helpers.verify_cases:{name}", strategy=strategy) for name, (strategy, _, _) in BUGS.items()
    ]
    cases += [Case(factory="helpers.verify_cases:gpt2", strategy=s, steps=4) for s in ("ddp", "zero3", "tp")]
    cases += [Case(factory="helpers.verify_cases:split_tie", strategy="ddp", steps=4)]
    cases += [Case(factory=f"helpers.verify_cases:{name}", strategy=s) for name, names in NOISY.items() for s in names]
    cases += [Case(factory="helpers.verify_cases:nanogpt", strategy=s, steps=4) for s in ("ddp", "zero3", "tp")]
    cases += [Case(factory="helpers.verify_cases:nanogpt_mlp_plan", strategy="zero3", options={"tp": 2}, steps=4)]
    cases += [Case(factory="helpers.verify_cases:gpt2_labels", strategy=s, steps=4) for s in ("ddp", "tp")]
    cases += [Case(factory="helpers.verify_cases:clipped_in_parallel_only", strategy="ddp", steps=2)]
    cases += [Case(factory=f"helpers.verify_cases:{name}", strategy=s, steps=3) for name, s in OWN_GOOD]
    cases += [Case(factory="helpers.verify_cases:own_rank_seeded", strategy="zero3", steps=3)]
    cases += [Case(factory="helpers.verify_cases:own_loader_a1", strategy="ddp")]  # the default step count
    cases += [Case(factory=f"helpers.verify_cases:{name}", strategy=s, steps=3) for name, (s, _, _) in OWN_BUGS.items()]
    cases += [Case(factory=f"helpers.verify_cases:{name}", strategy=s, steps=2) for name, s in BF16_GOOD]
    cases += [Case(factory=f"helpers.verify_cases:{name}_bf16", strategy="ddp", steps=1) for name in BF16_BUGS]
    reports = verify_cases(cases, 2, timeout_s=150, accelerator="cpu")
    return {(c.factory.split(":")[1], c.strategy): r for c, r in zip(cases, reports)}


@pytest.mark.launched
@pytest.mark.parametrize("strategy", WORLD2_STRATEGIES)
def test_a_correct_setup_passes_under_every_strategy(world2_reports, strategy):
    report = world2_reports[("good", strategy)]
    assert report.passed, format_report(report)
    assert report.findings == [] and report.warnings == []
    assert report.steps >= 8 and report.epochs == pytest.approx(2.0)  # two epochs: the reshuffle was checked
    assert report.max_param_diff < 1e-6
    assert format_report(report).splitlines()[1].startswith("PASS")


@pytest.mark.launched
def test_accumulation_done_right_passes(world2_reports):
    report = world2_reports[("good_accumulating", "zero2")]
    assert report.passed and report.accumulate == 2, format_report(report)


@pytest.mark.launched
def test_a_global_batch_in_the_options_accumulates_what_the_layout_leaves(world2_reports):
    report = world2_reports[("global_batch", "ddp")]  # 32 samples = 8 a micro-batch x 2 replicas x 2 micro-steps
    assert report.passed and report.accumulate == 2 and report.options == {"global_batch": "32"}, format_report(report)


@pytest.mark.launched
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


@pytest.mark.launched
@pytest.mark.parametrize("factory, strategy", [(f, s) for f, strategies in NOISY.items() for s in strategies])
def test_correct_code_passes_against_the_measured_noise_floor(world2_reports, factory, strategy):
    report = world2_reports[(factory, strategy)]
    text = format_report(report)
    assert report.passed and report.findings == [], text
    assert report.tolerance is None and report.floor is not None and report.floor.margin == 10
    assert len(report.floor.parameters_by_step) == report.steps and report.epochs == pytest.approx(2.0)
    assert "noise floor" in text.splitlines()[1]


@pytest.mark.launched
def test_adamw_amplifies_rounding_past_the_old_fixed_tolerance(world2_reports):
    # the GroupNorm'd bias has a gradient of pure rounding noise, which AdamW turns into steps of up to lr: two
    # correct one-process runs already part by more than the old fixed 1e-5, and so does the parallel run
    for strategy in NOISY["adamw"]:
        report = world2_reports[("adamw", strategy)]
        assert report.floor.parameters_by_step[0] > 1e-5 and report.max_param_diff > 1e-5, format_report(report)
    assert world2_reports[("adadelta", "ddp")].floor.parameters < 1e-5  # without such a bias, Adadelta's stays low


@pytest.mark.launched
def test_the_reference_runs_the_users_loop(world2_reports):
    # mnist/main.py's StepLR, stepped once an epoch inside the loop, halves the rate after epoch 0 in both runs
    report = world2_reports[("scheduled", "ddp")]
    assert report.passed and report.steps == 8 and report.epochs == pytest.approx(2.0), format_report(report)


@pytest.mark.launched
def test_dropout_is_named_not_absorbed_into_the_floor(world2_reports):
    report = world2_reports[("dropout", "ddp")]
    assert "first losses" in report.findings[0].evidence and report.tolerance == 1e-5, format_report(report)


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "tp"])
def test_a_transformers_model_with_a_tied_head_passes(world2_reports, strategy):
    report = world2_reports[("gpt2", strategy)]
    assert report.passed, format_report(report)


@pytest.mark.launched
def test_a_split_tie_is_named_with_the_parameter_it_left_untrained(world2_reports):
    report = world2_reports[("split_tie", "ddp")]
    text = format_report(report)
    assert not report.passed, text
    assert [f.cause for f in report.findings] == ["tied parameters split", "parameters never trained"], text
    assert "'lm_head.weight' and 'transformer.wte.weight'" in report.findings[0].evidence
    assert "lm_head.weight" in report.findings[1].evidence


@pytest.mark.launched
def test_where_each_bug_first_shows(world2_reports):
    # every rank reads the same batch, so the very first loss is another batch's
    assert world2_reports[("unsharded", "ddp")].divergence.what == "loss"
    # epoch 0 is right; the first step of epoch 1 (4 steps of 2 x 8 samples into 64) re-reads epoch 0's order
    assert world2_reports[("no_reshuffle", "ddp")].divergence.step == 4
    # the gradients are twice the reference's from the first step on, the loss is not affected
    undivided = world2_reports[("undivided", "ddp")].divergence
    assert (undivided.step, undivided.what) == (0, "gradient norm")
    assert undivided.parallel == pytest.approx(2 * undivided.reference, rel=1e-4)


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
def test_ranks_seeded_apart_start_from_rank0s_weights_under_every_strategy(world2_reports, strategy):
    """nanoGPT seeds each rank with its rank before it builds the model; prepare starts every rank from rank 0's
    weights, so the run equals one process and verify says so in a note, not as a fault."""
    report = world2_reports[("rank_seeded", strategy)]
    assert report.passed and not report.warnings and not report.findings, format_report(report)
    assert any("every rank started from rank 0's weights" in n for n in report.notes)


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["ddp", "zero3", "tp"])
def test_nanogpt_with_its_own_loss_optimizer_and_options_passes(world2_reports, strategy):
    """model(x, y) -> (logits, loss), configure_optimizers' groups, clip_grad_norm and seed in the spec's options."""
    report = world2_reports[("nanogpt", strategy)]
    text = format_report(report)
    assert report.passed and report.steps == 4, text
    assert report.options == {"clip_grad_norm": "0.05", "seed": "1337"}
    assert f"strategy {strategy}, clip_grad_norm=0.05, seed=1337, 2 processes" in text


def test_the_clip_acts_so_the_reference_must_clip_too():
    """nanogpt()'s gradient norm is far above its clip: had the reference not clipped, the PASS above would fail."""
    from helpers import verify_cases

    spec = verify_cases.nanogpt()
    x, y = next(iter(spec.loader))
    spec.model(x, y)[1].backward()
    norm = torch.nn.utils.get_total_norm([p.grad for p in spec.model.parameters()])
    assert norm > 10 * verify_cases.NANOGPT_CLIP


@pytest.mark.launched
def test_an_option_in_one_run_only_fails_at_the_first_step(world2_reports):
    report = world2_reports[("clipped_in_parallel_only", "ddp")]
    d = report.divergence
    # the gradient norm is compared before clipping (the same in both runs): the first update is what differs
    assert not report.passed and (d.step, d.what) == (0, "parameters"), format_report(report)
    assert d.max_diff > 1e-3


@pytest.mark.launched
def test_the_specs_strategy_options_combine_with_the_commands(world2_reports):
    report = world2_reports[("nanogpt_mlp_plan", "zero3")]
    assert report.passed, format_report(report)
    assert report.options["tp"] == "2" and "mlp.c_fc" in report.options["tp_plan"]


@pytest.mark.launched
@pytest.mark.parametrize("strategy", ["ddp", "tp"])
def test_a_transformers_model_computing_its_loss_from_labels_passes(world2_reports, strategy):
    report = world2_reports[("gpt2_labels", strategy)]
    assert report.passed, format_report(report)


@pytest.mark.launched
@pytest.mark.parametrize("factory, strategy", OWN_GOOD)
def test_a_loop_with_a_loader_of_its_own_passes(world2_reports, factory, strategy):
    """Offsets drawn per replica, micro-steps in range(par.accumulate), clipping: the reference replays the batches
    the parallel run fed, the replicas' joined, each window as one batch (it would fail on one micro-batch a step)."""
    report = world2_reports[(factory, strategy)]
    text = format_report(report)
    assert report.passed and report.replayed and report.findings == [], text
    assert report.steps == 3 and "3 steps on the batches the loop fed" in text


@pytest.mark.launched
@pytest.mark.parametrize("factory", OWN_BUGS)
def test_each_bug_in_a_loop_with_a_loader_of_its_own_is_named_with_its_fix(world2_reports, factory):
    strategy, cause, fix = OWN_BUGS[factory]
    report = world2_reports[(factory, strategy)]
    text = format_report(report)
    assert not report.passed and [f.cause for f in report.findings] == [cause], text
    assert fix in report.findings[0].hint and "samples read" not in text, text
    assert report.replayed == (factory != "own_unsharded")  # a DataLoader read through: its samples are the evidence


@pytest.mark.launched
def test_the_gradient_norm_compared_is_the_one_before_clipping(world2_reports):
    # a summed loss's gradient norm is far above the clip (1.0): after clipping the two runs' would both be 1.0
    d = world2_reports[("own_summed", "ddp")].divergence
    assert (d.step, d.what) == (0, "loss") and d.parallel == pytest.approx(d.reference / 4, rel=1e-4)
    report = world2_reports[("own_summed", "ddp")]
    assert report.findings[0].evidence.startswith("the first step's loss and gradient norm are 1/4")


@pytest.mark.launched
def test_the_reference_takes_a_whole_window_as_one_batch_so_a_missing_division_shows(world2_reports):
    # one batch a step in one process (par.accumulate 1 there): the loop's bare backward is the right math there
    d = world2_reports[("own_undivided", "ddp")].divergence
    assert (d.step, d.what) == (0, "gradient norm") and d.parallel == pytest.approx(2 * d.reference, rel=1e-4)


@pytest.mark.launched
def test_a_double_division_shows_though_the_one_process_loop_divides_alike(world2_reports):
    # the loop's own / grad_accum_steps also runs in the reference, so the runs agree; one backward on the global
    # batch outside the loop is the scale both must have
    report = world2_reports[("own_double", "ddp")]
    assert report.divergence is None and report.findings[0].evidence.startswith("the first step's gradient norm is 1/4")


@pytest.mark.launched
def test_a_loop_without_the_specs_loader_compares_a_fixed_number_of_steps_by_default(world2_reports):
    from paratrain.verify.distributed import FED_DEFAULT_STEPS

    report = world2_reports[("own_loader_a1", "ddp")]  # loader=None: no epochs to count
    assert report.passed and report.steps == FED_DEFAULT_STEPS and report.epochs == 0.0, format_report(report)


@pytest.mark.launched
def test_a_loop_with_a_loader_of_its_own_seeded_per_rank_starts_from_rank0s_weights(world2_reports):
    report = world2_reports[("own_rank_seeded", "zero3")]
    assert report.passed and not report.findings, format_report(report)
    assert any("every rank started from rank 0's weights" in n for n in report.notes)


@pytest.mark.launched
@pytest.mark.parametrize("factory, strategy", BF16_GOOD)
def test_correct_code_under_bf16_passes_against_the_ranks_rounding(world2_reports, factory, strategy):
    """Each rank rounds its micro-batch's gradient to bf16: a twin that only reorders rounds like the reference (a
    floor of 0, so this failed by 1e-4); one that runs the ranks' micro-batches measures that rounding."""
    report = world2_reports[(factory, strategy)]
    text = format_report(report)
    assert report.passed and report.findings == [] and report.options["precision"].startswith("'bf16-"), text
    assert report.floor.parameters_by_step[0] > 0, text  # the reordering twin's was 0


@pytest.mark.launched
@pytest.mark.parametrize("bug", BF16_BUGS)
def test_each_bug_under_bf16_keeps_its_cause(world2_reports, bug):
    _, cause, fix = OWN_BUGS[bug]
    report = world2_reports[(f"{bug}_bf16", "ddp")]
    text = format_report(report)
    assert not report.passed and [f.cause for f in report.findings] == [cause] and fix in report.findings[0].hint, text
    if bug != "own_same_offsets":  # the replicas' joined batch is one batch twice: the same math, named by evidence
        assert report.divergence is not None and report.divergence.step == 0, text


@pytest.mark.parametrize(
    "accumulate, replicas, grad_ratio, loss_ratio, cause",
    [
        (4, 2, 4.0, 1.0, "accumulation without loss division"),
        (2, 2, 0.5, 1.0, "loss divided twice"),
        (2, 1, 0.5, 1.0, "loss divided twice"),  # tp: one replica; the loss tells it from a summed loss
        (2, 1, 0.5, 0.5, "summed loss"),
        (4, 2, 0.125, 0.125, "summed loss"),
        (1, 2, 0.5, 0.5, "summed loss"),
        (2, 2, 1.0, 1.0, None),
        (1, 2, 0.5, 1.0, None),
    ],
)
def test_the_gradient_scale_names_each_cause_for_any_ratio_of_accumulation_to_replicas(
    accumulate, replicas, grad_ratio, loss_ratio, cause
):
    from paratrain.verify.diagnose import gradient_scale_finding

    ref = Record(losses=[[2.0]], grad_norms=[0.3], global_first=(2.0, 0.8))  # its own step is not the scale
    mine = Record(losses=[[2.0 * loss_ratio] * accumulate], grad_norms=[0.8 * grad_ratio])
    ranks = [RankEvidence(case=Case(factory="f:g", strategy="ddp"), record=mine)]
    finding = gradient_scale_finding(ranks, ref, accumulate, replicas)
    assert (finding.cause if finding else None) == cause


def test_the_replicas_micro_batches_are_joined_per_window_or_per_micro_step():
    from paratrain.verify.reference import Feeds

    def call(*rows: int) -> list[torch.Tensor]:
        return [torch.tensor([[r, r] for r in rows]), torch.tensor(7)]  # a batch, and a 0-d tensor

    feeds = Feeds(inputs=[[[call(0, 1), call(2, 3)]], [[call(4, 5), call(6, 7)]]], targets=[[[]], [[]]])
    assert feeds.every_step_calls(2) and not feeds.every_step_calls(1)
    (window,) = feeds.joined("inputs", 2, "global")[0]  # one call a step: both micro-steps of both replicas
    assert window[0][:, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7] and window[1].item() == 7
    first, second = feeds.joined("inputs", 1, "global")[0]  # a call per micro-step: the replicas' joined
    assert first[0][:, 0].tolist() == [0, 1, 4, 5] and second[0][:, 0].tolist() == [2, 3, 6, 7]
    (twin,) = feeds.joined("inputs", 2, "shards")[0]  # the same samples, summed in another order
    assert twin[0][:, 0].tolist() == [7, 6, 5, 4, 3, 2, 1, 0]


def test_a_run_that_fed_the_model_nothing_recordable_is_one_line_not_a_replay():
    from paratrain.verify.reference import NOTHING_FED, Feeds, reference_run

    record = reference_run("f:g", {}, None, 2, 3, feeds=Feeds(inputs=[[[], []]], targets=[[[], []]]))
    assert record.error == NOTHING_FED and "VerifySpec.loader" in NOTHING_FED


def test_samples_read_are_claimed_only_when_read_through_the_loader():
    from paratrain.verify.diagnose import Divergence
    from paratrain.verify.report import VerifyReport

    d = Divergence(step=0, what="loss", parallel=1.0, reference=2.0, max_diff=1.0, allowed=1e-6, floor=1e-7)
    replayed = VerifyReport(factory="f:g", strategy="ddp", world=2, steps=2, divergence=d, replayed=True)
    assert "samples read" not in format_report(replayed) and "batches of its own" in format_report(replayed)
    read = VerifyReport(factory="f:g", strategy="ddp", world=2, steps=2, epochs=1.0, divergence=d)
    assert "samples read, gradient scale" in format_report(read)


def _record(*weights: float, bias: float = 0.5) -> Record:
    """One step per weight, a loss of 1 and a gradient norm of 1 each."""
    return Record(
        losses=[[1.0]] * len(weights),
        grad_norms=[1.0] * len(weights),
        states=[{"w": torch.tensor([w]), "b": torch.tensor([bias])} for w in weights],
    )


def test_each_entry_is_judged_against_its_own_floor_at_its_step():
    ref, twin = _record(0.1, 0.2), _record(0.1 + 1e-4, 0.2)  # the floor of w: 1e-4 from step 0 on (running max)
    floor = NoiseFloor(ref, twin)
    within = [RankEvidence(case=Case(factory="f:g", strategy="ddp"), record=_record(0.1 + 9e-4, 0.2 - 9e-4))]
    assert first_divergence(within, ref, floor)[0] is None
    beyond = [RankEvidence(case=Case(factory="f:g", strategy="ddp"), record=_record(0.1, 0.2 + 2e-3))]
    d = first_divergence(beyond, ref, floor)[0]
    assert (d.step, d.parameter, d.floor) == (1, "w", pytest.approx(1e-4, rel=1e-3))
    assert d.allowed == pytest.approx(1e-3, rel=1e-2)
    # b's floor is exactly zero: one rounding passes, a real difference does not
    ulp = [RankEvidence(case=Case(factory="f:g", strategy="ddp"), record=_record(0.1, 0.2, bias=0.5 + 6e-8))]
    assert first_divergence(ulp, ref, floor)[0] is None
    off = [RankEvidence(case=Case(factory="f:g", strategy="ddp"), record=_record(0.1, 0.2, bias=0.5 + 1e-5))]
    assert first_divergence(off, ref, floor)[0].parameter == "b"
    # a fixed tolerance (--tolerance) ignores the floor
    assert first_divergence(within, ref, Tolerance(1e-5))[0].parameter == "w"
    assert first_divergence(beyond, ref, Tolerance(1e-2))[0] is None


@pytest.mark.launched
@pytest.mark.slow
def test_world4_strategies_pass_through_the_cli(capsys):
    assert (
        main(
            [
                "verify",
                "helpers.verify_cases:good",
                "--strategy",
                "hsdp,hybrid",
                "-n",
                "4",
                "--timeout",
                "170",
                "--accelerator",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.count("\nPASS: ") == 2 and "strategy hsdp, 4 processes" in out and "strategy hybrid" in out


@pytest.mark.launched
def test_cli_exits_1_on_a_failure_and_prints_json(world2_reports, monkeypatch, capsys):
    import paratrain.verify.command as command

    found = [world2_reports[("good", "ddp")], world2_reports[("undivided", "ddp")]]
    monkeypatch.setattr(command, "verify_cases", lambda *a, **k: found)
    assert main(["verify", "helpers.verify_cases:undivided"]) == 1
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL: diverges at step 0: gradient norm" in out
    monkeypatch.setattr(command, "verify_cases", lambda *a, **k: found[:1])
    assert main(["verify", "helpers.verify_cases:good", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["verdict"] == "PASS"


@pytest.mark.parametrize(
    "args, words",
    [
        (["helpers.verify_cases:good", "--strategy", "ddpp"], "unknown strategy 'ddpp'"),
        (["helpers.verify_cases:good", "--strategy", "hybrid"], "hybrid needs dp >= 2 and pp >= 2"),
        (["helpers.verify_cases:good", "-n", "1"], "use 2 or more processes"),
        (["helpers.verify_cases:good", "--steps", "0"], "steps must be >= 1"),
        (["helpers.verify_cases:not_a_spec"], "returned dict; return a paratrain.verify.VerifySpec"),
        (["no_such_module:build"], "cannot import 'no_such_module'"),
        (
            ["helpers.verify_cases:no_loss"],
            "Sequential.forward takes no second argument for them; give a loss function",
        ),
        (
            ["helpers.verify_cases:tp_in_options", "--strategy", "zero3", "--tp", "4"],
            "--tp 4 and VerifySpec.options tp=2 disagree",
        ),
        (
            ["helpers.verify_cases:tp_in_options", "--strategy", "hsdp", "-n", "4"],
            "the strategy got tp from VerifySpec.options",
        ),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(capsys, args, words):
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def _spec_kwargs(**kwargs: object) -> dict:
    from torch.nn import functional as F
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    return {
        "model": torch.nn.Linear(4, 2),
        "optimizer": lambda p: torch.optim.SGD(p, lr=0.1),
        "loss": F.cross_entropy,
        "loader": DataLoader(data, batch_size=2),
        **kwargs,
    }


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"options": {"accumulate": 2}}, "cannot set 'accumulate': use VerifySpec.accumulate"),
        ({"options": {"checkpoint_dir": "ck"}}, "leave checkpoints to the script"),
        ({"options": {"job": JobConfig(env=ClusterEnv())}}, "cannot set 'env': verify places both runs itself"),
        ({"options": {"global_batch": 8}, "accumulate": 2}, "give one of them"),
        ({"options": {"global_batch": 8, "micro_batch": 4}}, "micro_batch=4 but the loader's batch size is 2"),
        ({"options": {"micro_batch": 2}}, "micro_batch without global_batch"),
        ({"options": ["seed"]}, "must be a dict of Parallel keywords"),
        ({"optimizer_from_model": lambda m: torch.optim.SGD(m.parameters(), lr=0.1)}, "takes one of optimizer"),
        ({"optimizer": None}, "takes one of optimizer"),
        ({"target_keyword": "labels"}, "for a model that computes its own loss (loss=None)"),
        ({"loss": None, "target_keyword": "labels"}, "Linear.forward takes no keyword 'labels'"),
        ({"loader": None}, "VerifySpec(loader=None) needs train=: your loop"),
        ({"loader": None, "train": print, "options": {"global_batch": 8}}, "without a loader needs micro_batch"),
    ],
)
def test_a_bad_spec_is_one_line(kwargs, words):
    from paratrain.errors import ConfigError
    from paratrain.verify import VerifySpec

    with pytest.raises(ConfigError) as err:
        VerifySpec(**_spec_kwargs(**kwargs))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_the_specs_options_are_sorted_by_the_run_they_reach():
    from paratrain.verify import VerifySpec

    spec = VerifySpec(
        **_spec_kwargs(
            options={
                "clip_grad_norm": 1.0,
                "seed": 3,
                "precision": "bf16-mixed",
                "global_batch": 8,
                "tp_plan": {"x": "colwise"},
            }
        )
    )
    run = spec.run_options
    assert run.parallel(1, 2) == {
        "clip_grad_norm": 1.0,
        "seed": 3,
        "precision": "bf16-mixed",
        "accumulate": GlobalBatch(8, micro=2),
    }
    assert dict(run.shared) == {"clip_grad_norm": 1.0, "seed": 3, "precision": "bf16-mixed"}  # the reference's
    assert dict(run.strategy) == {"tp_plan": {"x": "colwise"}}  # the parallel run's alone
    assert VerifySpec(**_spec_kwargs(accumulate=2)).run_options.parallel(2, 2) == {"accumulate": 2}
    grouped = VerifySpec(**_spec_kwargs(options={"accumulate": GlobalBatch(8), "timeout_s": 60.0})).run_options
    assert grouped.parallel(1, 2) == {"job": JobConfig(timeout_s=60.0), "accumulate": GlobalBatch(8, micro=2)}


def test_an_optimizer_factory_gets_the_model_and_must_return_an_optimizer():
    from paratrain.errors import ConfigError
    from paratrain.verify import VerifySpec

    seen = []
    spec = VerifySpec(
        **_spec_kwargs(
            optimizer=None, optimizer_from_model=lambda m: seen.append(m) or torch.optim.SGD(m.parameters(), lr=0.1)
        )
    )
    assert isinstance(spec.build_optimizer(), torch.optim.SGD) and seen == [spec.model]
    with pytest.raises(ConfigError, match="returned list; return a torch.optim.Optimizer"):
        VerifySpec(**_spec_kwargs(optimizer=lambda p: list(p))).build_optimizer()
