"""The TPU install: pins that agree everywhere, env.sh's Python 3.11 venv and its refusals, and the
trainer's refusal of a TPU run without torch-tpu.

- constraints/tpu.txt, pyproject's `[tpu]` extra and the XLA tier's ttpu venv list
  (scripts/xla_env.sh) name the same versions (tests/xla/test_install_pins.py resolves the pins
  on PyPI and checks the built venv).
- `source scripts/env.sh tpu` runs with a PATH that holds only stand-ins (a python3 that is 3.12,
  uv, a venv's python) plus the shell tools it needs, so each branch is taken on purpose and
  nothing is installed: python3 not 3.11 and no uv or python3.11 -> one `error:` line, exit 2;
  uv present -> `uv venv --seed --python 3.11`; an existing venv on 3.12 -> refused; torch-tpu
  missing after the install -> refused, and the install went through the constraints file.
- `[device] type = "tpu"`, or `auto` on a host with TPU chips on its PCI bus, without torch-tpu:
  one `error:` line naming device.type and the install command, exit 2.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib
from pathlib import Path

import pytest

from models.errors import ConfigError
from trainer.runtime import device

ROOT = Path(__file__).resolve().parents[2]
CONSTRAINTS = ROOT / "constraints" / "tpu.txt"


def normalize(name: str) -> str:
    """PEP 503 name: `ml_dtypes` == `ml-dtypes`, `torch_tpu` == `torch-tpu`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a constraints file (comments and blank lines skipped)."""
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([A-Za-z0-9_.+]+)", line)
            assert m, f"{path}: not a name==version pin: {line!r}"
            pins[normalize(m.group(1))] = m.group(2)
    return pins


def _exact(requirements: list[str]) -> dict[str, str]:
    out = {}
    for r in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([A-Za-z0-9_.+]+)", r.strip())
        assert m, f"not an exact pin without a marker: {r!r}"
        out[normalize(m.group(1))] = m.group(2)
    return out


def test_tpu_pins_agree_across_constraints_extra_and_xla_tier():
    pins = read_pins(CONSTRAINTS)
    assert {"torch", "torch-tpu", "libtpu", "jax", "jaxlib"} <= set(pins)
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tpu"]
    # exact and without a python_version marker: on another Python pip refuses instead of
    # installing the extra without torch-tpu
    for name, version in _exact(extra).items():
        assert pins.get(name) == version, f"[tpu] extra pins {name}=={version}, constraints/tpu.txt {pins.get(name)}"
    ttpu = re.search(r"^\s*ttpu\) PKGS=\(([^)]*)\)", (ROOT / "scripts" / "xla_env.sh").read_text(), re.M)
    tier = {normalize(n): v for n, v in re.findall(r"([A-Za-z0-9_.-]+)==([0-9.]+)", ttpu.group(1))}
    assert {n: pins.get(n) for n in tier if n in pins} == {n: v for n, v in tier.items() if n in pins}
    assert {"torch", "torch-tpu", "jax", "jaxlib"} <= set(tier)


# --- scripts/env.sh tpu, with stand-in interpreters -------------------------------------------

TOOLS = ("bash", "sha1sum", "cut", "cat", "dirname", "touch", "rm", "mkdir", "env")


def _script(path: Path, body: str) -> None:
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run_env_sh(tmp_path: Path, venv: Path, stubs: dict[str, str]) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for tool in TOOLS:
        os.symlink(shutil.which(tool), bin_dir / tool)
    for name, body in stubs.items():
        _script(bin_dir / name, body)
    env = {"PATH": str(bin_dir), "HOME": str(tmp_path), "TITAN_VENV": str(venv), "LOG": str(tmp_path / "calls")}
    return subprocess.run(
        [shutil.which("bash"), "-c", f"source {ROOT}/scripts/env.sh tpu && echo sourced"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def _error_line(out: subprocess.CompletedProcess) -> str:
    """The one `error:` line; besides it env.sh prints only its "setting up ..." line."""
    lines = out.stderr.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and all(ln.startswith("setting up ") for ln in lines if ln not in errors), out.stderr
    return errors[0]


PY312 = 'case "$*" in *platform*) echo 3.12.3 ;; *) exit 1 ;; esac\n'  # not 3.11


def test_env_sh_tpu_without_python_311_is_one_error_line(tmp_path):
    out = _run_env_sh(tmp_path, tmp_path / "venv", {"python3": PY312})
    assert out.returncode == 2 and "sourced" not in out.stdout
    line = _error_line(out)
    assert "python3 is 3.12.3" in line and "uv venv --python 3.11" in line, line
    assert not (tmp_path / "venv").exists()


def test_env_sh_tpu_makes_the_venv_with_uv_when_python3_is_not_311(tmp_path):
    # the uv stand-in records its call and fails: that is one error line, and nothing after it runs
    out = _run_env_sh(
        tmp_path,
        tmp_path / "venv",
        {
            "python3": PY312,
            "uv": 'echo "uv $*" >> "$LOG"; exit 7\n',
            "python3.11": 'echo "python3.11 $*" >> "$LOG"; exit 1\n',
        },
    )
    assert out.returncode == 2 and _error_line(out).startswith("error: scripts/env.sh tpu: 'uv venv")
    assert (tmp_path / "calls").read_text().splitlines() == [
        f"uv venv --quiet --seed --python 3.11 {tmp_path / 'venv'}"
    ]


def test_env_sh_tpu_refuses_an_existing_venv_on_another_python(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _script(venv / "bin" / "python", PY312)
    out = _run_env_sh(tmp_path, venv, {})
    assert out.returncode == 2
    assert _error_line(out).startswith(f"error: scripts/env.sh tpu: {venv} is Python 3.12.3; allowed: Python 3.11")


def test_env_sh_tpu_refuses_when_torch_tpu_did_not_install(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # a 3.11 venv that has torch, whose pip "succeeds" without installing torch-tpu
    _script(
        venv / "bin" / "python",
        'case "$*" in -m\\ pip*) echo "pip ${*:3}" >> "$LOG" ;;\n  *torch_tpu*) exit 1 ;; esac\nexit 0\n',
    )
    out = _run_env_sh(tmp_path, venv, {})
    assert out.returncode == 2 and "sourced" not in out.stdout
    assert _error_line(out) == (
        f"error: scripts/env.sh tpu: torch-tpu did not install into {venv}; allowed: Linux "
        "x86_64 with Python 3.11 and the pins of constraints/tpu.txt (see pip's messages above)"
    )
    assert (tmp_path / "calls").read_text().splitlines() == [f"pip install -q -c {CONSTRAINTS} -e {ROOT}[tpu]"]
    assert not list(venv.glob(".titan-installed-*"))  # not stamped: the next source tries again


# --- the trainer's refusal ----------------------------------------------------------------------


def test_pick_device_refuses_tpu_without_torch_tpu(monkeypatch):
    monkeypatch.setattr(device, "torch_tpu_installed", lambda: False)
    with pytest.raises(
        ConfigError,
        match=r"^device\.type: tpu requested, but torch-tpu is not installed .*"
        r"source scripts/env\.sh tpu",
    ):
        device.pick_device("tpu")
    monkeypatch.setattr(device, "tpu_chips_on_pci", lambda: 4)
    with pytest.raises(ConfigError, match=r"^device\.type: auto found 4 TPU chip\(s\) on this host, but torch-tpu"):
        device.pick_device("auto")
    assert device.pick_device("cpu").type == "cpu"  # an explicit CPU run on a TPU host stays allowed
    monkeypatch.setattr(device, "tpu_chips_on_pci", lambda: 0)
    assert device.pick_device("auto").type == "cpu"  # this machine: no TPU, no CUDA


def test_train_cli_tpu_without_torch_tpu_is_one_error_line():
    if device.torch_tpu_installed():
        pytest.skip("torch-tpu is installed in this venv")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "trainer.train", "--config", "configs/llama3_debug.toml", "--device.type=tpu"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [out.stderr.strip()] and out.stderr.startswith(
        "error: device.type: tpu requested, but torch-tpu is not installed"
    )


def _venv_distributions() -> dict:
    """Normalized name -> the distribution installed in this venv's site-packages. Only there:
    setuptools vendors older importlib_metadata, zipp, packaging and tomli with their dist-info,
    which `importlib.metadata.distributions()` also lists once something put setuptools/_vendor on
    sys.path (cpp_extension imports setuptools): those are not the venv's packages."""
    import importlib.metadata
    import site

    out = {}
    for dist in importlib.metadata.distributions(path=site.getsitepackages()):
        out.setdefault(normalize(dist.metadata["Name"]), dist)
    return out


