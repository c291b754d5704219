"""Implementations of the ops models call (`models.common.ops`), chosen once at start-up by device.

`select(attention=..., device=...)` registers what serves each op for the rest of the process
and returns a line for the start-up banner. The trainer calls it once, before building the
model; benchmarks and tests call it (or `use`, which undoes itself) to pin a path.

Attention backends (`[model] attn_backend`):
- `sdpa`: the torch reference, `F.scaled_dot_product_attention` (every device).
- `cpu_kernel`: the C++ kernel in `titan_kernels/cpu_attention` (CPU only; built on first use, ~20 s,
  then cached); inputs it does not handle (dtype, head_dim, segment ids) go to SDPA.
- `splash`: the Pallas splash-attention kernel in `titan_kernels/tpu` (TPU only; causal, GQA,
  document masking by segment ids; and with a full mask the op `attention`, FLUX's joint
  attention).
- `auto`: `cpu_kernel` on the CPU where it builds, `splash` on TPU where the Pallas kernels
  load, else `sdpa`.

The backend picks both attention ops: `causal_attention` and the full (bidirectional) `attention`
(FLUX), which on TPU is splash with a full mask and elsewhere SDPA (the CPU kernel is causal only).
On TPU the other ops (`grouped_mm` for MoE experts, `linear_cross_entropy`, Qwen 3.5's
`gated_delta_rule`) are served by their Pallas kernels (megablox gmm, the fused vocabulary-tiled
loss, the chunked delta rule's forward and backward kernels; the last checked and registered only
for a model with Gated DeltaNet) whenever those load, whatever the attention backend; elsewhere
their torch references serve them. `titan_kernels/tpu` (jax,
torch-tpu) is imported only when the device is a TPU. On TPU each selected kernel first runs a
self-check on tiny tensors against its torch reference at the widths the run calls it
(`KernelShapes`; `titan_kernels/tpu/selfcheck.py`), what is too large to run there compiled for
this generation without running (`titan_kernels/tpu/compile_check.py`), and with context
parallelism this rank's CP splash kernel too; one that fails is replaced by its reference for
the run, with one banner line saying why.

The low-precision linear (`quantized_linear`, `[quantize]`) is served per device by
`quantized_linear_for`: XLA's float8 / int8 dots on TPU (titan_kernels/tpu/qlinear.py),
`torch._scaled_mm` / `torch._int_mm` on CUDA (titan_kernels/cuda_quantize.py), the exact emulation
on the CPU (its reference). The MoE experts' `quantized_grouped_mm` by `quantized_grouped_mm_for`:
float8 / int8 ragged dots on TPU (titan_kernels/tpu/qgmm.py), the emulation elsewhere.
"""

from __future__ import annotations

import contextlib
import sys

import torch

from models.common import ops
from models.errors import ConfigError, check_choice
from titan_kernels.tpu.selfcheck import KernelShapes

ATTENTION_BACKENDS = ("auto", "sdpa", "cpu_kernel", "splash")
ATTENTION_DEVICES = {"cpu_kernel": "cpu", "splash": "tpu"}
"""The backends that serve one device type only; the step plan's RULES (trainer/step/plan.py)
refuse them on any other before anything is built."""
_ANY_DEVICE = ", ".join(b for b in ATTENTION_BACKENDS if b not in ATTENTION_DEVICES)
"""The backends that serve every device (what a host without a device's kernel falls back to)."""

_SAVED_OPS: set = set()


def check_attention_backend(backend: str) -> None:
    """ConfigError naming `model.attn_backend` unless `backend` is one of ATTENTION_BACKENDS."""
    check_choice("model.attn_backend", backend, ATTENTION_BACKENDS)


def attention_backends_for(device_type: str) -> tuple[str, ...]:
    """The `[model] attn_backend` values that can serve a `device_type` run."""
    return tuple(b for b in ATTENTION_BACKENDS if ATTENTION_DEVICES.get(b, device_type) == device_type)


def check_attention_for(attention: str, device_type: str) -> None:
    """ConfigError unless `attention` is a backend; a backend for another device is refused by
    the step plan's RULES (`model.attn_backend`) first, so here it is an internal check."""
    check_attention_backend(attention)
    assert attention in attention_backends_for(device_type), (
        f"attn_backend {attention} on {device_type}: the step plan's RULES refuse it first"
    )


