"""The CPU attention kernel (titan_kernels/cpu_attention) against SDPA in float64, and its op plumbing.

fp32 must match the float64 reference to 2e-5 (forward and all three gradients); bf16 must be
no worse than ATen's own bf16 flash kernel on the same inputs (x1.25, plus 1e-3 slack).
"""

import pytest
import torch
import torch.nn.functional as F

import titan_kernels
from models.common.attention import Attention
from titan_kernels import cpu_attention


@pytest.fixture(scope="module")
def kernel():
    """Build (or load the cached build of) the kernel once, when the first test that needs it
    runs: collecting the suite compiles nothing. Skips those tests where it cannot be built."""
    if not cpu_attention.load():
        pytest.skip(f"kernel unavailable: {cpu_attention.load_error()}")


needs_kernel = pytest.mark.usefixtures("kernel")


def _qkv(batch, heads, kv_heads, seq, head_dim, dtype, contiguous=False):
    """q [B, H, S, D] and k/v [B, Hkv, S, D]; by default transposed views of [B, S, H, D] (the model's layout)."""
    g = torch.Generator().manual_seed(seq * 131 + head_dim)

    def make(h):
        if contiguous:
            return torch.randn(batch, h, seq, head_dim, generator=g, dtype=torch.float64).to(dtype)
        return torch.randn(batch, seq, h, head_dim, generator=g, dtype=torch.float64).to(dtype).transpose(1, 2)

    return make(heads), make(kv_heads), make(kv_heads)


def _reference(q, k, v, dout):
    """Output and (dq, dk, dv) of causal SDPA with k/v repeated per query group, in q's dtype."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _kernel(q, k, v, dout):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = cpu_attention.causal_attention(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


SHAPES = [  # batch, heads, kv_heads, seq, head_dim
    (2, 4, 4, 37, 16),
    (2, 4, 2, 100, 16),
    (1, 8, 2, 64, 32),
    (2, 2, 1, 129, 64),
    (1, 2, 2, 33, 128),
]


def _skip_unbuilt_width(head_dim):
    """The op instantiates head_dim = 1, 2, 4 or 8 vectors of the build's lanes (16 fp32 lanes with
    AVX-512, 8 with AVX2: up to 128 or 64); wider heads are refused by the op and routed to SDPA by
    `applies`, so there is nothing of the kernel's to compare there."""
    lanes = cpu_attention._ISA[2]
    if head_dim % lanes or head_dim // lanes not in cpu_attention._VECTORS_PER_HEAD:
        pytest.skip(f"head_dim {head_dim} is not built with {lanes}-lane vectors on this CPU")


@pytest.mark.parametrize("shape", SHAPES)
@needs_kernel
@pytest.mark.parametrize("contiguous", [False, True])
def test_fp32_matches_float64_sdpa(shape, contiguous):
    _skip_unbuilt_width(shape[-1])
    q, k, v = _qkv(*shape, torch.float64, contiguous)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ref = _reference(q, k, v, dout)
    got = _kernel(q.float(), k.float(), v.float(), dout.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
        assert a.shape == b.shape, name
        err = (a.double() - b).abs().max().item()
        assert err < 2e-5, f"{name}: max abs error {err:.2e} at {shape}"


@needs_kernel
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("path", ["amx", "vdpbf16ps"])
def test_bf16_no_worse_than_aten_flash(shape, path, monkeypatch):
    """Both bf16 paths: AMX tiles (brgemm block GEMMs; CPUs with AMX) and AVX512-BF16 dot products."""
    if not (cpu_attention._ISA and cpu_attention._ISA[3]):
        pytest.skip("no AVX512-BF16 on this CPU: bf16 runs on SDPA")
    # The op itself at every head_dim, also where `auto` prefers SDPA (AMX, head_dim > 64).
    monkeypatch.setenv("TITAN_CPU_ATTN_AMX", "1" if path == "amx" else "0")
    if cpu_attention.uses_amx() != (path == "amx"):
        pytest.skip("no AMX on this CPU (or oneDNN cannot use it): bf16 runs the vdpbf16ps path")
    q, k, v = _qkv(*shape, torch.float64)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    ref = _reference(q, k, v, dout)
    bf = [t.bfloat16() for t in (q, k, v, dout)]
    got, flash = _kernel(*bf), _reference(*bf)

    def rel(a, b):
        return ((a.double() - b).norm() / b.norm()).item()

    for name, a, f, r in zip(("out", "dq", "dk", "dv"), got, flash, ref):
        assert a.dtype == torch.bfloat16
        assert rel(a, r) <= 1.25 * rel(f, r) + 1e-3, f"{name}: kernel {rel(a, r):.2e} vs flash {rel(f, r):.2e}"


@needs_kernel
def test_attention_module_backends_agree():
    torch.manual_seed(0)
    attn = {b: Attention(dim=64, n_heads=4, n_kv_heads=2, head_dim=16) for b in ("sdpa", "cpu_kernel")}
    attn["cpu_kernel"].load_state_dict(attn["sdpa"].state_dict())
    x = torch.randn(2, 40, 64)
    angles = torch.arange(40)[:, None] * torch.arange(8)[None, :] * 0.1
    angles = torch.cat([angles, angles], dim=-1)  # [seq, head_dim], rotate-half layout
    cos, sin = angles.cos(), angles.sin()
    outs, grads = {}, {}
    for name, module in attn.items():
        xi = x.clone().requires_grad_()
        with titan_kernels.use(attention=name) as chosen:
            assert chosen.startswith(name)
            outs[name] = module(xi, cos, sin)
        outs[name].square().sum().backward()
        grads[name] = [xi.grad] + [p.grad for p in module.parameters()]
    torch.testing.assert_close(outs["cpu_kernel"], outs["sdpa"], atol=2e-5, rtol=1e-5)
    for a, b in zip(grads["cpu_kernel"], grads["sdpa"]):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4)


