"""The attention op with a v head width different from q/k's (MLA: q/k 192, v 128), on every CPU path.

`ops.causal_attention(q, k, v)` takes v [b, kv_heads, s, v_head_dim] beside q/k at `head_dim`
and returns the output at v's width, scaled by q's width (models/common/ops.py). Checked here
against attention written out in float64 (`_exact`), forward and dq, dk, dv, at v narrower
(48 / 32: DeepSeek-V3's 192 / 128 scaled by 1/4) and wider (48 / 64) than q/k:

- the SDPA reference, as it runs and with ATen's math or flash backend forced (flash takes one
  width: the reference pads inside; without that SDPA would fall back to math and keep the
  [s, s] probabilities);
- the `cpu_kernel` backend: the C++ kernel takes one width, so `supports(q, k, v)` says no and
  the call goes to SDPA;
- context parallelism's dense path and its kernel interface (the one TPU splash serves) on 2
  gloo ranks;
- the capture ops' shape-only kernels (titan_kernels/tpu/capture.py, tools/tpu_compile.py's CP
  pair): outputs at v's width, gradients at each input's.

Bound: as tests/unit/test_context_parallel.py argues, float32 attention differs from the exact value
by sums of at most s + d terms per stage over about four stages: 8 (s + d) u max|exact|,
u = 2^-24, d the larger width. A wrong scale (v's width instead of q's) or a padded column that
leaks is an O(1e-1) relative error.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import titan_kernels
from models.common import ops

U = 2.0**-24
B, SEQ, HEAD_DIM = 2, 64, 48
WIDTHS = {"v_narrower": 32, "v_wider": 64}


def _inputs(q_heads: int, kv_heads: int, documents: bool, v_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed * 100 + v_dim + q_heads + documents)
    q = torch.randn(B, q_heads, SEQ, HEAD_DIM, generator=g)
    k = torch.randn(B, kv_heads, SEQ, HEAD_DIM, generator=g)
    v = torch.randn(B, kv_heads, SEQ, v_dim, generator=g)
    grad_out = torch.randn(B, q_heads, SEQ, v_dim, generator=g)
    segment_ids = torch.cumsum(torch.rand(B, SEQ, generator=g) < 0.125, dim=1) if documents else None
    return q, k, v, grad_out, segment_ids


def _exact(q, k, v, grad_out, segment_ids):
    """Out, dq, dk, dv of causal (document) attention written out in float64."""
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    n_rep = q.shape[1] // k.shape[1]
    kr, vr = ops.repeat_kv(k, n_rep), ops.repeat_kv(v, n_rep)
    scores = (q @ kr.transpose(-2, -1)) * q.shape[-1] ** -0.5
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if segment_ids is not None:
        mask = ops.document_causal_mask(segment_ids)
    out = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ vr
    out.backward(grad_out.double())
    return [out.detach(), q.grad, k.grad, v.grad]


def _run(fn, q, k, v, grad_out, segment_ids):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v) if segment_ids is None else fn(q, k, v, segment_ids)
    out.backward(grad_out)
    return [out.detach(), q.grad, k.grad, v.grad]


def _assert_close(got, want, what):
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.shape == w.shape, f"{what} {name}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        bound = 8 * (SEQ + max(HEAD_DIM, w.shape[-1])) * U * w.abs().max().item()
        err = (g.double() - w).abs().max().item()
        assert err <= bound, f"{what} {name}: max abs error {err:.3g} > bound {bound:.3g}"


CASES = [(4, 4, False), (4, 2, True)]  # (q heads, kv heads, documents): MHA causal, GQA with documents


@pytest.mark.parametrize("v_dim", WIDTHS.values(), ids=WIDTHS.keys())
@pytest.mark.parametrize(
    "backend", [None, SDPBackend.MATH, SDPBackend.FLASH_ATTENTION], ids=["default", "math", "flash"]
)
def test_sdpa_reference_takes_two_widths(v_dim, backend):
    for case in CASES:
        inputs = _inputs(*case, v_dim)
        want = _exact(*inputs)
        if backend is None:
            got = _run(ops.causal_attention, *inputs)
        else:
            with sdpa_kernel([backend]):  # flash alone: raises unless the reference pads to one width
                got = _run(ops.causal_attention, *inputs)
        assert got[0].shape == (B, case[0], SEQ, v_dim)
        _assert_close(got, want, f"sdpa {backend} {case} v{v_dim}")


def test_scale_is_q_width_not_v_width():
    """The same call with the output scaled by v's width would be far off: the bound catches it."""
    q, k, v, grad_out, seg = _inputs(4, 4, False, 32)
    want = _exact(q, k, v, grad_out, seg)[0]
    wrong = _exact(q * (48 / 32) ** 0.5, k, v, grad_out, seg)[0]
    assert (wrong - want).abs().max() > 0.05 * want.abs().max()


