"""Where things are: the repository, the test scripts, the real-code scripts."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
REALCODE = ROOT / "tests" / "realcode"