def select(
    *,
    attention: str,
    device: torch.device,
    dtype: torch.dtype | None = None,
    head_dim: int | None = None,
    shapes: KernelShapes | None = None,
) -> str:
    """Register the implementation of every op for a run on `device`; describe the choice.

    ConfigError where the asked-for kernel cannot be built or loaded here (a backend for another
    device, `cpu_kernel` off the CPU or `splash` off TPU, is refused by the step plan's RULES
    before this runs, and asserted here); `auto` falls back to
    SDPA and says why. The ops without a backend setting (`grouped_mm`,
    `linear_cross_entropy`) get their TPU kernels on TPU and their references elsewhere.
    On TPU a kernel that fails its start-up self-check (titan_kernels/tpu/selfcheck.py) is replaced
    by its reference, also under an explicit `splash`, with one banner line on stderr.
    dtype, head_dim: the run's compute dtype and attention head dim, when known: on the CPU the
    kernel serves only some (dtype, head_dim) pairs (each call checks its inputs), and the
    returned line then says which backend this run's attention takes.
    shapes: the widths the run calls the kernels at (`KernelShapes.of(args, ...)`): on TPU the
    self-check runs (and compiles) each kernel there, and the CP splash kernel when `shapes.cp > 1`.
    """
    check_attention_for(attention, device.type)
    for op in ("attention", "sink_attention", "grouped_mm", "linear_cross_entropy", "gated_delta_rule"):
        ops.register(op, None)
    ops.register("quantized_linear", quantized_linear_for(device))
    ops.register("quantized_grouped_mm", quantized_grouped_mm_for(device))
    ops.register("quantized_batched_mm", quantized_batched_mm_for(device))
    if device.type == "tpu":
        return _select_tpu(attention, device=device, dtype=dtype or torch.bfloat16, head_dim=head_dim, shapes=shapes)
    if device.type != "cpu" or attention == "sdpa":
        ops.register("causal_attention", None)
        return "sdpa"
    from titan_kernels import cpu_attention

    if cpu_attention.load():
        _SAVED_OPS.update(cpu_attention.ops())
        ops.register("causal_attention", _cpu_kernel_or_sdpa)
        if dtype is not None and head_dim is not None:
            dt = str(dtype).removeprefix("torch.")
            served = "sdpa (the kernel does not serve it)"
            if cpu_attention.applies(dtype, head_dim):
                tiles = dtype == torch.bfloat16 and cpu_attention.uses_amx()
                served = "cpu kernel, AMX tiles" if tiles else "cpu kernel"
            return f"{attention} ({served} for {dt} at head_dim {head_dim})"
        return f"{attention} (cpu kernel loaded; sdpa where it does not apply)" if attention == "auto" else attention
    if attention == "cpu_kernel":
        raise ConfigError(
            f"model.attn_backend: cpu_kernel cannot be built here ({cpu_attention.load_error()}); allowed: {_ANY_DEVICE}"
        )
    ops.register("causal_attention", None)
    return f"sdpa (cpu kernel unavailable: {cpu_attention.load_error()})"


@contextlib.contextmanager
def use(*, attention: str, device: torch.device | str = "cpu"):
    """`select` for the duration of a `with` block (tests, benchmarks); yields the description."""
    saved = {op: ops.register(op, None) for op in ops.OPS + ops.LOW_PRECISION_OPS + ops.SEQUENCE_OPS}
    try:
        yield select(attention=attention, device=torch.device(device))
    finally:
        for op, fn in saved.items():
            ops.register(op, fn)


def _tpu_quantized(op: str, build: str):
    """`titan_kernels.tpu.qlinear.<build>()` when the Pallas stack (jax, torch-tpu) loads, else
    None (the emulation), with one line saying why where the build fails."""
    from titan_kernels import tpu

    if tpu.load() is None:
        return None
    try:
        from titan_kernels.tpu import qlinear

        return getattr(qlinear, build)()
    except Exception as exc:  # torch-tpu without jax_op, a recipe that does not export
        print(f"titan-tpu: {op} on TPU takes the emulation: {type(exc).__name__}: {exc}", file=sys.stderr)
        return None


def quantized_linear_for(device: torch.device):
    """The implementation of `quantized_linear` on `device` (None: the emulation, the reference):
    on TPU the XLA float8 / int8 dots when the Pallas stack (jax, torch-tpu) loads, on CUDA the
    tensor-core kernels; a recipe's device rules (trainer/step/plan.py) are checked before this."""
    if device.type == "cuda":
        from titan_kernels import cuda_quantize

        return cuda_quantize.quantized_linear
    if device.type == "tpu":
        return _tpu_quantized("quantized_linear", "build")
    return None


def quantized_grouped_mm_for(device: torch.device):
    """The implementation of `quantized_grouped_mm` on `device` (None: the emulation, the reference):
    on TPU the XLA float8 / int8 ragged dots when the Pallas stack (jax, torch-tpu) loads."""
    if device.type == "tpu":
        return _tpu_quantized("quantized_grouped_mm", "build_grouped")
    return None


def quantized_batched_mm_for(device: torch.device):
    """The implementation of `quantized_batched_mm` (the capacity layout's experts) on `device`
    (None: the emulation): on TPU the grouped op's ragged dots with every group the capacity."""
    if device.type == "tpu":
        return _tpu_quantized("quantized_batched_mm", "build_batched")
    return None


def saved_ops() -> set:
    """Op overloads of the kernels selected so far whose outputs selective activation
    checkpointing saves (like ATen's attention kernels): recomputing them costs as much as the
    forward did. Read on every op of a checkpointed forward, so it is a plain set."""
    return _SAVED_OPS


