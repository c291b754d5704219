"""Probe (xla venv): the Pallas kernels of titan_kernels/tpu in interpret mode against the torch references.

    python kernels_interpret.py [splash] [splash_full] [gmm] [fused_ce] [selfcheck] [splash_structure]

Runs each named kernel's cases (float32, odd sizes that force padding and several grid blocks) forward
and backward in Pallas' interpreter on the CPU, and the same op's torch reference
(models/common/ops.py, the implementation every non-TPU device runs) on the same inputs, both
compared with that torch reference evaluated in float64 (the "exact" value). The reverse pass is
a vector-Jacobian product with a fixed random cotangent.
Prints one JSON line: {"jax", "torch", "kernels": {kernel: [{"case", "n", "outputs": {name:
{"pallas_err", "torch_err", "scale"}}, "seconds"}]}} where errors are max |x - exact|, `scale` is max |exact|
and `n` the longest reduction in the case (for the test's rounding bound).

`selfcheck`: the start-up self-check (titan_kernels/tpu/selfcheck.py) with the real kernels in
interpret mode as the implementations, in bf16 (bf16 operands, float32 accumulation, as the
MXU): {"selfcheck": {op: {"ok", "worst", "reason"}}}. `splash_structure`: the names of the
Pallas calls in the jaxprs of splash's forward and of its backward from residuals:
{"splash_structure": {"causal"|"segments"|"full": {"forward": [names], "backward": [names]}}}.
`splash_full`: the full-mask splash (the op `attention`, FLUX) against `ops.sdpa_attention`, at a
length that needs padding (whose keys no real query may see) and one that does not.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from models.common import ops

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "titan_kernels" / "tpu"))
import fused_ce  # noqa: E402
import gmm  # noqa: E402
import splash  # noqa: E402

RNG = np.random.default_rng(0)


def _normal(*shape, std=1.0):
    return (RNG.standard_normal(shape) * std).astype(np.float32)


def _vjp_torch(fn, inputs: list[np.ndarray], cot: np.ndarray | None, dtype) -> list[np.ndarray]:
    ts = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in inputs]
    out = fn(*ts)
    grads = torch.autograd.grad(out, ts, torch.tensor(cot, dtype=dtype) if cot is not None else None)
    return [out.detach().double().numpy()] + [g.double().numpy() for g in grads]


def _vjp_jax(fn, inputs: list[np.ndarray], cot: np.ndarray | None) -> list[np.ndarray]:
    out, vjp = jax.vjp(fn, *[jnp.asarray(x) for x in inputs])
    grads = vjp(jnp.ones_like(out) if cot is None else jnp.asarray(cot))
    return [np.asarray(out, np.float64)] + [np.asarray(g, np.float64) for g in grads]


def _compare(names, exact, pallas, ref32) -> dict:
    return {
        name: {
            "pallas_err": float(np.abs(p - e).max()),
            "torch_err": float(np.abs(t - e).max()),
            "scale": float(np.abs(e).max()),
        }
        for name, e, p, t in zip(names, exact, pallas, ref32)
    }


def _case(label, n, names, torch_fn, jax_fn, inputs, cot) -> dict:
    start = time.perf_counter()
    exact = _vjp_torch(torch_fn, inputs, cot, torch.float64)
    ref32 = _vjp_torch(torch_fn, inputs, cot, torch.float32)
    pallas = _vjp_jax(jax_fn, inputs, cot)
    return {
        "case": label,
        "n": n,
        "outputs": _compare(names, exact, pallas, ref32),
        "seconds": round(time.perf_counter() - start, 2),
    }


def splash_cases() -> list[dict]:
    cases = []
    # The last case has MLA's widths (DeepSeek-V3 / Kimi K2: q/k 192, v 128), unpadded.
    for b, hq, hkv, s, d, dv, docs in (
        (2, 4, 2, 200, 32, 32, True),
        (1, 2, 2, 77, 16, 16, False),
        (1, 2, 1, 200, 192, 128, True),
    ):
        q, k, v = _normal(b, hq, s, d), _normal(b, hkv, s, d), _normal(b, hkv, s, dv)
        seg = np.sort(RNG.integers(0, 4, (b, s)), axis=1).astype(np.int32) if docs else None
        seg_t = torch.tensor(seg) if docs else None
        seg_j = jnp.asarray(seg) if docs else None
        width = f"d{d}" if d == dv else f"d{d} dv{dv}"
        cases.append(
            _case(
                f"b{b} hq{hq} hkv{hkv} s{s} {width} {'segments' if docs else 'causal'}",
                s + d,
                ["out", "dq", "dk", "dv"],
                lambda q, k, v: ops.sdpa_causal_attention(q, k, v, seg_t),
                lambda q, k, v: splash.splash_attention(q, k, v, seg_j, interpret=True),
                [q, k, v],
                _normal(b, hq, s, dv),
            )
        )
    return cases


def splash_full_cases() -> list[dict]:
    cases = []
    # 200 and 77 tokens: padded to 256 / 128 (the padded keys hidden by segment ids); 256: none.
    for b, hq, hkv, s, d, dv in ((2, 4, 2, 200, 32, 32), (1, 2, 2, 77, 16, 16), (1, 2, 1, 256, 64, 32)):
        q, k, v = _normal(b, hq, s, d), _normal(b, hkv, s, d), _normal(b, hkv, s, dv)
        width = f"d{d}" if d == dv else f"d{d} dv{dv}"
        cases.append(
            _case(
                f"b{b} hq{hq} hkv{hkv} s{s} {width} full",
                s + d,
                ["out", "dq", "dk", "dv"],
                ops.sdpa_attention,
                lambda q, k, v: splash.splash_attention(q, k, v, causal=False, interpret=True),
                [q, k, v],
                _normal(b, hq, s, dv),
            )
        )
    return cases


def gmm_cases() -> list[dict]:
    cases = []
    for m, k, n, sizes, transposed in ((50, 64, 96, (20, 0, 25, 5), True), (130, 32, 48, (0, 70, 60), False)):
        x = _normal(m, k)
        w = _normal(len(sizes), n, k) if transposed else _normal(len(sizes), k, n)
        gs_t, gs_j = torch.tensor(sizes), jnp.asarray(sizes, jnp.int32)
        cases.append(
            _case(
                f"m{m} k{k} n{n} groups{list(sizes)} {'linear-layout' if transposed else 'kn-layout'}",
                max(m, k, n),
                ["out", "dx", "dw"],
                lambda x, w: ops.torch_grouped_mm(x, w.transpose(-2, -1) if transposed else w, gs_t),
                lambda x, w: gmm.grouped_mm(x, w, gs_j, transpose_rhs=transposed, interpret=True),
                [x, w],
                _normal(m, n),
            )
        )
    return cases


def fused_ce_cases() -> list[dict]:
    cases = []
    for n, v, d, ignored in ((100, 300, 64, 7), (37, 1000, 32, 0)):
        h, w = _normal(n, d), _normal(v, d, std=0.3)
        labels = RNG.integers(0, v, n)
        labels[:ignored] = ops.IGNORE_INDEX
        lab_t, lab_j = torch.tensor(labels), jnp.asarray(labels, jnp.int32)
        cases.append(
            _case(
                f"n{n} vocab{v} d{d} ignored{ignored} blocks(64,128)",
                n + v + d,
                ["loss", "dh", "dw"],
                lambda h, w: ops.chunked_linear_cross_entropy(h, w, lab_t, chunk_size=128),
                lambda h, w: fused_ce.linear_cross_entropy(h, w, lab_j, block_n=64, block_v=128, interpret=True),
                [h, w],
                None,
            )
        )
    return cases


def _to_jax(t: torch.Tensor):
    dtype = {torch.bfloat16: jnp.bfloat16, torch.float32: jnp.float32}.get(t.dtype)
    if dtype is None:
        return jnp.asarray(t.numpy())
    return jnp.asarray(t.detach().float().numpy(), dtype=dtype)


def _to_torch(a, dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a, np.float32)).to(dtype)


def _as_torch_op(jax_fn, n_diff: int):
    """A torch function of (n_diff differentiable tensors, *constants) running `jax_fn` (the
    kernel in interpret mode) forward and its JAX VJP backward: what register.py's jax_op
    binding does on a TPU, with numpy in place of the device."""

    class Op(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *tensors):
            diff, const = tensors[:n_diff], [_to_jax(t) for t in tensors[n_diff:]]
            out, vjp = jax.vjp(lambda *d: jax_fn(*d, *const), *[_to_jax(t) for t in diff])
            ctx.vjp, ctx.dtypes, ctx.n_args = vjp, [t.dtype for t in diff], len(tensors)
            return _to_torch(out, tensors[0].dtype if out.dtype != jnp.float32 else torch.float32)

        @staticmethod
        def backward(ctx, grad):
            grads = ctx.vjp(
                _to_jax(grad.contiguous()).astype(grad.dtype == torch.bfloat16 and jnp.bfloat16 or jnp.float32)
            )
            return (*[_to_torch(g, dt) for g, dt in zip(grads, ctx.dtypes)], *([None] * (ctx.n_args - len(grads))))

    return Op.apply


def _interpret_impls() -> dict:
    attention = _as_torch_op(
        lambda q, k, v, *seg: splash.splash_attention(q, k, v, seg[0] if seg else None, interpret=True), 3
    )

    def causal_attention(q, k, v, segment_ids=None):
        return attention(q, k, v) if segment_ids is None else attention(q, k, v, segment_ids.to(torch.int32))

    full = _as_torch_op(lambda q, k, v: splash.splash_attention(q, k, v, causal=False, interpret=True), 3)

    linear_layout = _as_torch_op(
        lambda x, w_nk, sizes: gmm.grouped_mm(x, w_nk, sizes, transpose_rhs=True, interpret=True), 2
    )

    def grouped_mm(x, w, group_sizes):  # as register.py: the experts' [G, N, K] weight, no copy
        return linear_layout(x, w.transpose(-2, -1), group_sizes.to(torch.int32))

    loss = _as_torch_op(lambda h, w, labels: fused_ce.linear_cross_entropy(h, w, labels, interpret=True), 2)

    def linear_cross_entropy(h, w, labels):
        return loss(h, w, labels.to(torch.int32))

    return {
        "causal_attention": causal_attention,
        "attention": full,
        "grouped_mm": grouped_mm,
        "linear_cross_entropy": linear_cross_entropy,
    }


def selfcheck_cases() -> dict:
    from titan_kernels.tpu import selfcheck

    _, verdicts = selfcheck.run(_interpret_impls(), device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=128)
    return {
        v.op: {"ok": v.ok, "worst": v.worst, "reason": v.reason, "tolerance": selfcheck.TOLERANCE} for v in verdicts
    }


def _pallas_names(jaxpr) -> list[str]:
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(str(eqn.params.get("name") or eqn.params.get("name_and_src_info")))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                names.extend(_pallas_names(inner))
    return names


def splash_structure() -> dict:
    out = {}
    for label, docs, causal in (("causal", False, True), ("segments", True, True), ("full", False, False)):
        b, hq, hkv, s, d = 1, 4, 2, 200, 32
        q, k, v = (jnp.asarray(_normal(b, h, s, d)) for h in (hq, hkv, hkv))
        seg = jnp.asarray(np.sort(RNG.integers(0, 3, (b, s)), axis=1).astype(np.int32)) if docs else None
        kw = dict(interpret=True, causal=causal)
        fwd = jax.make_jaxpr(lambda q, k, v: splash.forward(q, k, v, seg, **kw))(q, k, v)
        o, lse = splash.forward(q, k, v, seg, **kw)
        bwd = jax.make_jaxpr(lambda q, k, v, o, lse, do: splash.backward(q, k, v, seg, o, lse, do, **kw))(
            q, k, v, o, lse, jnp.ones_like(o)
        )
        out[label] = {"forward": _pallas_names(fwd.jaxpr), "backward": _pallas_names(bwd.jaxpr)}
    return out


def main() -> None:
    runners = {"splash": splash_cases, "splash_full": splash_full_cases, "gmm": gmm_cases, "fused_ce": fused_ce_cases}
    asked = sys.argv[1:]
    results = {kernel: runners[kernel]() for kernel in asked if kernel in runners}
    extra = {}
    if "selfcheck" in asked:
        extra["selfcheck"] = selfcheck_cases()
    if "splash_structure" in asked:
        extra["splash_structure"] = splash_structure()
    print(json.dumps({"jax": jax.__version__, "torch": torch.__version__, "kernels": results, **extra}))


if __name__ == "__main__":
    main()
