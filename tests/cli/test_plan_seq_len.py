"""``paratrain plan --seq-len``: a long sequence's plan says which layouts fit and which need context parallelism
(``--cp``, ``--layout zero3,cp=2``), as text and as JSON; the default sequence length is the model's own."""

from __future__ import annotations

import json

from paratrain.cli.main import main

LLAMA_32K = ["plan", "--model", "llama3-8b", "--seq-len", "32768", "--gpus", "8", "--batch", "1"]


def test_plan_seq_len_says_which_layouts_need_cp(capsys):
    assert main(LLAMA_32K) == 0
    out = capsys.readouterr().out
    assert "seq 32768" in out and "cp a2a ms" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.split() and "+cp" in line.split()[0]}
    assert {"ddp+cp", "zero2+cp", "zero3+cp"} <= set(rows) and "cp=" in rows["zero3+cp"]
    zero3 = next(line for line in out.splitlines() if line.startswith("zero3 "))
    assert " no +" in zero3  # without cp (or tp) it does not fit
    assert "note: context parallelism: at 32768 tokens a sample, without it tp fits as planned; with it " in out
    assert "recommended: zero2+cp" in out


def test_plan_seq_len_as_json_and_the_default_length(capsys):
    assert main([*LLAMA_32K, "--cp", "4", "--tp", "1", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    with_cp = [s for s in plan["strategies"] if s["layout"]["cp"] > 1]
    assert with_cp and {s["layout"]["cp"] for s in with_cp} == {4}
    assert all(s["time"]["cp_comm_s"] > 0 for s in with_cp)
    assert [s["name"] for s in with_cp if s["fits"]] == ["zero3+cp"]  # at cp=4 only zero3 shards enough
    assert not any(s["fits"] for s in plan["strategies"] if s["layout"]["cp"] == 1)
    assert main(["plan", "--model", "llama3-8b", "--gpus", "8", "--cp", "1", "--json"]) == 0
    short = json.loads(capsys.readouterr().out)
    assert "seq 8192" in short["model"]["source"]  # the model's own context when --seq-len is not given
    assert all(s["layout"]["cp"] == 1 for s in short["strategies"])


def test_a_bad_cp_is_one_line(capsys):
    assert main([*LLAMA_32K, "--cp", "3"]) != 0
    err = capsys.readouterr().err.strip()
    assert err.endswith(
        "--cp 3: sequence length 32768 does not divide by 2 x cp = 6 (the all-gather's: heads 32 and key/value heads "
        "8 do not divide by tp x cp = 3); use one of 1, 2, 4, 8"
    )
    assert len(err.splitlines()) == 1
