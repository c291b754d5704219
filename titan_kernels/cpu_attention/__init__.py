"""Causal attention for small head dims on the CPU: a C++ kernel (`attention.cpp`) built on first use.

Why it exists: with head_dim 16 (the Llama 3 debug model), ATen's CPU flash attention spends most
of its time outside its GEMMs and takes two thirds of a training step. This kernel keeps a tile
of 8 query rows x 16 keys in registers, runs both products of each score with AVX512-BF16 dot
products when the inputs are bf16 (fp32 FMAs otherwise), and recomputes P from the saved
log-sum-exp in the backward. docs/attention.md has the measurements and the selection rule.

`load()` reads the CPU's vector ISA from /proc/cpuinfo, compiles the kernel for it with
`torch.utils.cpp_extension` (cached under TORCH_EXTENSIONS_DIR, ~20 s the first time) and registers it as the ops
`torch.ops.titan_cpu.attn_fwd` / `attn_bwd`, with a fake implementation (so torch.compile and
the graph trainer trace it) and autograd. It returns False, with the reason in `load_error()`,
where the kernel cannot be built (no compiler, no AVX2) so that callers fall back to SDPA.
"""

import contextlib
import hashlib
import os
import re
import shutil
import sys
import threading
from pathlib import Path

import torch
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["causal_attention", "load", "load_error", "loaded", "supports", "uses_amx"]

_SOURCE = Path(__file__).with_name("attention.cpp")
_VECTORS_PER_HEAD = (1, 2, 4, 8)  # head_dim / lanes values the kernel instantiates
_FP32_MAX_HEAD_DIM = 32  # beyond this ATen's fp32 flash kernel is as fast or faster (docs/attention.md)
_AMX_MAX_HEAD_DIM = 64  # with AMX, ATen's bf16 flash kernel (also on AMX tiles) wins beyond this (docs/attention.md)
_state: dict[str, object] = {}  # "ok": bool once load() ran; "error": why it failed
_LOAD_LOCK = threading.Lock()


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    match = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(match.group(1).split()) if match else set()


def _detect_isa() -> tuple[str, list[str], int, bool] | None:
    """(name, compiler flags, fp32 lanes, has bf16 dot products) for this CPU, or None if unsupported."""
    flags = _cpu_flags()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        cflags = [
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512dq",
            "-mfma",
            "-mavx2",
            "-mf16c",
            "-DCPU_CAPABILITY=AVX512",
            "-DCPU_CAPABILITY_AVX512",
        ]
        if "avx512_bf16" in flags:
            return "avx512bf16", cflags + ["-mavx512bf16"], 16, True
        return "avx512", cflags, 16, False
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2", ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"], 8, False
    return None


_ISA: tuple[str, list[str], int, bool] | None = None
"""What `_detect_isa` found, set by `load()`: `supports` runs inside torch.compile traces, which
cannot read files, so it reads this instead."""


def load() -> bool:
    """Build (or reuse the cached build of) the kernel and register its ops; False if it cannot.

    Thread-safe: thread-rank process groups (tests) reach the first call from several threads.
    """
    if "ok" not in _state:
        with _LOAD_LOCK:
            if "ok" not in _state:
                _state["ok"] = _load()
    return bool(_state["ok"])


