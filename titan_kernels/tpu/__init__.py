"""Pallas kernels for TPU, served to the model's ops through torch-tpu's `jax_op`.

- `splash.py`, `gmm.py`, `fused_ce.py`: pure JAX/Pallas (no torch), runnable in Pallas'
  interpreter on the CPU (tests/xla) and compilable for TPU without one.
- `tiles.py`: block sizes per TPU generation (VMEM, MXU) from the table `tiles.toml`, which
  `scripts/bench/sweep_kernel_tiles.py` writes; pure Python.
- `register.py`: wraps them as torch ops (`titan_tpu::*`) with autograd; imports torch-tpu and
  jax, so only `load()` below imports it, and `titan_kernels.select` calls `load()` only when the run's
  device is a TPU. Nothing in this file imports jax.
- `selfcheck.py`: the start-up check of each selected kernel against its torch reference
  (torch only), at the run's widths; `titan_kernels.select` runs it after `load()`.
- `compile_check.py`: compiles (never runs) a kernel at the run's shapes for this host's
  generation's compile-only device; the self-check's check of what is too large to run.

JAX's platform. torch-tpu owns the chips of this process; the kernels only need JAX to trace,
lower and export them (`jax_op` runs `jax.export(platforms=["tpu"])`, which needs no device).
A JAX that initialised its own TPU backend here would be a second PJRT client on chips
torch-tpu holds (tpu_first_contact R4). So `load()` sets `JAX_PLATFORMS=cpu` before jax is
first imported, the configuration every XLA-tier probe runs. A user who set `JAX_PLATFORMS`
explicitly keeps it (an escape hatch for experiments), with one warning line naming the risk;
if jax was imported earlier and has not started a backend yet, its config is pinned the same
way; if it already started one, the warning says so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

_state: dict[str, object] = {}

JAX_PLATFORM = "cpu"
"""The platform JAX runs on inside a torch-tpu process (module docstring)."""


def pin_jax_platform() -> str | None:
    """Keep JAX off the TPU in this process (module docstring); a warning line, or None."""
    user = os.environ.get("JAX_PLATFORMS")
    if user and user != JAX_PLATFORM:  # JAX reads an empty value as unset, so do we
        return (
            f"titan-tpu: JAX_PLATFORMS={user!r} is set; the Pallas kernels need JAX only to lower "
            f"(JAX_PLATFORMS={JAX_PLATFORM} is what was tested): a JAX TPU backend in this process "
            "competes with torch-tpu for the chips and may fail or hang at the first kernel call"
        )
    os.environ["JAX_PLATFORMS"] = JAX_PLATFORM
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    from jax._src import xla_bridge  # jax is already imported: this loads nothing new

    if xla_bridge.backends_are_initialized():
        platforms = sorted({d.platform for d in jax.devices()})
        if platforms != [JAX_PLATFORM]:
            return (
                f"titan-tpu: jax was imported and started its {', '.join(platforms)} backend before the "
                "Pallas kernels loaded; it may compete with torch-tpu for the chips"
            )
        return None
    jax.config.update("jax_platforms", JAX_PLATFORM)
    return None


def load() -> dict[str, Callable] | None:
    """The torch implementations {op name: fn} of the TPU kernels, or None (see `load_error`).

    Pins JAX's platform (module docstring), imports jax and registers the torch-tpu ops on the
    first call; TPU runs only.
    """
    if "ops" not in _state and "error" not in _state:
        warning = pin_jax_platform()
        if warning:
            print(warning, file=sys.stderr, flush=True)
        try:
            from titan_kernels.tpu import register

            _state["ops"] = register.build()
        except Exception as exc:  # jax missing, torch-tpu without jax_op: the references serve
            _state["error"] = f"{type(exc).__name__}: {exc}"
    return _state.get("ops")  # type: ignore[return-value]


def cp_attention(cp_rank: int, cp_size: int) -> Callable | None:
    """Context parallelism's local attention on TPU: `fn(q, k_all, v_all, segment_ids=None,
    segment_ids_all=None)` with splash (register.build_cp), or None where `load()` found no TPU
    kernels or the start-up self-check refused the CP kernel (`refuse_cp`; the caller's dense-mask
    SDPA serves)."""
    if load() is None or _state.get("cp_refused"):
        return None
    from titan_kernels.tpu import register

    return register.build_cp(cp_rank, cp_size)


def compile_checker(shapes, *, attached: bool = True) -> Callable:
    """`fn(op) -> None | (ok, note)`: the kernel of `op` compiled, not run, at the run's `shapes`
    for this host's TPU generation (titan_kernels/tpu/compile_check.py); after `load()`.

    `attached`: a TPU device is attached to this process (the training process: torch-tpu's PJRT
    client owns the chips). Then no compile-only device is made here: that is a second libtpu
    client in the process, which libtpu's lockfile or a CHECK abort could end on every rank
    (docs/tpu.md). The tile rule's VMEM arithmetic decides instead, and step 1's compile is the
    real test; the references still serve an op whose kernel the rule refuses."""
    from titan_kernels.tpu import compile_check as compiles
    from titan_kernels.tpu import register

    generation = register.device_generation()
    return lambda op: compiles.compile_kernel(op, shapes, generation, attached=attached)


def refuse_cp(reason: str | None) -> None:
    """Record the self-check's verdict on the CP splash kernel: `reason` (it failed) makes
    `cp_attention` answer None for the rest of the process; None clears it."""
    _state["cp_refused"] = reason


def load_error() -> str | None:
    """Why `load()` returned None, else None."""
    error = _state.get("error")
    return str(error) if error else None


def saved_ops() -> list:
    """Op overloads whose outputs selective activation checkpointing saves (attention and the
    grouped matmuls, like their ATen counterparts); empty until `load()` succeeded."""
    if "ops" not in _state:
        return []
    from titan_kernels.tpu import register

    return register.saved_ops()