@needs_kernel
def test_auto_picks_kernel_where_supported():
    q16 = torch.empty(1, 2, 8, 16)
    q128 = torch.empty(1, 2, 8, 128)
    assert cpu_attention.supports(q16, q16)
    assert not cpu_attention.supports(q128, q128)  # fp32 at head_dim 128: ATen's kernel is faster
    assert not cpu_attention.supports(q16.double(), q16.double())
    assert not cpu_attention.supports(torch.empty(1, 2, 8, 24), torch.empty(1, 2, 8, 24))
    assert not cpu_attention.supports(torch.empty(1, 2, 8, 16, device="meta"), torch.empty(1, 2, 8, 16, device="meta"))
    if cpu_attention._ISA[3]:  # AVX512-BF16: bf16 up to head_dim 64 always, 128 only off the AMX path
        assert cpu_attention.applies(torch.bfloat16, 64)
        assert cpu_attention.applies(torch.bfloat16, 128) == (not cpu_attention._state["amx"])


@needs_kernel
def test_inputs_the_kernel_does_not_handle_go_to_sdpa():
    """head_dim 24 is not a multiple of the vector width: served by SDPA, same result."""
    attn = Attention(dim=96, n_heads=4, n_kv_heads=4, head_dim=24)
    x, cos, sin = torch.randn(1, 8, 96), torch.ones(8, 24), torch.zeros(8, 24)
    with titan_kernels.use(attention="sdpa"):
        want = attn(x, cos, sin)
    with titan_kernels.use(attention="cpu_kernel"):
        got = attn(x, cos, sin)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@needs_kernel
def test_op_registration_passes_opcheck():
    q, k, v = (t.float().requires_grad_() for t in _qkv(1, 4, 2, 20, 16, torch.float64))
    torch.library.opcheck(torch.ops.titan_cpu.attn_fwd.default, (q, k, v, 0.25))


@needs_kernel
def test_compiles_fullgraph_and_matches_eager():
    q, k, v = (t.float().requires_grad_() for t in _qkv(2, 4, 2, 48, 16, torch.float64))
    eager = cpu_attention.causal_attention(q, k, v)
    compiled = torch.compile(cpu_attention.causal_attention, backend="aot_eager", fullgraph=True)(q, k, v)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    (gq,) = torch.autograd.grad(compiled.sum(), q)
    (gq_eager,) = torch.autograd.grad(eager.sum(), q)
    torch.testing.assert_close(gq, gq_eager, atol=0, rtol=0)


@needs_kernel
def test_selective_ac_saves_the_kernel_output():
    from torch.utils.checkpoint import CheckpointPolicy

    from parallelisms.activation_checkpoint import sac_policy

    titan_kernels.select(attention="auto", device=torch.device("cpu"))  # registers the kernel's ops as saved
    assert sac_policy(None, torch.ops.titan_cpu.attn_fwd.default) == CheckpointPolicy.MUST_SAVE


