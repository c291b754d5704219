"""trainer/runtime/tpu_env.py against the TPU runtime torch-tpu 0.2.0 installs (ttpu venv), no TPU.

- Every flag of assets/tpu_flags.toml is a name libtpu 0.0.52 knows (read from libtpu.so; libtpu
  stops the process on an unknown flag) and a made-up one is not (the check can fail).
- When the variables are read: a getenv recorder (LD_PRELOAD) in a process that autoloads
  torch-tpu, registers the TPU device as a TPU host's autoload does, then makes its first tensor
  on it. LIBTPU_INIT_ARGS and XLA_FLAGS are read at that first device request and not before
  (not at `import torch`, not at device registration), so `build_job` setting them after
  picking the device and before the process group is in time. On this host libtpu then fails
  (no TPU); the test reads what happened before.
- The profiler config, the cache-miss counter and the compilation count with the real `torch.tpu`
  (probe tpu_env_ttpu.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.xla.conftest import ROOT, _probe_env, xla_python
from trainer.runtime.tpu_env import BUNDLES, flag_name, known_flag_names

pytestmark = pytest.mark.xla


def _site_packages() -> Path:
    python = xla_python("ttpu")
    found = list(python.parent.parent.glob("lib/python3.*/site-packages"))
    assert found, python
    return found[0]


def test_flag_bundles_are_known_to_the_runtime_libtpu():
    lib = _site_packages() / "libtpu" / "libtpu.so"
    names = {flag_name(f) for b in BUNDLES.values() for f in (*b.libtpu_init_args, *b.xla_flags)}
    known = known_flag_names(names | {"xla_tpu_scoped_vmem_limit_kb", "titan_made_up_flag"}, [lib])
    assert names <= known, sorted(names - known)
    assert not known & {"xla_tpu_scoped_vmem_limit_kb", "titan_made_up_flag"}, known


_GETENV_RECORDER = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>
static char *(*real_getenv)(const char *) = 0;
char *getenv(const char *name) {
  if (!real_getenv) real_getenv = (char *(*)(const char *))dlsym(RTLD_NEXT, "getenv");
  if (name && (!strcmp(name, "LIBTPU_INIT_ARGS") || !strcmp(name, "XLA_FLAGS") || strstr(name, "COMPILATION_CACHE"))) {
    char buf[200];
    int k = snprintf(buf, sizeof buf, "[getenv] %s\n", name);
    write(2, buf, k);
  }
  return real_getenv(name);
}
"""

_SCRIPT = """
import sys
def mark(what):
    print(f"[mark] {what}", file=sys.stderr, flush=True)
mark("import torch")
import torch
mark("init device")
import torch_tpu._loader as loader
loader._init_device("tpu")
mark("first tensor")
torch.ones(2, device="tpu")
mark("after first tensor")
"""


def test_libtpu_reads_its_flags_at_the_first_device_request(tmp_path):
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc to build the getenv recorder")
    python = xla_python("ttpu")
    shim = tmp_path / "getenv_recorder.so"
    (tmp_path / "rec.c").write_text(_GETENV_RECORDER)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(shim), str(tmp_path / "rec.c"), "-ldl"], check=True)
    env = _probe_env()
    env.pop("TORCH_DEVICE_BACKEND_AUTOLOAD")  # autoload on, as on a TPU host
    env.update(
        LD_PRELOAD=str(shim),
        LIBTPU_INIT_ARGS="--xla_tpu_scoped_vmem_limit_kib=65536",
        TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT=str(tmp_path / "cc"),
    )
    env.pop("XLA_FLAGS")
    proc = subprocess.run([str(python), "-c", _SCRIPT], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    events = [line for line in proc.stderr.splitlines() if line.startswith(("[mark]", "[getenv]"))]
    marks = [e for e in events if e.startswith("[mark]")]
    assert marks[:3] == ["[mark] import torch", "[mark] init device", "[mark] first tensor"], proc.stderr[-3000:]
    first_tensor = events.index("[mark] first tensor")
    before, after = events[:first_tensor], events[first_tensor:]
    assert not [e for e in before if e.startswith("[getenv]")], before
    assert "[getenv] LIBTPU_INIT_ARGS" in after and "[getenv] XLA_FLAGS" in after, (after, proc.stderr[-3000:])
    # Without a TPU the runtime does not start (so the compilation cache, which reads its own
    # variables, never exists here): the process fails after the reads.
    assert "[mark] after first tensor" not in events and proc.returncode != 0, (proc.returncode, events)


def test_profiler_config_and_cache_counter_with_real_torch_tpu(probe):
    res = probe("ttpu", "tpu_env_ttpu.py", timeout=600)
    assert "profiler_error" not in res, res
    assert res["config_type"] == "torch_tpu._internal.profiler.profiler_config.TpuProfilerConfig", res
    assert res["config_is_experimental_config"] and res["profile_constructed"], res
    assert res["activities"] == ["CPU", "PrivateUse1"] and res["chrome_trace"] is False, res
    assert res["cache_misses_getter"], res
    assert res["cache_misses_without_device"] in (0, None), res
    assert res["compilations_without_device"] == 0, res  # torch-tpu's PerfStats.num_compilations, read
