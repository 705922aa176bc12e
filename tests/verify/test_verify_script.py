"""``paratrain verify train.py [args]``: an unchanged script (tests/scripts/tiny_gpt_train.py: a loader class of
its own, accumulation by micro-steps, clipping, rank-0 printing and saving, forwards outside ``par.step``) passes
under its own strategy and another, and its planted same-data bug is named. Two launches of 2 processes."""

from __future__ import annotations

import pytest
from helpers.paths import SCRIPTS

from paratrain.cli.main import _parse, main

SCRIPT = str(SCRIPTS / "tiny_gpt_train.py")


@pytest.mark.launched
@pytest.mark.timeout(400)
def test_the_correct_script_passes_under_its_strategy_and_another(capsys, tmp_path):
    code = main(
        ["verify", SCRIPT, "--out", str(tmp_path), "--strategy", "ddp,zero3", "--steps", "3", "--timeout", "150"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.count("PASS") == 2 and "strategy ddp" in out and "strategy zero3" in out, out
    assert "accumulate 2, 3 steps on the batches the loop fed" in out
    assert "iter 0" not in out  # the script's own prints go to stderr, not into the report
    assert (tmp_path / "ckpt.pt").is_file()  # rank 0 saved, as the script does


@pytest.mark.launched
@pytest.mark.timeout(300)
def test_every_rank_reading_the_same_data_is_named(capsys):
    code = main(["verify", SCRIPT, "--same-data", "--steps", "2", "--timeout", "150"])
    out = capsys.readouterr().out
    assert code == 1 and "every rank reads the same data" in out and "par.data_parallel_rank" in out, out


def test_verify_flags_are_read_among_the_script_arguments():
    args = _parse(["verify", "t.py", "--same-data", "--out", "D", "--strategy", "ddp,zero3", "-n", "4", "--steps", "3"])
    assert args.script_args == ["--same-data", "--out", "D"]
    assert (args.factory, args.strategies, args.nproc, args.steps) == ("t.py", "ddp,zero3", 4, 3)
    args = _parse(["verify", "--tf", "kmodel:build", "-n", "3", "--steps", "4"])  # a factory's flags after it too
    assert (args.tf, args.nproc, args.steps, args.script_args) == (True, 3, 4, [])
    assert _parse(["verify", "kmodel:build", "--tf", "--steps", "4"]).tf


@pytest.mark.parametrize(
    "args, words",
    [
        (["no_such_script.py"], "no script 'no_such_script.py'"),
        ([SCRIPT, "--strategy", "ddpp"], "unknown strategy 'ddpp'"),
        ([SCRIPT, "-n", "1"], "use 2 or more processes"),
        ([SCRIPT, "--steps", "0"], "steps must be >= 1"),
        (["helpers.verify_cases:good", "--same-data"], "unknown arguments --same-data"),
    ],
)
def test_bad_input_is_one_line_before_anything_starts(capsys, args, words):
    assert main(["verify", *args]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_a_failed_launch_is_named_by_the_script_s_last_line_and_the_launcher_s():
    from paratrain.verify.script import _why

    stderr = "usage: t.py\nt.py: error: unrecognized arguments: --bogus\nparatrain: rank 0 failed (exit code 2)\nr1"
    assert _why(stderr) == "t.py: error: unrecognized arguments: --bogus; paratrain: rank 0 failed (exit code 2)"
    assert _why("") == "no output" and _why("a\nb\n") == "b"
