"""Pallas kernels for TPU, served to the model's ops through torch-tpu's `jax_op`.

- `splash.py`, `gmm.py`, `fused_ce.py`: pure JAX/Pallas (no torch), runnable in Pallas'
  interpreter on the CPU (tests/xla) and compilable for TPU without one.
- `register.py`: wraps them as torch ops (`titan_tpu::*`) with autograd; imports torch-tpu and
  jax, so only `load()` below imports it, and `kernels.select` calls `load()` only when the run's
  device is a TPU. Nothing in this file imports jax.
"""

from __future__ import annotations

from collections.abc import Callable

_state: dict[str, object] = {}


def load() -> dict[str, Callable] | None:
    """The torch implementations {op name: fn} of the TPU kernels, or None (see `load_error`).

    Imports jax and registers the torch-tpu ops on the first call; TPU runs only.
    """
    if "ops" not in _state and "error" not in _state:
        try:
            from kernels.tpu import register

            _state["ops"] = register.build()
        except Exception as exc:  # jax missing, torch-tpu without jax_op: the references serve
            _state["error"] = f"{type(exc).__name__}: {exc}"
    return _state.get("ops")  # type: ignore[return-value]


def load_error() -> str | None:
    """Why `load()` returned None, else None."""
    error = _state.get("error")
    return str(error) if error else None


def saved_ops() -> list:
    """Op overloads whose outputs selective activation checkpointing saves (attention and the
    grouped matmuls, like their ATen counterparts); empty until `load()` succeeded."""
    if "ops" not in _state:
        return []
    from kernels.tpu import register

    return register.saved_ops()
