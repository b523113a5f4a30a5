"""The code base stays ruff clean (lint and format), as CONVENTIONS.md asks."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PATHS = ["plugins", "dags", "jobs", "tests", "bench"]


def test_ruff_lint_and_format_are_clean():
    lint = subprocess.run([sys.executable, "-m", "ruff", "check", *PATHS], cwd=ROOT, capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout
    fmt = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", *PATHS], cwd=ROOT, capture_output=True, text=True
    )
    assert fmt.returncode == 0, fmt.stdout
