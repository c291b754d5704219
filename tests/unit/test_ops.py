"""The torch references of the model ops (models/common/ops.py) and their selection (titan_kernels/).

These references serve every device that has no kernel for an op, so they must be exact and
traceable without host reads. Bounds (float32, u = 2^-24): two computations of the same sums
in a different order differ by at most about n * u * scale for a reduction of length n; the
tests use 4 * n * u * scale, or exact equality where the arithmetic is the same.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import titan_kernels
from models.common import ops
from models.errors import ConfigError

U32 = 2.0**-24


class NoHostSync(TorchDispatchMode):
    """Fails on any op that copies a device value to the host: `.item()`, `bool(t)`, `int(t)`
    (all `_local_scalar_dense`) and `.tolist()` (which on the CPU reads memory directly, so it
    is patched for the duration)."""

    def __enter__(self):
        self._tolist = torch.Tensor.tolist

        def tolist(t):
            raise AssertionError("host sync: Tensor.tolist")

        torch.Tensor.tolist = tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            raise AssertionError(f"host sync: {func}")
        return func(*args, **(kwargs or {}))


# --- attention with segment ids ----------------------------------------------------------------


def test_segment_ids_equal_attention_per_document():
    """A packed row with documents [0..4), [4..11), [11..13) gives each document's own causal
    attention, GQA included (2 kv heads for 4 q heads)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 13, 8), torch.randn(1, 2, 13, 8), torch.randn(1, 2, 13, 8)
    bounds = [0, 4, 11, 13]
    seg = torch.tensor([[i for i in range(3) for _ in range(bounds[i + 1] - bounds[i])]])
    out = ops.causal_attention(q, k, v, segment_ids=seg)
    for a, b in zip(bounds, bounds[1:]):
        ref = ops.causal_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b])
        tol = 4 * 13 * U32 * v.abs().max().item()
        torch.testing.assert_close(out[:, :, a:b], ref, atol=tol, rtol=0)
    # Without segments the later documents see the earlier ones: the mask matters.
    assert (ops.causal_attention(q, k, v)[:, :, 4:] - out[:, :, 4:]).abs().max() > 0.01
    # One segment is plain causal attention.
    torch.testing.assert_close(
        ops.causal_attention(q, k, v, torch.zeros(1, 13, dtype=torch.long)),
        ops.causal_attention(q, k, v),
        atol=4 * 13 * U32 * 4,
        rtol=0,
    )


def test_attention_implementations_receive_segment_ids_only_when_given():
    seen = []
    ops.register("causal_attention", lambda *a: seen.append(len(a)) or a[0])
    q = torch.zeros(1, 1, 2, 4)
    ops.causal_attention(q, q, q)
    ops.causal_attention(q, q, q, torch.zeros(1, 2, dtype=torch.long))
    assert seen == [3, 4]


# --- full (bidirectional) attention -------------------------------------------------------------


def test_full_attention_reference_is_unmasked_sdpa_bit_for_bit():
    """`attention`'s reference is the plain SDPA call FLUX made before the op existed (no GQA:
    the same call, bitwise), GQA by repeated k/v heads (bitwise the repeated call), and every
    query sees every key, later ones included."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8), torch.randn(2, 4, 13, 8)
    assert torch.equal(ops.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    k2, v2 = k[:, :2], v[:, :2]
    want = F.scaled_dot_product_attention(q, ops.repeat_kv(k2, 2), ops.repeat_kv(v2, 2))
    assert torch.equal(ops.attention(q, k2, v2), want)
    moved = v.clone()
    moved[:, :, -1] += 1.0  # the last key's value reaches the first query
    assert (ops.attention(q, k, moved)[:, :, 0] - ops.attention(q, k, v)[:, :, 0]).abs().max() > 1e-3
    assert not torch.allclose(ops.attention(q, k, v), ops.causal_attention(q, k, v))


def test_full_attention_reference_takes_its_own_value_width():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 9, 12), torch.randn(1, 2, 9, 12), torch.randn(1, 2, 9, 8)
    scores = torch.softmax(q @ k.transpose(-2, -1) * 12**-0.5, dim=-1)
    torch.testing.assert_close(ops.attention(q, k, v), scores @ v, atol=4 * 21 * U32 * 4, rtol=0)


def test_full_attention_dispatches_to_the_registered_implementation():
    seen = []
    q = torch.zeros(1, 1, 2, 4)
    previous = ops.register("attention", lambda *a: seen.append(len(a)) or a[0])
    assert previous is None
    assert ops.attention(q, q, q) is q and seen == [3]
    ops.register("attention", None)
    assert ops.implementation("attention") is ops.sdpa_attention


@pytest.mark.parametrize("backend", ["auto", "sdpa", "cpu_kernel"])
def test_full_attention_takes_the_reference_on_the_cpu_whatever_the_backend(backend):
    """The CPU kernel is causal only: on the CPU `select` leaves `attention` to SDPA (and clears
    an implementation a previous job left)."""
    ops.register("attention", lambda *a: a[0])
    try:
        with titan_kernels.use(attention=backend, device="cpu"):
            assert ops.implementation("attention") is ops.sdpa_attention
    except ConfigError:  # cpu_kernel that cannot be built on this host
        assert backend == "cpu_kernel"


# --- grouped matmul ---------------------------------------------------------------------------


def _grouped_loop(x, w, sizes):
    out, start = [], 0
    for g, n in enumerate(sizes.tolist()):
        out.append(x[start : start + n] @ w[g])
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("dtype,k,n", [(torch.float32, 16, 24), (torch.float32, 6, 10), (torch.bfloat16, 16, 24)])
def test_grouped_mm_reference_matches_per_group_loop(dtype, k, n):
    """torch._grouped_mm (aligned sizes) and the masked fallback (k=6, n=10 unaligned) both give
    each row its own group's product; empty groups included."""
    torch.manual_seed(0)
    sizes = torch.tensor([3, 0, 7, 1, 0])
    x = torch.randn(11, k, dtype=dtype)
    w = torch.randn(5, n, k, dtype=dtype).transpose(-2, -1)  # the experts' nn.Linear layout
    with NoHostSync():
        out = ops.grouped_mm(x, w, sizes)
    ref = _grouped_loop(x.double(), w.double(), sizes)
    u = U32 if dtype == torch.float32 else 2.0**-8
    assert (out.double() - ref).abs().max() <= 4 * k * u * ref.abs().max() + u * ref.abs().max()


