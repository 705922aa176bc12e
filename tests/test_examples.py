"""Every example runs under `paratrain run -n 2` and as a plain single process."""
import subprocess
import sys

import pytest

from conftest import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.name for e in EXAMPLES])
def test_example_runs(paratrain_cmd, example):
    for cmd in ([*paratrain_cmd, "run", "-n", "2", str(example)], [sys.executable, str(example)]):
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
