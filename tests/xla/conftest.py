"""The XLA tier: checks of the XLA/TPU path that run in their own pinned venvs.

Tests here are collected by the main pytest run but import nothing of torchax, jax or torch-tpu:
each probe script (`tests/xla/probes/*.py`) runs in a subprocess under one of the venvs that
`scripts/xla_env.sh` makes (xla: torch + jax + torchax; tpuc: jax[tpu] for deviceless TPU
compiles; ttpu: torch-tpu), because torchax and torch-tpu change process globals. A probe prints
one JSON object on its last stdout line; `run_probe` returns it.

Each probe runs once per session and several tests read its result (session fixtures
`lowering`, `tpu_compiles`, `torch_tpu_path`). To keep the tier's wall time down on a small
machine, the first test of the tier starts making every venv the selected tests need in threads
(pip overlaps the probes) and starts the torch-tpu probe in the background as soon as its venv
is ready, beside the lowering probe.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBES = Path(__file__).resolve().parent / "probes"

# The graph steps lowered to StableHLO and run on XLA:CPU (family:flavor:mode:n_layers[:lower];
# `:lower` = lower and count loops only). All at the debug flavors' width with 2 layers; the
# 4-layer scan checks that the loop structure does not depend on n_layers.
LOWERING_VARIANTS = (
    "llama3:debugmodel:unrolled:2",
    "llama3:debugmodel:scan:2",
    "llama3:debugmodel:scan:4:lower",
    "qwen3:debugmodel:unrolled:2",
    "qwen3:debugmodel:scan:2",
    "qwen3:debugmodel_moe:unrolled:2",
)
# No MoE scan variant yet: the trainer accepts layer scan for MoE blocks since 2026-12-01, `95f2fb4` (their
# aux loss is a scan output; tests/unit/test_models_moe.py), but that step has not been lowered here.
# Deviceless XLA:TPU compiles: (exported variant, targets). The scanned Llama 3 step on all three
# targets (in one process), the other dense steps on v6e only (in a second process, beside the
# first; each compile takes 10-20 s here). The MoE step is
# not compiled for TPU: on CPU its experts take the dense fallback (every expert on every token),
# not the `_grouped_mm` path a TPU runs, so its TPU program would say nothing about the real one.
TPU_TARGETS = {"v5e": "v5e:2x2", "v6e": "v6e:2x2", "tpu7x": "tpu7x:2x2x1"}
TPU_COMPILES = (
    ("llama3:debugmodel:scan:2", ("v5e", "v6e", "tpu7x")),
    ("llama3:debugmodel:unrolled:2", ("v6e",)),
    ("qwen3:debugmodel:scan:2", ("v6e",)),
    ("qwen3:debugmodel:unrolled:2", ("v6e",)),
)
TORCH_TPU_VARIANTS = ("unrolled", "scan", "unrolled_unannotated")


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
        # libtpu takes /tmp/libtpu_lockfile to own the host's TPU; compile-only topologies use no
        # device, and two probes (or two test sessions) may load libtpu at the same time.
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
    )
    return env


_VENVS: dict[str, Path] = {}
_VENV_THREADS: dict[str, threading.Thread] = {}
_VENV_ERRORS: dict[str, str] = {}
_VENV_LOCK = threading.Lock()


def _make_venv(name: str) -> None:
    out = subprocess.run(["bash", str(ROOT / "scripts" / "xla_env.sh"), name], capture_output=True, text=True)
    if out.returncode != 0:
        _VENV_ERRORS[name] = f"scripts/xla_env.sh {name} exited {out.returncode}:\n{out.stderr[-4000:]}"
    else:
        _VENVS[name] = Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


def start_venv(name: str) -> None:
    """Start making venv `name` (xla | tpuc | ttpu) in a thread, once (pip downloads overlap)."""
    with _VENV_LOCK:
        if name not in _VENV_THREADS:
            _VENV_THREADS[name] = threading.Thread(target=_make_venv, args=(name,), daemon=True)
            _VENV_THREADS[name].start()


def xla_python(name: str) -> Path:
    """The python of venv `name`, made on first use by scripts/xla_env.sh (waits if in progress)."""
    start_venv(name)
    _VENV_THREADS[name].join()
    if name in _VENV_ERRORS:
        pytest.fail(_VENV_ERRORS[name], pytrace=False)
    return _VENVS[name]


class Probe:
    """A probe running in the background; `result()` waits for it and parses its JSON line."""

    def __init__(self, venv: str, probe: str, *args: str, timeout: float = 600):
        self.name = f"{probe} {' '.join(args)}"
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [str(xla_python(venv)), str(PROBES / probe), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_probe_env(),
            cwd=ROOT,
        )
        self._result = None

    def result(self) -> dict:
        if self._result is None:
            try:
                stdout, stderr = self.proc.communicate(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                stdout, stderr = self.proc.communicate()
                pytest.fail(f"probe {self.name} timed out after {self.timeout} s\n{stderr[-4000:]}", pytrace=False)
            if self.proc.returncode != 0:
                # rc 134 (SIGABRT) is what a stray TPU initialisation does on a host without a TPU.
                pytest.fail(
                    f"probe {self.name} exited {self.proc.returncode}\n--- stdout\n{stdout[-4000:]}"
                    f"\n--- stderr\n{stderr[-8000:]}",
                    pytrace=False,
                )
            lines = [ln for ln in stdout.splitlines() if ln.strip()]
            assert lines, f"probe {self.name} printed nothing; stderr:\n{stderr[-4000:]}"
            self._result = json.loads(lines[-1])
            # TITAN_XLA_RESULTS=DIR keeps every probe's JSON (the numbers docs/tpu.md quotes).
            if os.environ.get("TITAN_XLA_RESULTS"):
                folder = Path(os.environ["TITAN_XLA_RESULTS"])
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{Path(self.name.split()[0]).stem}.json").write_text(json.dumps(self._result, indent=1))
        return self._result


def run_probe(venv: str, probe: str, *args: str, timeout: float = 600) -> dict:
    """Run `tests/xla/probes/<probe>` with `args` in venv `venv`; the JSON of its last stdout line."""
    return Probe(venv, probe, *args, timeout=timeout).result()


@pytest.fixture(scope="session")
def probe():
    """`probe(venv, script, *args) -> dict`: see `run_probe`."""
    return run_probe


_STARTED: dict[str, Probe] = {}
_FIXTURE_VENVS = {"lowering": ("xla",), "tpu_compiles": ("xla", "tpuc"), "torch_tpu_path": ("ttpu",)}


@pytest.fixture(scope="session", autouse=True)
def _xla_tier_start(request):
    """Before the tier's first test: start making every venv the selected tests need (in
    threads, so pip overlaps the probes), and start the torch-tpu probe as soon as its venv is
    ready, beside the lowering probe (2 cores: one probe each)."""
    used = {
        f
        for item in request.session.items
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent)
        for f in getattr(item, "fixturenames", ())
        if f in _FIXTURE_VENVS
    }
    for venv in sorted({v for f in used for v in _FIXTURE_VENVS[f]}):
        start_venv(venv)
    if "torch_tpu_path" in used:

        def start():
            _VENV_THREADS["ttpu"].join()
            if "ttpu" in _VENVS:
                _STARTED["torch_tpu_path"] = Probe("ttpu", "torch_tpu_path.py", *TORCH_TPU_VARIANTS)

        _STARTER.append(threading.Thread(target=start, daemon=True))
        _STARTER[0].start()
    yield
    for t in _STARTER:
        t.join()
    for p in _STARTED.values():
        if p.proc.poll() is None:
            p.proc.kill()


_STARTER: list[threading.Thread] = []


def _lowering_variants(items) -> tuple[str, ...]:
    """The LOWERING_VARIANTS the selected tests read: every one when a TPU compile is selected
    (it compiles their exports), else the `variant` parameters, a `family` parameter's three
    variants, and all of them for any other reader. The default tier leaves out the variants
    whose tests are scheduled (tests/support/tiers.py) and saves their lowering."""
    need: set[str] = set()
    for item in items:
        names = getattr(item, "fixturenames", ())
        if "tpu_compiles" in names:
            return LOWERING_VARIANTS
        if "lowering" not in names:
            continue
        params = getattr(getattr(item, "callspec", None), "params", {})
        if "variant" in params:
            need.add(params["variant"])
        elif "family" in params:
            need.update(f"{params['family']}:{v}" for v in ("unrolled:2", "scan:2", "scan:4:lower"))
        else:
            return LOWERING_VARIANTS
    return tuple(v for v in LOWERING_VARIANTS if v in need)


@pytest.fixture(scope="session")
def lowering(request, tmp_path_factory) -> dict:
    """graph_step_xla.py over the selected tests' LOWERING_VARIANTS: {"versions", "variants":
    {variant: result}, "out_dir"}."""
    out = tmp_path_factory.mktemp("xla_exports")
    res = run_probe("xla", "graph_step_xla.py", str(out), *_lowering_variants(request.session.items))
    res["out_dir"] = str(out)
    return res


@pytest.fixture(scope="session")
def tpu_compiles(lowering) -> dict:
    """tpu_compile.py over TPU_COMPILES: {"versions", "devices", "compiles": {(variant, target): result}}."""
    jobs, keys = [], {}
    for variant, targets in TPU_COMPILES:
        export = lowering["variants"][variant].get("tpu_export")
        assert export, f"{variant} was not exported for TPU: {lowering['variants'][variant].get('error')}"
        jobs.append(f"{export}={','.join(TPU_TARGETS[t] for t in targets)}")
        keys.update({(variant, t): f"{os.path.basename(export)}@{TPU_TARGETS[t]}" for t in targets})
    # Two processes, half of the compiles each: the machine's second core is idle otherwise.
    halves = [Probe("tpuc", "tpu_compile.py", *jobs[:1]), Probe("tpuc", "tpu_compile.py", *jobs[1:])]
    results = [p.result() for p in halves]
    versions, devices, by_name = results[0]["versions"], {}, {}
    for res in results:
        devices.update(res["devices"])
        by_name.update(res["compiles"])
    compiles = {key: by_name[name] for key, name in keys.items()}
    return {"versions": versions, "devices": devices, "compiles": compiles}


@pytest.fixture(scope="session")
def torch_tpu_path() -> dict:
    """torch_tpu_path.py over TORCH_TPU_VARIANTS (started early by `_xla_tier_start`)."""
    for t in _STARTER:
        t.join()
    started = _STARTED.get("torch_tpu_path") or Probe("ttpu", "torch_tpu_path.py", *TORCH_TPU_VARIANTS)
    return started.result()