def test_masked_grouped_mm_is_the_same_product():
    torch.manual_seed(0)
    sizes = torch.tensor([2, 5, 0, 4])
    x, w = torch.randn(11, 8), torch.randn(4, 8, 12)
    # Same products, but a matmul over all 11 rows and one over a group's rows may block the
    # length-8 dot products differently (seen on an AMD EPYC VM: 3e-7 apart), so allow fp32's
    # reordering bound K * eps * sum_k |x_k w_k| per entry; a row given the wrong group's weight
    # is O(1) off.
    got, want = ops.masked_grouped_mm(x, w, sizes), _grouped_loop(x, w, sizes)
    group = torch.repeat_interleave(torch.arange(4), sizes)
    bound = 8 * torch.finfo(torch.float32).eps * torch.einsum("mk,mkn->mn", x.abs(), w.abs()[group])
    assert ((got - want).abs() <= bound).all(), ((got - want).abs() / bound).max()
    assert ops.group_of_rows(sizes, 11).tolist() == [0, 0, 1, 1, 1, 1, 1, 3, 3, 3, 3]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_compiles_fullgraph_without_scalar_capture(dtype):
    torch.manual_seed(0)
    x, w = torch.randn(9, 16, dtype=dtype, requires_grad=True), torch.randn(3, 16, 8, dtype=dtype, requires_grad=True)
    sizes = torch.tensor([4, 0, 5])
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=False):
        fn = torch.compile(lambda x, w, s: ops.grouped_mm(x, w, s).square().sum(), fullgraph=True, backend="aot_eager")
        got = fn(x, w, sizes)
        gx, gw = torch.autograd.grad(got, (x, w))
    ref = _grouped_loop(x, w, sizes).square().sum()
    rx, rw = torch.autograd.grad(ref, (x, w))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in ((got, ref), (gx, rx), (gw, rw)):
        torch.testing.assert_close(a, b, atol=tol * b.abs().max().item(), rtol=0)


# --- fused linear + cross-entropy -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_cross_entropy_matches_unfused_loss(dtype):
    """Same loss and gradients as the trainer's `F.cross_entropy(logits.float(), labels)`, with
    ignored labels and a vocabulary (300) not a multiple of the chunk (128).

    fp32: reductions of length vocab (lse) and dim/rows (matmuls): 4 * (vocab + dim) * u.
    bf16: both paths round the logits and dlogits to bf16 identically; the chunked backward
    rounds each chunk's partial dh to bf16 before summing the 3 chunks in fp32, i.e. up to
    3 extra bf16 roundings: 4 * 2^-8 relative to the gradient's scale.
    """
    torch.manual_seed(0)
    n, dim, vocab = 37, 32, 300
    h = torch.randn(n, dim, dtype=dtype, requires_grad=True)
    w = (0.3 * torch.randn(vocab, dim)).to(dtype).requires_grad_()
    labels = torch.randint(0, vocab, (n,))
    labels[:5] = ops.IGNORE_INDEX
    fused = ops.chunked_linear_cross_entropy(h, w, labels, chunk_size=128)
    fused_grads = torch.autograd.grad(fused, (h, w))
    ref = F.cross_entropy(F.linear(h, w).float(), labels)
    ref_grads = torch.autograd.grad(ref, (h, w))
    assert fused.dtype == torch.float32 and fused.shape == ()
    rel = 4 * (vocab + dim) * U32 if dtype == torch.float32 else 4 * 2.0**-8
    assert abs(fused.item() - ref.item()) <= 4 * (vocab + dim) * U32 * ref.item()
    for got, want in zip(fused_grads, ref_grads):
        assert got.dtype == want.dtype
        assert (got.float() - want.float()).abs().max() <= rel * want.float().abs().max()


