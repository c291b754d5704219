"""The XLA tier: checks of the XLA/TPU path that run in their own pinned venvs.

Tests here are collected by the main pytest run but import nothing of torchax, jax or torch-tpu:
each runs one probe script (`tests/xla/probes/*.py`) in a subprocess under one of the venvs that
`scripts/xla_env.sh` makes (xla: torch + jax + torchax; tpuc: jax[tpu] for deviceless TPU
compiles; ttpu: torch-tpu), because torchax and torch-tpu change process globals. A probe prints
one JSON object on its last stdout line; `run_probe` returns it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBES = Path(__file__).resolve().parent / "probes"


def _probe_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env.update(
        PYTHONPATH=str(ROOT),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        TPU_SKIP_MDS_QUERY="1",
        JAX_PLATFORMS="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        XLA_FLAGS="--xla_cpu_multi_thread_eigen=false",
        PYTHONUNBUFFERED="1",
    )
    return env


_VENVS: dict[str, Path] = {}


def xla_python(name: str) -> Path:
    """The python of venv `name` (xla | tpuc | ttpu), made on first use by scripts/xla_env.sh."""
    if name not in _VENVS:
        out = subprocess.run(["bash", str(ROOT / "scripts" / "xla_env.sh"), name], check=True,
                             capture_output=True, text=True)
        _VENVS[name] = Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"
    return _VENVS[name]


def run_probe(venv: str, probe: str, *args: str, timeout: float = 600) -> dict:
    """Run `tests/xla/probes/<probe>` with `args` in venv `venv`; the JSON of its last stdout line."""
    cmd = [str(xla_python(venv)), str(PROBES / probe), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_probe_env(), cwd=ROOT)
    if proc.returncode != 0:
        pytest.fail(f"probe {probe} {' '.join(args)} exited {proc.returncode}\n--- stdout\n"
                    f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}", pytrace=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    assert lines, f"probe {probe} printed nothing; stderr:\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="session")
def probe():
    """`probe(venv, script, *args) -> dict`: see `run_probe`."""
    return run_probe
