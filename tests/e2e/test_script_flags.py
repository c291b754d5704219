"""Every user command under scripts/ answers `--help` (exit 0, the usage on stdout) and refuses a flag
it does not know with exit 2, before it installs or starts anything.

The shell commands run here (`--help` and one bad flag each; nothing trains: the bad flags are
refused by the script, or by the trainer's command line before a model exists). Before: `xla_env.sh
--help` exited 2, `launch_pod.sh local 2 1 --no-such-flag -- ...` trained anyway (the platforms
ignored extra words), `tpu_smoke.sh --no-such-flag` went on to make the TPU venv, `test.sh
--no-such-flag` exited 4 (pytest's usage error) and `source env.sh --help` made a venv with the
extra `--help`. The Python commands are run by tests/e2e/test_cli.py (`--help` and a bad flag each,
in one forking runner); here each must be one of its entry points.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.e2e.test_cli import ENTRY_POINTS
from tests.support.trainer_runs import ENV, REPO

SCRIPTS = sorted(n for n in os.listdir(os.path.join(REPO, "scripts")) if n.endswith((".sh", ".py")))
VENV = os.path.dirname(os.path.dirname(sys.executable))

BAD = {  # the shell commands' bad flag, where a platform or a position comes first
    "launch_pod.sh": ["local", "2", "1", "--no-such-flag", "--", "--config", "configs/llama3_debug.toml"],
}
ONE_LINE = {"env.sh", "launch_pod.sh", "tpu_smoke.sh", "train.sh", "xla_env.sh"}
"""Refused with exactly one `error:` line (test.sh passes pytest's own usage error through)."""


def _run(name: str, args: list[str]) -> subprocess.CompletedProcess:
    path = os.path.join("scripts", name)
    # env.sh is sourced (`source scripts/env.sh tpu`); the others run
    argv = ["bash", "-c", f'source {path} "$@"', "env.sh", *args] if name == "env.sh" else ["bash", path, *args]
    env = {**ENV, "PYTHON": sys.executable, "TITAN_NO_INSTALL": "1", "TITAN_VENV": VENV, "DRY_RUN": "0"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def test_every_script_is_listed():
    assert {"env.sh", "launch_pod.sh", "test.sh", "tpu_smoke.sh", "train.sh", "xla_env.sh"} <= set(SCRIPTS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_0_and_a_bad_flag_exits_2(name):
    if name.endswith(".py"):  # run with --help and a bad flag by tests/e2e/test_cli.py
        assert f"scripts/{name}" in ENTRY_POINTS, f"scripts/{name} has no shared command line (trainer/runtime/cli.py)"
        return
    helped = _run(name, ["--help"])
    assert helped.returncode == 0, helped.stderr[-2000:]
    assert helped.stdout.startswith("usage:") and "Traceback" not in helped.stderr, helped.stdout[:500]
    bad = _run(name, BAD.get(name, ["--no-such-flag"]))
    assert bad.returncode == 2, (bad.returncode, bad.stdout[-2000:], bad.stderr[-2000:])
    assert "--no-such-flag" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr[-2000:]
    assert "setting up" not in bad.stderr  # nothing installed
    if name in ONE_LINE:
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), lines
