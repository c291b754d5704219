"""The environment of a process that compiles for a TPU without a TPU (one place for every entry point).

`scripts/estimate_xla.py`, `tools/tpu_compile.py` (`scripts/check_recipe.py --compile`) and
`scripts/mfu_suite.py --project` (through those two) start a worker in the XLA tier's `ttpu` venv
that loads libtpu only to compile for a compile-only topology (`jax.experimental.topologies`).
`deviceless_env` is the environment every one of them hands that worker:

- `JAX_PLATFORMS=cpu`, `TORCH_DEVICE_BACKEND_AUTOLOAD=0`: no TPU client, torch-tpu not loaded.
- `ALLOW_MULTIPLE_LIBTPU_LOAD=1`: compile-only, so libtpu's one-process-per-host lock is not needed
  (two compiles, or a compile beside a test, may run at once).
- `TPU_SKIP_MDS_QUERY=1`: libtpu does not ask the GCE metadata server (absent off Google Cloud).
- This host as a one-host slice of the target's generation: `TPU_WORKER_HOSTNAMES=localhost`,
  `TPU_WORKER_ID=0`, `TPU_ACCELERATOR_TYPE=<generation>-8` (`v5litepod-8` for v5e). Without
  them libtpu 0.0.52's start-up, having skipped the metadata query, takes its own warning text as
  the value (it logs "Failed to find host bounds for accelerator type: WARNING: could not
  determine TPU accelerator type ..." and "unexpected worker hostname 'WARNING: could not determine
  TPU worker hostnames or IP addresses' from env var TPU_WORKER_HOSTNAMES"): an error line in every
  deviceless compile's output, which a failed worker's stderr tail then shows as if it were the
  failure. The compile-only topology, not these, says what is compiled for (the same program and
  memory analysis with and without them: tests/unit/test_deviceless_env.py's note).
- The host's own TPU launch variables are dropped (`TPU_*` worker lists, `MEGASCALE_*`,
  `CLOUD_TPU_TASK_ID`, ...): on a TPU VM or a GKE pod they describe the real slice, and a
  compile-only libtpu must not try to join it.
- `PYTHONPATH` is the checkout; the caller's `PYTHON*` and `VIRTUAL_ENV` are dropped (the worker
  is the ttpu venv's interpreter); `OMP_NUM_THREADS` defaults to 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOST_ACCELERATOR = {
    "v4": "v4-8",
    "v5e": "v5litepod-8",
    "v5litepod": "v5litepod-8",
    "v5p": "v5p-8",
    "v6e": "v6e-8",
    "tpu7x": "tpu7x-8",
    "v7x": "tpu7x-8",
}
"""A one-host accelerator type of each generation (jax topology prefix or planner name)."""

DROPPED_PREFIXES = ("PYTHON", "VIRTUAL_ENV", "TPU_", "MEGASCALE_", "CLOUD_TPU_", "TORCH_TPU_")
"""Inherited variables the worker never gets: the caller's interpreter and any real slice's launch."""

KEEP = frozenset({"TPU_LIBRARY_PATH"})
"""Inherited `TPU_*` variables that say nothing about a slice (which libtpu to load)."""


def deviceless_env(
    topology: str | None = None, *, base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The worker's environment (module docstring) for a compile for `topology` (jax's name,
    `v6e:16x16`, `tpu7x:4x8x8[,slices=2]`; None: v6e's host type). `base`: the environment to
    start from (default: this process's); `extra`: more variables, applied last (e.g. `XLA_FLAGS`)."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if k in KEEP or not k.startswith(DROPPED_PREFIXES)}
    generation = (topology or "v6e").split(":", 1)[0].split(",", 1)[0]
    env.update(
        PYTHONPATH=str(ROOT),
        TORCH_DEVICE_BACKEND_AUTOLOAD="0",
        JAX_PLATFORMS="cpu",
        OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", "1"),
        ALLOW_MULTIPLE_LIBTPU_LOAD="1",
        TPU_SKIP_MDS_QUERY="1",
        TPU_WORKER_HOSTNAMES="localhost",
        TPU_WORKER_ID="0",
        TPU_ACCELERATOR_TYPE=HOST_ACCELERATOR.get(generation, "v6e-8"),
    )
    env.update(extra or {})
    return env


def with_xla_flags(flags: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """`{"XLA_FLAGS": ...}`: `flags` after the caller's own `XLA_FLAGS` (the `extra` of a worker that
    dumps its HLO: scripts/mfu_suite.py --project)."""
    base = os.environ if base is None else base
    return {"XLA_FLAGS": f"{base.get('XLA_FLAGS', '')} {flags}".strip()}
