"""The chunked gated delta rule as an op (`gated_delta_rule`, models/common/ops.py), on the CPU.

What a TPU run relies on and this process can check without jax: the op serves a registered
implementation with every argument, and unregistered it is the torch reference
`gated_delta.chunk_gated_delta_rule`, bit for bit; Qwen 3.5's Gated DeltaNet blocks call it; `KernelShapes.of` carries the DeltaNet widths to the start-up self-check, and `select` on TPU
checks and registers the delta rule kernel only for a model that has the rule. The kernel itself
is tested in tests/xla/test_delta_rule_kernel.py (interpret mode, deviceless compile, torch-tpu
registration); its self-check cases in tests/unit/test_kernel_selfcheck.py.
"""

from __future__ import annotations

import dataclasses

import torch

import models
import titan_kernels
from models.common import gated_delta, ops
from models.qwen3_5 import FLAVORS, Qwen3_5Transformer
from titan_kernels.tpu import selfcheck


def _inputs(b=2, s=70, hk=1, hv=2, dk=8, dv=4):
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(b, s, hk, dk, generator=gen), torch.randn(b, s, hk, dk, generator=gen)
    v = torch.randn(b, s, hv, dv, generator=gen)
    g = -torch.nn.functional.softplus(torch.randn(b, s, hv, generator=gen))
    beta = torch.randn(b, s, hv, generator=gen).sigmoid()
    return q, k, v, g, beta


def test_the_op_serves_the_registered_kernel_and_else_the_exact_reference():
    q, k, v, g, beta = _inputs()
    state = torch.randn(2, 2, 8, 4)
    reset = torch.zeros(2, 70, dtype=torch.bool)
    reset[0, 30] = True
    kw = dict(chunk_size=16, initial_state=state, output_final_state=True, qk_l2norm=True, reset=reset)
    want = gated_delta.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    got = ops.gated_delta_rule(q, k, v, g, beta, **kw)  # nothing registered: the reference
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

    calls = []

    def spy(*args, **kwargs):
        calls.append((args, kwargs))
        return args[2] * 0 + 7, None

    previous = ops.register("gated_delta_rule", spy)
    try:
        out, _ = ops.gated_delta_rule(q, k, v, g, beta, **kw)
    finally:
        ops.register("gated_delta_rule", previous)
    assert (out == 7).all() and len(calls) == 1
    args, kwargs = calls[0]
    assert all(a is b for a, b in zip(args, (q, k, v, g, beta)))
    assert kwargs == kw
    assert ops.implementation("gated_delta_rule") is gated_delta.chunk_gated_delta_rule


def test_qwen3_5_deltanet_blocks_call_the_op():
    args = dataclasses.replace(
        FLAVORS["debugmodel"],
        dim=32,
        n_layers=4,
        n_heads=2,
        n_kv_heads=1,
        head_dim=16,
        vocab_size=64,
        hidden_dim=48,
        max_seq_len=128,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )
    torch.manual_seed(0)
    model = Qwen3_5Transformer(args)
    model.init_weights()
    tokens = torch.randint(0, 64, (1, 40))
    want = model(tokens)
    seen = []

    def spy(*a, **kw):
        seen.append(tuple(a[0].shape))
        return ops.torch_gated_delta_rule(*a, **kw)

    previous = ops.register("gated_delta_rule", spy)
    try:
        got = model(tokens)
    finally:
        ops.register("gated_delta_rule", previous)
    assert seen == [(1, 40, 1, 8)] * 3  # blocks 0, 1, 2 are Gated DeltaNet, block 3 full attention
    assert torch.equal(got, want)


def test_kernel_shapes_carry_the_deltanet_widths():
    shapes = selfcheck.KernelShapes.of(models.get_model_family("qwen3_5").get_args("9B"))
    assert (shapes.delta_k_dim, shapes.delta_v_dim, shapes.delta_heads) == (128, 128, 32)
    assert selfcheck.KernelShapes.of(models.get_model_family("llama3").get_args("debugmodel")).delta_heads == 0


def test_select_on_tpu_checks_the_delta_rule_only_for_a_model_with_it(monkeypatch):
    from titan_kernels import tpu

    def agreeing(*a, chunk_size=64, **kw):  # the recurrence: independent of the chunked reference
        return gated_delta.recurrent_gated_delta_rule(*a, **kw)

    monkeypatch.setattr(tpu, "load", lambda: {"gated_delta_rule": agreeing})
    monkeypatch.setattr(tpu, "saved_ops", lambda: [])
    monkeypatch.setattr(tpu, "compile_checker", lambda shapes, attached=False: lambda op: None)
    cpu = torch.device("cpu")
    try:
        shapes = selfcheck.KernelShapes(delta_k_dim=16, delta_v_dim=8, delta_heads=4)
        line = titan_kernels._select_tpu("sdpa", device=cpu, dtype=torch.bfloat16, head_dim=None, shapes=shapes)
        assert ops.implementation("gated_delta_rule") is agreeing
        assert "chunked gated delta rule" in line and "self-check passed" in line, line
        line = titan_kernels._select_tpu(
            "sdpa", device=cpu, dtype=torch.bfloat16, head_dim=None, shapes=selfcheck.KernelShapes()
        )
        assert ops.implementation("gated_delta_rule") is ops.torch_gated_delta_rule
        assert "delta rule" not in line, line
    finally:
        ops.register("gated_delta_rule", None)


def test_the_capture_op_keeps_shapes_and_autograd_on_fake_tensors():
    """scripts/estimate_xla.py's capture serves the op with `titan_capture::gated_delta_fwd / _bwd`
    (titan_kernels/tpu/capture.py; lowered to the kernel later, in the XLA venv): one node each,
    shapes and dtypes as the reference's, gradients for every input."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_kernels.tpu import capture

    capture.install()
    try:
        with FakeTensorMode():
            leaves = [t.to(torch.bfloat16).requires_grad_(True) for t in _inputs(b=2, s=70, hk=1, hv=2, dk=8, dv=4)]
            state = torch.zeros(2, 2, 8, 4, requires_grad=True)
            out, final = ops.gated_delta_rule(*leaves, initial_state=state, output_final_state=True, qk_l2norm=True)
            assert out.shape == (2, 70, 2, 4) and out.dtype == torch.bfloat16
            assert final.shape == (2, 2, 8, 4) and final.dtype == torch.float32
            grads = torch.autograd.grad((out.float().sum() + final.sum(),), [*leaves, state])
            assert [g.shape for g in grads] == [t.shape for t in (*leaves, state)]
    finally:
        for op in (*ops.OPS, *ops.LOW_PRECISION_OPS):  # what capture.install() serves
            ops.register(op, None)