def _requirement_closure(dists: dict, root: str, extras: tuple[str, ...]) -> set[str]:
    """Normalized names of `root` (with `extras`) and everything it requires, transitively, as
    installed in `dists` (`_venv_distributions()`): each distribution's `Requires-Dist` whose marker holds on this interpreter
    (for `root` with its extras, for the others with none). Absent distributions end a branch."""
    from packaging.requirements import Requirement

    seen, todo = set(), [(root, extras)]
    while todo:
        name, wanted = todo.pop()
        if normalize(name) in seen or normalize(name) not in dists:
            continue
        requires = dists[normalize(name)].requires or []
        seen.add(normalize(name))
        for line in requires:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                todo.append((req.name, tuple(req.extras)))
    return seen


def test_dev_lock_covers_the_test_extras_and_is_what_this_venv_holds():
    """constraints/dev.txt is the .venv's lock (scripts/env.sh installs under it): it pins every
    package of the [dev] extra exactly (an upstream release cannot change what CI runs: transformers
    5.25.0's new `kernels` dependency broke CI once), and every package pip resolved for
    titan-tpu[dev] (its requirement closure, markers evaluated here) is at the locked version.
    Packages outside that closure (e.g. put in the venv by another install) are not pip's to pin.
    torch is pinned by env.sh itself, not here."""
    lock = read_pins(ROOT / "constraints" / "dev.txt")
    assert "torch" not in lock
    dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
    for requirement in dev:
        name = normalize(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0))
        assert name in lock, f"[dev] extra {name!r} is not pinned in constraints/dev.txt"
    if not list(Path(sys.prefix).glob(".titan-installed-*")):
        pytest.skip("not running in a venv made by scripts/env.sh (no .titan-installed-* stamp)")
    dists = _venv_distributions()
    closure = _requirement_closure(dists, "titan-tpu", ("dev",))
    assert {"transformers", "kernels", "diffusers", "datasets", "tiktoken"} <= closure, sorted(closure)
    installed = {name: dist.version for name, dist in dists.items()}
    off = {n: (v, installed[n]) for n, v in lock.items() if n in closure and n in installed and installed[n] != v}
    assert not off, f"installed versions differ from constraints/dev.txt (lock, installed): {off}"
