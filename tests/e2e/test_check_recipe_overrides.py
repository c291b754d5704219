"""`scripts/check_recipe.py --all` with a malformed override: the override is checked once, before
any recipe, so the answer is one `error:` line and exit 2 (bad input), not one error per recipe
and exit 1 (the contract, CONTRIBUTING.md)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.trainer_runs import ENV, REPO


@pytest.mark.parametrize(
    "override, want",
    [
        ("--training.seq_len=abc", "error: training.seq_len: expected an integer, got 'abc'"),
        ("--training.seq_lenn=64", "error: unknown key training.seq_lenn in --training.seq_lenn"),
    ],
)
def test_a_malformed_override_is_one_error_line(override, want):
    proc = subprocess.run(
        [sys.executable, "scripts/check_recipe.py", "--all", "--no-capture", override],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(want), proc.stderr[-3000:]
    assert proc.stdout == ""  # no table: nothing was checked