def _load() -> bool:
    global _ISA
    isa = _ISA = _detect_isa()
    if isa is None:
        _state["error"] = "this CPU has neither AVX-512 nor AVX2+FMA"
        return False
    name, cflags, _, _ = isa
    # The source, the flags and the torch install in the name: a build folder is never shared by
    # two venvs (cpp_extension rebuilds whenever build.ninja's include paths change, so two venvs
    # taking turns would rebuild each other's kernel), nor by two versions of the source.
    key = _SOURCE.read_bytes() + " ".join(cflags).encode() + str(Path(torch.__file__).parent).encode()
    ext_name = f"titan_cpu_attention_{name}_{hashlib.sha1(key).hexdigest()[:8]}"
    try:
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.cpp_extension import load as build

        build_dir = Path(_get_build_directory(ext_name, verbose=False))
        with _build_lock(build_dir), _ninja_on_path():
            build(
                name=ext_name,
                sources=[str(_SOURCE)],
                extra_cflags=["-O3", "-fopenmp", *cflags],
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a broken toolchain: fall back to SDPA
        lines = str(exc).strip().splitlines()
        _state["error"] = f"building {_SOURCE.name} failed: {type(exc).__name__}: {lines[-1] if lines else ''}"
        return False
    _register()
    # Whether bf16 calls take the AMX path, read once (`applies` runs inside traces).
    _state["amx"] = bool(torch.ops.titan_cpu.uses_amx())
    return True


@contextlib.contextmanager
def _build_lock(build_dir: Path):
    """Hold an exclusive `flock` on `<build_dir>.flock` for the build. The kernel drops it when its
    holder dies, so a build killed mid-way blocks nobody; and since every build runs under it, a
    torch FileBaton `lock` file found while we hold it was left by a killed build (torch would
    wait on it forever) and is removed."""
    import fcntl

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_name(build_dir.name + ".flock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            baton = build_dir / "lock"
            if baton.exists():
                print(f"titan-tpu: removing a build lock left by a killed build: {baton}", file=sys.stderr)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def _ninja_on_path():
    """cpp_extension runs `ninja` from PATH; a venv used without activation has it only in its
    bin. Put it on PATH for the build only, and restore PATH after."""
    saved = os.environ.get("PATH", "")
    try:
        import ninja
    except ImportError:
        ninja = None
    if ninja is not None and not shutil.which("ninja"):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def loaded() -> bool:
    """Whether `load()` has run and succeeded (never builds)."""
    return bool(_state.get("ok", False))


def uses_amx() -> bool:
    """Whether bf16 calls run the kernel's AMX path (block GEMMs through ATen's brgemm on AMX
    tiles): the CPU has AMX, oneDNN can use it, and TITAN_CPU_ATTN_AMX is not "0". False until
    `load()` has succeeded."""
    return loaded() and bool(_state.get("amx", False)) and bool(torch.ops.titan_cpu.uses_amx())


def load_error() -> str | None:
    """Why `load()` returned False, else None."""
    error = _state.get("error")
    return str(error) if error else None


def _register() -> None:
    @torch.library.register_fake("titan_cpu::attn_fwd")
    def _fwd_fake(q, k, v, scale):
        b, h, s, d = q.shape
        return q.new_empty(b, s, h, d).transpose(1, 2), q.new_empty(b, h, s, dtype=torch.float32)

    @torch.library.register_fake("titan_cpu::attn_bwd")
    def _bwd_fake(dout, q, k, v, out, lse, scale):
        b, h, s, d = q.shape
        kv_heads = k.shape[1]
        return (
            q.new_empty(b, s, h, d).transpose(1, 2),
            q.new_empty(b, s, kv_heads, d).transpose(1, 2),
            q.new_empty(b, s, kv_heads, d).transpose(1, 2),
        )

    def setup_context(ctx, inputs, output):
        q, k, v, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale

    def backward(ctx, dout, dlse):
        del dlse  # lse is an auxiliary output; nothing differentiates through it
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = torch.ops.titan_cpu.attn_bwd(dout, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None

    torch.library.register_autograd("titan_cpu::attn_fwd", backward, setup_context=setup_context)

    # FlopCounterMode (tests, benchmarks) counts the kernel like SDPA, GQA included.
    @register_flop_formula(torch.ops.titan_cpu.attn_fwd)
    def _fwd_flops(q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q_shape, k_shape, v_shape)

    @register_flop_formula(torch.ops.titan_cpu.attn_bwd)
    def _bwd_flops(dout_shape, q_shape, k_shape, v_shape, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(dout_shape, q_shape, k_shape, v_shape)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None = None) -> bool:
    """Whether the kernel handles these inputs and beats ATen's flash kernel on them.

    CPU tensors with equal q/k dtypes that `applies` to (their dtype, head_dim), and v (when
    given) of q's width: the kernel takes one head width (MLA's narrower v goes to SDPA).
    False until `load()` has succeeded.
    """
    if q.device.type != "cpu" or k.dtype != q.dtype:
        return False
    if v is not None and (v.shape[-1] != q.shape[-1] or v.dtype != q.dtype):
        return False
    return applies(q.dtype, q.shape[-1])


def applies(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the loaded kernel serves attention in `dtype` at `head_dim`: bf16 on a CPU with
    AVX512-BF16 (any head_dim the kernel instantiates, up to 128; up to 64 where it takes the
    AMX path) or fp32 (head_dim <= 32); head_dim a multiple of the vector width. False until
    `load()` has succeeded."""
    isa = _ISA
    if not loaded() or isa is None:
        return False
    _, _, lanes, has_bf16 = isa
    if head_dim % lanes or head_dim // lanes not in _VECTORS_PER_HEAD:
        return False
    if dtype == torch.bfloat16:
        return has_bf16 and (head_dim <= _AMX_MAX_HEAD_DIM or not _state.get("amx", False))
    return dtype == torch.float32 and head_dim <= _FP32_MAX_HEAD_DIM


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(head_dim), causal) v for q [B, Hq, S, D], k/v [B, Hkv, S, D] (Hq % Hkv == 0).

    Returns [B, Hq, S, D] (a transposed view of [B, S, Hq, D] memory). Call `load()` first.
    """
    out, _ = torch.ops.titan_cpu.attn_fwd(q, k, v, q.shape[-1] ** -0.5)
    return out


def ops() -> list:
    """The kernel's registered op overloads (after a successful `load()`)."""
    return [torch.ops.titan_cpu.attn_fwd.default, torch.ops.titan_cpu.attn_bwd.default]