def _select_tpu(
    attention: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    head_dim: int | None,
    shapes: KernelShapes | None = None,
) -> str:
    """TPU: the Pallas kernels of titan_kernels/tpu serve every op they can (attention per `attention`)
    that passes its start-up self-check at the run's `shapes` (compiled there for this host's
    generation, titan_kernels/tpu/compile_check.py); the references serve the rest. With context
    parallelism this rank's CP splash kernel is checked too; if it fails, CP's local product is
    the dense-mask SDPA."""
    from titan_kernels import tpu
    from titan_kernels.tpu import selfcheck

    pallas = tpu.load()
    if pallas is None:
        if attention == "splash":
            raise ConfigError(
                f"model.attn_backend: splash cannot be loaded here ({tpu.load_error()}); allowed: {_ANY_DEVICE}"
            )
        ops.register("causal_attention", None)
        return f"sdpa (Pallas kernels unavailable: {tpu.load_error()})"
    selected = {
        op: fn
        for op, fn in pallas.items()
        if op not in ("causal_attention", "attention", "sink_attention") or attention != "sdpa"
    }
    if shapes is not None and not shapes.delta_heads:  # no Gated DeltaNet in the model: nothing to check
        selected.pop("gated_delta_rule", None)
    if shapes is not None and not shapes.sliding_window:  # no sink attention (gpt-oss, DeepSeek-V4) in the model
        selected.pop("sink_attention", None)
    tpu.refuse_cp(None)
    cp = tpu.cp_attention(shapes.cp_rank, shapes.cp) if shapes is not None and shapes.cp > 1 else None
    if cp is not None:  # parallelisms/context_parallel.py serves CP's local product with it on TPU
        selected["cp_attention"] = cp
    # A TPU attached here (torch-tpu's client owns the chips): the compile check makes no second
    # libtpu client (titan_kernels/tpu/__init__.py `compile_checker`).
    attached = getattr(device, "type", None) == "tpu"
    compile_check = tpu.compile_checker(shapes, attached=attached) if shapes is not None else None
    chunk = selfcheck.delta_chunk_verdict(shapes)  # a chunk the kernel does not run: the reference's
    if chunk is not None and selected.pop("gated_delta_rule", None) is None:
        chunk = None  # no delta-rule kernel loaded: nothing falls back
    passed, verdicts = selfcheck.run(
        selected, device=device, dtype=dtype, head_dim=head_dim, shapes=shapes, compile_check=compile_check
    )
    return _register_tpu(attention, passed, verdicts + ([chunk] if chunk else []), saved=tpu.saved_ops())


def _register_tpu(attention: str, passed: dict, verdicts: list, *, saved: list) -> str:
    """Register the kernels that passed their self-check (references for the rest), print one
    banner line per kernel that failed, describe the choice."""
    from titan_kernels.tpu import selfcheck

    for verdict in verdicts:
        if not verdict.ok:
            print(selfcheck.banner(verdict), file=sys.stderr, flush=True)
    _SAVED_OPS.update(saved)
    for op in ("grouped_mm", "linear_cross_entropy", "causal_attention", "attention", "sink_attention"):
        ops.register(op, passed.get(op))
    ops.register("gated_delta_rule", passed.get("gated_delta_rule"))
    from titan_kernels import tpu

    cp = next((v for v in verdicts if v.op == "cp_attention"), None)
    tpu.refuse_cp(None if cp is None or cp.ok else cp.reason)  # CP's local product: splash, or SDPA
    served = "splash" if "causal_attention" in passed else "sdpa"
    pallas = [
        name
        for op, name in (
            ("grouped_mm", "gmm for MoE experts"),
            ("linear_cross_entropy", "fused linear+cross-entropy"),
            ("attention", "full-mask splash"),
            ("sink_attention", "sink splash"),
            ("gated_delta_rule", "chunked gated delta rule"),
            ("cp_attention", "CP splash"),
        )
        if op in passed
    ]
    failed = [v.kernel for v in verdicts if not v.ok]
    note = f"Pallas: {', '.join(pallas)}" if pallas else "no Pallas kernel"
    if failed:
        note += f"; self-check failed: {', '.join(failed)} (references serve them)"
    elif verdicts:
        note += f"; self-check passed, worst error {max(v.worst for v in verdicts):.2%} of scale"
    # Also with `attn_backend = "splash"` asked for explicitly: a kernel that fails on this host
    # is not a bad config, and the run is more use on SDPA than stopped (the banner says why).
    return f"{served} ({note})"


def _cpu_kernel_or_sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, segment_ids: torch.Tensor | None = None
) -> torch.Tensor:
    from titan_kernels import cpu_attention

    if segment_ids is None and cpu_attention.supports(q, k, v):
        return cpu_attention.causal_attention(q, k, v)
    return ops.sdpa_causal_attention(q, k, v, segment_ids)
