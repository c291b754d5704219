"""The tree is linted and formatted by ruff (pyproject.toml [tool.ruff], docs/testing.md "Lint and
format"): `ruff check` finds nothing and `ruff format --check` would change nothing."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _ruff() -> str:
    exe = Path(sys.prefix) / "bin" / "ruff"
    found = str(exe) if exe.is_file() else shutil.which("ruff")
    assert found, "ruff is not installed: it is in the [dev] extra (scripts/env.sh dev installs it)"
    return found


@pytest.mark.parametrize(
    "args", [["check", "--no-cache", "."], ["format", "--check", "--no-cache", "."]], ids=["check", "format"]
)
def test_ruff(args):
    r = subprocess.run([_ruff(), *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"ruff {' '.join(args)}:\n{r.stdout[-4000:]}{r.stderr[-2000:]}"
