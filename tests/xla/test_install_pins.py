"""The TPU install pins (constraints/tpu.txt) resolve on PyPI for cp311, and the XLA tier ran them.

`test_pins_resolve_for_cp311` runs pip's resolver (`install --dry-run --report`, Python 3.11,
wheels only) for the `[tpu]` extra plus the main dependencies the file pins (torch, numpy),
under the constraints, and checks that every pinned package resolves to exactly its pin.

It runs a pinned, current pip (25.3, taken from PyPI into a temporary folder and run from its
wheel): the venv's pip 23.2 cannot dry-run with --python-version without --target, and
downloads every wheel (the CUDA torch alone is 527 MB; over a minute here) where 25.3 reads
PyPI's metadata files. pip's configuration is switched off (PIP_CONFIG_FILE=/dev/null, no PIP_*
variables): this machine's config adds local wheel folders and indexes (a torch 2.13.0+cpu wheel,
a local mirror) and a torch cap, which would answer for PyPI. PyPI's Linux torch 2.13.0 is the
CUDA build, so NVIDIA wheels join the resolution; a TPU VM takes torch from the CPU index
(scripts/env.sh), whose wheel has no such dependencies. Skipped when PyPI cannot be reached.

`test_ttpu_venv_matches_the_pins`: the ttpu venv (torch-tpu's compile path in this tier) has
exactly the pinned versions, so what the tier proved is what a TPU VM installs.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request

import pytest
import tomllib

from tests.e2e.test_install import normalize, read_pins
from tests.xla.conftest import ROOT, xla_python

pytestmark = pytest.mark.xla

PIP = "pip==25.3"
INDEX = "https://pypi.org/simple"
PINS = read_pins(ROOT / "constraints" / "tpu.txt")


def _isolated_pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_CACHE_DIR="1")
    return env


def _pypi_reachable() -> bool:
    try:
        with urllib.request.urlopen(f"{INDEX}/pip/", timeout=15):
            return True
    except OSError:
        return False


def _requirements() -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    main = [r for r in project["dependencies"] if normalize(re.match(r"[A-Za-z0-9_.-]+", r).group(0)) in PINS]
    return project["optional-dependencies"]["tpu"] + main


def test_pins_resolve_for_cp311(tmp_path):
    if not _pypi_reachable():
        pytest.skip(f"{INDEX} is not reachable: the pins cannot be resolved here")
    env = _isolated_pip_env()
    got = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "--index-url",
            INDEX,
            "-d",
            str(tmp_path),
            PIP,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert got.returncode == 0, got.stderr[-2000:]
    (wheel,) = tmp_path.glob("pip-*.whl")
    report = tmp_path / "report.json"
    requirements = _requirements()
    out = subprocess.run(
        [
            sys.executable,
            f"{wheel}/pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "-q",
            "--report",
            str(report),
            "--python-version",
            "3.11",
            "--only-binary=:all:",
            "--index-url",
            INDEX,
            "-c",
            str(ROOT / "constraints" / "tpu.txt"),
            *requirements,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"pip could not resolve {requirements} under constraints/tpu.txt:\n{out.stderr[-4000:]}"
    resolved = {
        normalize(i["metadata"]["name"]): i["metadata"]["version"] for i in json.loads(report.read_text())["install"]
    }
    assert {name: resolved.get(name) for name in PINS} == PINS
    # every source is PyPI's (no local folder or mirror answered)
    urls = {i["download_info"]["url"].split("/packages/")[0] for i in json.loads(report.read_text())["install"]}
    assert urls == {"https://files.pythonhosted.org"}, urls


def test_ttpu_venv_matches_the_pins():
    code = "import json, sys, importlib.metadata as m; print(json.dumps({n: m.version(n) for n in sys.argv[1:]}))"
    out = subprocess.run([str(xla_python("ttpu")), "-c", code, *PINS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    installed = {name: version.split("+")[0] for name, version in json.loads(out.stdout).items()}
    assert installed == PINS, "the ttpu venv differs from constraints/tpu.txt (rm -r .venv-ttpu to rebuild it)"
