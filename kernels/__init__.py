"""Implementations of the ops models call (`models.common.ops`), chosen once at start-up by device.

`select(attention=..., device=...)` registers what serves each op for the rest of the process
and returns a line for the start-up banner. The trainer calls it once, before building the
model; benchmarks and tests call it (or `use`, which undoes itself) to pin a path.

Attention backends (`[model] attn_backend`):
- `sdpa`: the torch reference, `F.scaled_dot_product_attention` (every device).
- `cpu_kernel`: the C++ kernel in `kernels/cpu_attention` (CPU only; built on first use, ~20 s,
  then cached); inputs it does not handle (dtype, head_dim) go to SDPA.
- `auto`: `cpu_kernel` on the CPU where it builds, else `sdpa`.
"""

from __future__ import annotations

import contextlib

import torch

from models.common import ops
from models.errors import ConfigError

ATTENTION_BACKENDS = ("auto", "sdpa", "cpu_kernel")

_SAVED_OPS: set = set()


def check_attention_backend(backend: str) -> None:
    """ConfigError naming `model.attn_backend` unless `backend` is one of ATTENTION_BACKENDS."""
    if backend not in ATTENTION_BACKENDS:
        raise ConfigError(f"model.attn_backend: {backend!r} is not supported; "
                          f"allowed: {', '.join(ATTENTION_BACKENDS)}")


def select(*, attention: str, device: torch.device) -> str:
    """Register the implementation of every op for a run on `device`; describe the choice.

    ConfigError where the asked-for backend cannot serve this device (`cpu_kernel` off the CPU,
    or a CPU kernel that cannot be built here); `auto` falls back to SDPA and says why.
    """
    check_attention_backend(attention)
    if attention == "cpu_kernel" and device.type != "cpu":
        raise ConfigError(f"model.attn_backend: cpu_kernel runs on the CPU only, not on {device.type}; "
                          "allowed here: auto, sdpa")
    if device.type != "cpu" or attention == "sdpa":
        ops.register("causal_attention", None)
        return "sdpa"
    from kernels import cpu_attention

    if cpu_attention.load():
        _SAVED_OPS.update(cpu_attention.ops())
        ops.register("causal_attention", _cpu_kernel_or_sdpa)
        return f"{attention} (cpu kernel loaded; sdpa where it does not apply)" if attention == "auto" else attention
    if attention == "cpu_kernel":
        raise ConfigError(f"model.attn_backend: cpu_kernel cannot be built here ({cpu_attention.load_error()}); "
                          "allowed: auto, sdpa")
    ops.register("causal_attention", None)
    return f"sdpa (cpu kernel unavailable: {cpu_attention.load_error()})"


@contextlib.contextmanager
def use(*, attention: str, device: torch.device | str = "cpu"):
    """`select` for the duration of a `with` block (tests, benchmarks); yields the description."""
    saved = {op: ops.register(op, None) for op in ops.OPS}
    try:
        yield select(attention=attention, device=torch.device(device))
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)


def saved_ops() -> set:
    """Op overloads of the kernels selected so far whose outputs selective activation
    checkpointing saves (like ATen's attention kernels): recomputing them costs as much as the
    forward did. Read on every op of a checkpointed forward, so it is a plain set."""
    return _SAVED_OPS


def _cpu_kernel_or_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from kernels import cpu_attention

    if cpu_attention.supports(q, k):
        return cpu_attention.causal_attention(q, k, v)
    return ops.sdpa_causal_attention(q, k, v)
