"""Every example runs the ways its `# test-launch:` line lists (python, or `paratrain run` with flags)."""

import re
import subprocess
import sys

import pytest
from helpers.cli import PARATRAIN
from helpers.paths import ROOT

pytestmark = pytest.mark.launched  # every test here starts processes

EXAMPLES = sorted((ROOT / "examples").glob("*.py"))


def _launches(example):
    line = re.search(r"^# test-launch: (.+)$", example.read_text(), flags=re.M)
    assert line, f"{example.name} has no '# test-launch:' line"
    for variant in line.group(1).split("|"):
        words = variant.split()
        if words[0] == "python":
            yield pytest.param([sys.executable, str(example), *words[1:]], id=f"{example.stem}:{variant.strip()}")
        else:  # paratrain run -n N [script args]
            launcher, script_args = words[:4], words[4:]
            yield pytest.param(
                [*PARATRAIN, *launcher[1:], str(example), *script_args], id=f"{example.stem}:{variant.strip()}"
            )


@pytest.mark.parametrize("cmd", [c for e in EXAMPLES for c in _launches(e)])
def test_example_runs(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
