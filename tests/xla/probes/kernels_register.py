"""Probe (ttpu venv): titan_kernels/tpu/register.py defines its torch ops through torch-tpu's jax_op.

    python kernels_register.py

With torch-tpu imported explicitly (autoload off, no TPU), `register.build()` defines the
`titan_tpu::*` ops with `torch.tpu.pallas.jax_op` and their autograd. Then, under
`FakeTensorMode` (shapes only: jax_op's fake kernels come from `jax.export` of the kernels for
platform "tpu"), each model-op implementation that `build()` returns runs forward and backward
with the device check bypassed (`_on_tpu` -> True), and output / gradient shapes and dtypes are
compared with the inputs'. Nothing executes a kernel: that needs a TPU.
Prints one JSON line: {"ops": [registered op names], "checks": {name: "ok" | error}}.
"""

from __future__ import annotations

import json
import traceback

import torch
import torch_tpu  # noqa: F401  (explicit: autoload is off in tests)
from torch._subclasses.fake_tensor import FakeTensorMode

from titan_kernels.tpu import register


def _check(fn) -> str:
    try:
        fn()
        return "ok"
    except Exception as e:  # report, the test asserts
        return f"{type(e).__name__}: {e}"[:1500] + "\n" + traceback.format_exc()[-1500:]


def main() -> None:
    impls = register.build()
    names = sorted(
        n for n in dir(torch.ops.titan_tpu) if isinstance(getattr(torch.ops.titan_tpu, n), torch._ops.OpOverloadPacket)
    )
    register._on_tpu = lambda *tensors: True
    bf16 = torch.bfloat16

    def leaf(*shape, dtype=bf16):
        return torch.empty(*shape, dtype=dtype).requires_grad_(dtype.is_floating_point)

    def attention(segments: bool):
        q, k, v = leaf(2, 8, 256, 128), leaf(2, 2, 256, 128), leaf(2, 2, 256, 128)
        seg = torch.zeros(2, 256, dtype=torch.int64) if segments else None
        out = impls["causal_attention"](q, k, v, seg)
        assert out.shape == q.shape and out.dtype == bf16, out
        dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)

    def full_attention(seq: int):
        # the op `attention` (full mask, FLUX): 200 tokens are padded to 256 with segment ids
        q, k, v = leaf(2, 8, seq, 128), leaf(2, 2, seq, 128), leaf(2, 2, seq, 128)
        out = impls["attention"](q, k, v)
        assert out.shape == q.shape and out.dtype == bf16, out
        dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k, v))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)

    def grouped(linear_layout: bool):
        x = leaf(512, 256)
        w = leaf(8, 384, 256).transpose(-2, -1) if linear_layout else leaf(8, 256, 384)
        sizes = torch.zeros(8, dtype=torch.int64)
        y = impls["grouped_mm"](x, w, sizes)
        assert y.shape == (512, 384) and y.dtype == bf16, y
        dx, dw = torch.autograd.grad(y.float().sum(), (x, w))
        assert dx.shape == x.shape and dw.shape == w.shape

    def loss():
        h, w = leaf(512, 256), leaf(5000, 256)
        labels = torch.zeros(512, dtype=torch.int64)
        value = impls["linear_cross_entropy"](h, w, labels)
        assert value.shape == () and value.dtype == torch.float32, value
        dh, dw = torch.autograd.grad(value, (h, w))
        assert dh.shape == h.shape and dh.dtype == bf16 and dw.shape == w.shape

    def cp_attention(segments: bool):
        # rank 1 of cp 2: its two chunks of 128 queries against the 512 gathered keys
        fn = register.build_cp(1, 2)
        q, k_all, v_all = leaf(2, 8, 256, 128), leaf(2, 2, 512, 128), leaf(2, 2, 512, 128)
        seg = torch.zeros(2, 256, dtype=torch.int64) if segments else None
        seg_all = torch.zeros(2, 512, dtype=torch.int64) if segments else None
        out = fn(q, k_all, v_all, seg, seg_all)
        assert out.shape == q.shape and out.dtype == bf16, out
        dq, dk, dv = torch.autograd.grad(out.float().sum(), (q, k_all, v_all))
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k_all.shape, v_all.shape)

    checks = {}
    for name, fn in (
        ("splash", lambda: attention(False)),
        ("splash_segments", lambda: attention(True)),
        ("splash_full", lambda: full_attention(256)),
        ("splash_full_padded", lambda: full_attention(200)),
        ("splash_cp", lambda: cp_attention(False)),
        ("splash_cp_segments", lambda: cp_attention(True)),
        ("gmm_kn", lambda: grouped(False)),
        ("gmm_linear_layout", lambda: grouped(True)),
        ("linear_ce", loss),
    ):
        with FakeTensorMode():
            checks[name] = _check(fn)

    def saved():
        names = sorted(op.name() for op in register.saved_ops())
        assert names == [
            "titan_tpu::gmm",
            "titan_tpu::gmm_t",
            "titan_tpu::splash_full_fwd",
            "titan_tpu::splash_fwd",
            "titan_tpu::splash_seg_fwd",
        ], names

    checks["saved_ops"] = _check(saved)

    def residual_backward():
        # splash's forward ops return (out, lse); the backward ops take them (no forward rerun).
        fwd, bwd = torch.ops.titan_tpu.splash_fwd.default._schema, torch.ops.titan_tpu.splash_bwd.default._schema
        seg_bwd = torch.ops.titan_tpu.splash_seg_bwd.default._schema
        assert len(fwd.returns) == 2, fwd
        assert [a.name for a in bwd.arguments] == ["q", "k", "v", "out", "lse", "dout"], bwd
        assert [a.name for a in seg_bwd.arguments] == ["q", "k", "v", "segment_ids", "out", "lse", "dout"], seg_bwd

    checks["splash_residual_backward"] = _check(residual_backward)
    checks["generation"] = (
        "ok" if register.device_generation() is None else f"unexpected: {register.device_generation()}"
    )
    print(json.dumps({"ops": names, "checks": checks}))


if __name__ == "__main__":
    main()