@pytest.mark.parametrize("v_dim", WIDTHS.values(), ids=WIDTHS.keys())
def test_cpu_kernel_backend_hands_two_widths_to_sdpa(v_dim):
    from titan_kernels import cpu_attention

    with titan_kernels.use(attention="cpu_kernel" if cpu_attention.load() else "auto"):
        for case in CASES:
            inputs = _inputs(*case, v_dim)
            _assert_close(_run(ops.causal_attention, *inputs), _exact(*inputs), f"cpu_kernel {case} v{v_dim}")
    if not cpu_attention.loaded():
        pytest.skip(f"kernel unavailable (SDPA served the calls above): {cpu_attention.load_error()}")
    q = torch.randn(1, 2, 8, 16)
    assert cpu_attention.supports(q, q, q) or not cpu_attention.applies(q.dtype, 16)
    assert not cpu_attention.supports(q, q, torch.randn(1, 2, 8, 8))  # one width only: SDPA serves it


def _cp_on_rank(v_dim: int, with_kernel: bool):
    import torch.distributed as dist

    from parallelisms.context_parallel import context_parallel_attention, cp_group, shard_sequence
    from tests.unit.test_context_parallel import _dense_local_attention

    cp = cp_group(dist.group.WORLD)
    results = []
    for case in CASES:
        q, k, v, grad_out, seg = _inputs(*case, v_dim)
        q, k, v = (shard_sequence(t, 2, cp.rank, cp.size).requires_grad_() for t in (q, k, v))
        seg = None if seg is None else shard_sequence(seg, 1, cp.rank, cp.size)
        local = _dense_local_attention(cp) if with_kernel else None
        out = context_parallel_attention(q, k, v, seg, cp=cp, local_attention=local)
        out.backward(shard_sequence(grad_out, 2, cp.rank, cp.size))
        results.append([t.detach() for t in (out, q.grad, k.grad, v.grad)])
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("with_kernel", [False, True], ids=["dense", "kernel_interface"])
def test_context_parallel_attention_takes_two_widths(with_kernel):
    from parallelisms.context_parallel import unshard_sequence
    from tests.support.parallel_harness import run_processes

    v_dim = WIDTHS["v_narrower"]
    ranks = run_processes(2, _cp_on_rank, v_dim, with_kernel)
    for i, case in enumerate(CASES):
        want = _exact(*_inputs(*case, v_dim))
        got = [unshard_sequence(torch.cat([r[i][j] for r in ranks], dim=2), 2, 2) for j in range(4)]
        _assert_close(got, want, f"cp2 {case} kernel={with_kernel}")


def test_capture_fakes_return_v_width():
    """The shape-only kernels of the XLA capture and of the compiled CP program: the output at
    v's width (`empty_like(q)` would give q's), the gradients at each input's."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_kernels.tpu import capture
    from tools import tpu_compile

    capture._define()
    program = tpu_compile._define_program_ops()
    with FakeTensorMode():
        q = torch.empty(2, 4, 256, 192, dtype=torch.bfloat16, requires_grad=True)
        k = torch.empty(2, 4, 256, 192, dtype=torch.bfloat16, requires_grad=True)
        v = torch.empty(2, 4, 256, 128, dtype=torch.bfloat16, requires_grad=True)
        seg = torch.zeros(2, 256, dtype=torch.int64)
        for out in (capture.causal_attention(q, k, v), capture.causal_attention(q, k, v, seg)):
            assert out.shape == (2, 4, 256, 128)
            dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
            assert (dq.shape[-1], dk.shape[-1], dv.shape[-1]) == (192, 192, 128)
        k_all = torch.empty(2, 4, 512, 192, dtype=torch.bfloat16)
        v_all = torch.empty(2, 4, 512, 128, dtype=torch.bfloat16)
        seg_all = torch.zeros(2, 512, dtype=torch.int32)
        assert program.splash_cp_fwd(q, k_all, v_all, 1, 2).shape == (2, 4, 256, 128)
        assert program.splash_cp_seg_fwd(q, k_all, v_all, seg.int(), seg_all, 1, 2).shape == (2, 4, 256, 128)