@pytest.mark.skipif("avx2" not in cpu_attention._cpu_flags(), reason="no AVX2 on this CPU")
@needs_kernel
def test_avx2_build_matches_float64(tmp_path):
    """The AVX2 build (8 fp32 lanes, no bf16 dot products), forced here on an AVX-512 machine.

    It is compiled from the same source under another op namespace, so it loads beside the
    native build. Both dtypes run the fp32-FMA path; bf16 only rounds inputs and outputs.
    """
    from torch.utils.cpp_extension import load as build

    source = cpu_attention._SOURCE.read_text()
    for macro in ("TORCH_LIBRARY(", "TORCH_LIBRARY_IMPL("):
        source = source.replace(f"{macro}titan_cpu,", f"{macro}titan_cpu_avx2_test,")
    (tmp_path / "attention_avx2.cpp").write_text(source)
    build(
        name="titan_cpu_attention_avx2_test",
        sources=[str(tmp_path / "attention_avx2.cpp")],
        extra_cflags=["-O3", "-fopenmp", "-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
        extra_ldflags=["-fopenmp"],
        build_directory=str(tmp_path),
        is_python_module=False,
    )
    ops = torch.ops.titan_cpu_avx2_test
    for shape in [(2, 4, 2, 37, 8), (2, 4, 4, 100, 16), (1, 4, 1, 65, 32), (1, 2, 2, 40, 64)]:
        q, k, v = _qkv(*shape, torch.float64)
        dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
        ref = _reference(q, k, v, dout)
        for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            qd, kd, vd, dd = (t.to(dtype) for t in (q, k, v, dout))
            out, lse = ops.attn_fwd(qd, kd, vd, shape[-1] ** -0.5)
            got = (out, *ops.attn_bwd(dd, qd, kd, vd, out, lse, shape[-1] ** -0.5))
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, ref):
                err = ((a.double() - b).norm() / b.norm()).item()
                assert err < tol, f"{name} {dtype} {shape}: relative error {err:.1e}"


@needs_kernel
def test_select_reports_the_kernel():
    cpu = torch.device("cpu")
    with titan_kernels.use(attention="auto") as chosen:
        assert chosen.startswith("auto (cpu kernel loaded")
        assert titan_kernels.saved_ops() >= set(cpu_attention.ops())
    with titan_kernels.use(attention="sdpa") as chosen:
        assert chosen == "sdpa"
    assert titan_kernels.select(attention="auto", device=torch.device("meta")) == "sdpa"  # not a CPU run
    del cpu


def test_select_falls_back_where_the_kernel_cannot_build(monkeypatch):
    """Runs on every machine: the build failure is forced. auto falls back to SDPA and says why;
    cpu_kernel is a config error (exit 2); off the CPU cpu_kernel is refused before any build."""
    from models.common import ops
    from models.errors import ConfigError

    monkeypatch.setattr(cpu_attention, "_state", {"ok": False, "error": "no compiler"})
    cpu = torch.device("cpu")
    with titan_kernels.use(attention="auto") as chosen:
        assert chosen == "sdpa (cpu kernel unavailable: no compiler)"
        assert ops.implementation("causal_attention") is ops.sdpa_causal_attention
    with pytest.raises(ConfigError, match="model.attn_backend: cpu_kernel cannot be built here"):
        titan_kernels.select(attention="cpu_kernel", device=cpu)
    with pytest.raises(AssertionError, match="RULES refuse it first"):  # a step-plan rule (model.attn_backend)
        titan_kernels.select(attention="cpu_kernel", device=torch.device("meta"))
    with pytest.raises(
        ConfigError, match="model.attn_backend: 'flash' is not allowed; allowed: auto, sdpa, cpu_kernel, splash"
    ):
        titan_kernels.select(attention="flash", device=cpu)


def test_a_killed_build_blocks_nobody(tmp_path):
    """A build killed mid-way (SIGKILL) leaves torch's FileBaton `lock`, on which torch would wait
    forever: the next build takes the flock its holder's death released and removes the lock.
    While a live process holds the flock, another one waits (checked with a non-blocking try)."""
    import fcntl
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    build_dir = tmp_path / "titan_cpu_attention_x"
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; from titan_kernels import cpu_attention as c\n"
            f"with c._build_lock(Path({str(build_dir)!r})):\n"
            f"    (Path({str(build_dir)!r}) / 'lock').write_text('')\n"
            "    print('held', flush=True); time.sleep(600)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=str(Path(__file__).resolve().parents[2]),
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with open(build_dir.with_name(build_dir.name + ".flock"), "a") as handle:
            with pytest.raises(BlockingIOError):  # held by a live build: others wait
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert (build_dir / "lock").exists()  # what a killed build leaves behind
    start = time.monotonic()
    with cpu_attention._build_lock(build_dir):
        assert not (build_dir / "lock").exists()
    assert time.monotonic() - start < 30