def test_linear_cross_entropy_never_holds_the_logits():
    """No saved activation has as many elements as the logits: the chunked op keeps h, w, the
    labels and one float per row (lse), where the unfused loss saves [N, vocab] floats."""
    n, dim, vocab = 256, 16, 1000  # logits 256k floats; h 4k, w 16k
    h, w = torch.randn(n, dim, requires_grad=True), torch.randn(vocab, dim, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        ops.linear_cross_entropy(h, w, labels).backward()
    assert saved and max(saved) < n * vocab / 4, saved
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        F.cross_entropy(F.linear(h, w).float(), labels).backward()
    assert max(saved) >= n * vocab  # the test can see logits when they are there


def test_linear_cross_entropy_compiles_fullgraph():
    torch.manual_seed(0)
    h, w = torch.randn(20, 8, requires_grad=True), torch.randn(50, 8, requires_grad=True)
    labels = torch.randint(0, 50, (20,))
    torch._dynamo.reset()
    fn = torch.compile(
        lambda h, w, y: ops.chunked_linear_cross_entropy(h, w, y, chunk_size=16), fullgraph=True, backend="aot_eager"
    )
    got = fn(h, w, labels)
    gh, gw = torch.autograd.grad(got, (h, w))
    ref = F.cross_entropy(h @ w.T, labels)
    rh, rw = torch.autograd.grad(ref, (h, w))
    torch.testing.assert_close(got, ref, atol=4 * 58 * U32 * ref.item(), rtol=0)
    torch.testing.assert_close(gh, rh, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gw, rw, atol=1e-6, rtol=1e-5)


# --- selection ---------------------------------------------------------------------------------


def test_splash_is_tpu_only():
    """A rule of the step plan (tests/unit/test_step_plan.py), asserted by `select`."""
    from trainer.step import StepRequest, refusals

    assert refusals(StepRequest(attn_backend="splash")) == [
        "model.attn_backend: splash runs on TPU only, not on cpu; allowed here: auto, sdpa, cpu_kernel"
    ]
    with pytest.raises(AssertionError, match="RULES refuse it first"):
        titan_kernels.select(attention="splash", device=torch.device("cpu"))


def test_tpu_selection_registers_the_pallas_kernels(monkeypatch):
    """On a TPU `auto` and `splash` serve attention with splash, and gmm / the fused loss serve
    their ops whatever the attention backend; without the kernels `auto` falls back to SDPA and
    `splash` is a config error. (titan_kernels/tpu is faked: the real one needs torch-tpu.)"""
    from titan_kernels import tpu
    from titan_kernels.tpu import selfcheck

    tpu_device = types.SimpleNamespace(type="tpu")
    fake = {
        op: (lambda *a, op=op: op) for op in ("causal_attention", "attention", "grouped_mm", "linear_cross_entropy")
    }
    monkeypatch.setattr(tpu, "load", lambda: fake)
    monkeypatch.setattr(tpu, "saved_ops", lambda: [])
    # The fakes cannot pass the start-up self-check (tests/unit/test_kernel_selfcheck.py tests it): all pass here.
    monkeypatch.setattr(selfcheck, "run", lambda impls, **kwargs: (dict(impls), []))
    for attention in ("auto", "splash"):
        assert "splash" in titan_kernels.select(attention=attention, device=tpu_device)
        assert all(ops.implementation(op) is fake[op] for op in fake)
    assert titan_kernels.select(attention="sdpa", device=tpu_device).startswith("sdpa")
    assert ops.implementation("causal_attention") is ops.sdpa_causal_attention
    assert ops.implementation("attention") is ops.sdpa_attention  # the backend picks both attentions
    assert ops.implementation("grouped_mm") is fake["grouped_mm"]
    monkeypatch.setattr(tpu, "load", lambda: None)
    monkeypatch.setattr(tpu, "load_error", lambda: "no jax")
    assert "unavailable: no jax" in titan_kernels.select(attention="auto", device=tpu_device)
    assert ops.implementation("grouped_mm") is ops.torch_grouped_mm
    with pytest.raises(ConfigError, match="splash cannot be loaded here"):
        titan_kernels.select(attention="splash", device=tpu_device)
