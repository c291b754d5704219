"""Probe: the TPU path of `[quantize]` (titan_kernels/tpu/qmatmul.py) without a TPU.

    python quantize_xla.py cpu                       (xla venv: torch + jax)
    python quantize_xla.py compile [--tokens N] GEN:RECIPE [GEN:RECIPE ...]   (tpuc or ttpu venv)
    python quantize_xla.py register                  (ttpu venv: torch-tpu)
    python quantize_xla.py grouped                   (xla venv: the MoE experts' qgmm.py)
    python quantize_xla.py compile_grouped [--tokens N] GEN:RECIPE ...   (tpuc venv)

`cpu`: the recipe table equals the torch emulation's (models/common/quantize.py RECIPE_SPECS);
forward and both gradients of `qmatmul` run on XLA:CPU for every recipe and are compared with
the torch emulation on the same inputs (odd sizes: K 300, padded tiles). Reports per output the
largest difference over the largest magnitude, and the reduction length n of the bound.

`compile`: one Llama 3 8B decoder block (dim 4096, 32 / 8 heads of 128, SwiGLU 14336, RMSNorm,
causal attention in plain jnp), forward and the gradients of every weight and of the input,
bf16 weights and activations as SimpleFSDP gathers them, `--tokens` tokens (default 4096: 2
sequences of 2048), lowered and compiled by XLA:TPU for device 0 of GEN's compile-only topology,
once with bf16 linears (RECIPE `bf16`; `--no-baseline` skips it) and once with RECIPE's quantized
linears (`--small`: dim 512, 4 / 2 heads, FFN 1024, the test's). Reports the
dots of the compiled program by operand and result dtypes (counted in the HLO text: `dot` and
`convolution` instructions, fusion bodies included), and the compiler's `cost_analysis()`
(flops, bytes accessed, optimal_seconds where libtpu gives it).

`register`: titan_kernels/tpu/qlinear.py defines `titan_tpu::qlinear_fwd / _bwd` through
torch-tpu's `jax_op` (no TPU: jax.export for platform "tpu"), and under `FakeTensorMode` the
forward op with its autograd runs for every recipe on bf16 [512, 256] x [384, 256]: output and
gradient shapes and dtypes.

`grouped`: titan_kernels/tpu/qgmm.py's forward and both gradients on XLA:CPU against the torch
reference `emulated_grouped_mm` for every recipe (experts of GROUP_SIZES rows, 12 rows past the
sum, K 300, N 72), beside the dense op on each expert's rows alone; per output the largest
differences and the reduction length n.

`compile_grouped`: qgmm.grouped_mm (forward and gradients) compiled by XLA:TPU for device 0 of
GEN's compile-only topology; its matmuls by kind and operand / result types.

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "titan_kernels" / "tpu"))
import qgmm  # noqa: E402
import qmatmul  # noqa: E402


def cpu_check() -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from models.common import quantize as tq

    def spec_of(op):
        if op.dtype is None:
            return None
        name = {tq.E4M3: "e4m3", tq.E5M2: "e5m2", tq.INT8: "int8"}[op.dtype]
        return (name, op.granularity, op.pow2)

    torch_table = {
        name: tuple((spec_of(m.a), spec_of(m.b)) for m in (r.forward, r.grad_input, r.grad_weight))
        for name, r in tq.RECIPE_SPECS.items()
    }
    rng = np.random.default_rng(0)
    m, k, n = 96, 300, 72
    cases = {}

    def err(a, b):
        b = b.detach().double().numpy()
        return {"diff": float(np.abs(a - b).max()), "scale": float(np.abs(b).max())}

    for recipe in qmatmul.RECIPES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        dy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
        y = np.asarray(jax.jit(qmatmul.forward, static_argnums=2)(x, w, recipe))
        dx, dw = (np.asarray(t) for t in jax.jit(qmatmul.backward, static_argnums=3)(x, w, dy, recipe))
        tx = torch.from_numpy(x).requires_grad_()
        tw = torch.from_numpy(w).requires_grad_()
        ty = tq.emulated_linear(tx, tw, recipe)
        ty.backward(torch.from_numpy(dy))
        cases[recipe] = {
            "y": {**err(y, ty), "n": k},
            "dx": {**err(dx, tx.grad), "n": n},
            "dw": {**err(dw, tw.grad), "n": m},
        }
    # The float8 all-gather's weight (float8_tensorwise): qmatmul.forward_w8 / backward_w8 on the
    # float8 weight and its scale against the emulation on the same values.
    recipe = "float8_tensorwise"
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
    dy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
    tq_values, tq_scale = tq.quantize(torch.from_numpy(w), tq.Operand(tq.E4M3))
    values = tq_values.reshape(n, k)
    w_q = jnp.asarray(values.to(tq.E4M3).view(torch.uint8).numpy()).view(jnp.float8_e4m3fn)
    w_scale = jnp.asarray(tq_scale.reshape(()).numpy())
    y = np.asarray(jax.jit(qmatmul.forward_w8, static_argnums=3)(x, w_q, w_scale, recipe))
    dx, dw = (np.asarray(t) for t in jax.jit(qmatmul.backward_w8, static_argnums=4)(x, w_q, w_scale, dy, recipe))
    tx = torch.from_numpy(x).requires_grad_()
    tw = values.clone().requires_grad_()
    ty = tq.emulated_linear(tx, tw, recipe, tq_scale.reshape(()))
    ty.backward(torch.from_numpy(dy))
    cases["float8_tensorwise_w8"] = {
        "y": {**err(y, ty), "n": k},
        "dx": {**err(dx, tx.grad), "n": n},
        "dw": {**err(dw, tw.grad), "n": m},
    }
    return {"tables_equal": torch_table == qmatmul.RECIPES, "cases": cases}


GROUP_SIZES = (37, 0, 150, 61)
"""`grouped`: unequal experts, an empty one, boundaries inside 128-row tiles, 12 rows past the sum."""


def grouped_check() -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from models.common import quantize as tq

    rng = np.random.default_rng(1)
    m, k, n = sum(GROUP_SIZES) + 12, 300, 72
    sizes = np.asarray(GROUP_SIZES, np.int32)
    cases = {}
    for recipe in qgmm.RECIPES:
        x = rng.standard_normal((m, k)).astype(np.float32)
        x[: GROUP_SIZES[0]] *= 1000.0  # one expert's outliers must not move another's scales
        w = (rng.standard_normal((len(sizes), n, k)) * 0.02).astype(np.float32)
        dy = (rng.standard_normal((m, n)) * 1e-3).astype(np.float32)
        y = np.asarray(jax.jit(qgmm.forward, static_argnums=3)(x, w, sizes, recipe))
        dx, dw = (np.asarray(t) for t in jax.jit(qgmm.backward, static_argnums=4)(x, w, sizes, dy, recipe))
        y_vjp, (dx_vjp, dw_vjp) = jax.jit(
            lambda a, b, c: (lambda out, vjp: (out, vjp(c)))(
                *jax.vjp(lambda a, b: qgmm.grouped_mm(a, b, sizes, recipe), a, b)
            )
        )(x, w, dy)
        # The custom_vjp (what the compile check differentiates) against the two halves: the same
        # products, summed in whatever order each compiled program picks.
        vjp_diff = max(
            float(np.abs(np.asarray(a) - b).max() / max(np.abs(b).max(), 1e-30))
            for a, b in ((y_vjp, y), (dx_vjp, dx), (dw_vjp, dw))
        )
        tx = torch.from_numpy(x).requires_grad_()
        tw = torch.from_numpy(w).requires_grad_()
        ty = tq.emulated_grouped_mm(tx, tw.transpose(-2, -1), torch.from_numpy(sizes).long(), recipe)
        ty.backward(torch.from_numpy(dy))
        torch_out = {"y": ty.detach().numpy(), "dx": tx.grad.numpy(), "dw": tw.grad.numpy()}
        # The dense op (qmatmul) on each expert's rows alone, stitched: what the grouped op must equal.
        dense = {"y": np.zeros_like(y), "dx": np.zeros_like(dx), "dw": np.zeros_like(dw)}
        start = 0
        for g, size in enumerate(GROUP_SIZES):
            if size:
                rows = slice(start, start + size)
                dense["y"][rows] = np.asarray(jax.jit(qmatmul.forward, static_argnums=2)(x[rows], w[g], recipe))
                ddx, ddw = jax.jit(qmatmul.backward, static_argnums=3)(x[rows], w[g], dy[rows], recipe)
                dense["dx"][rows], dense["dw"][g] = np.asarray(ddx), np.asarray(ddw)
            start += size

        def err(name, a, n_sum, index=slice(None)):
            ref = torch_out[name][index].astype(np.float64)
            return {
                "diff": float(np.abs(a[index] - ref).max()),
                "dense_diff": float(np.abs(dense[name][index] - ref).max()),
                "self_diff": float(np.abs(a[index] - dense[name][index]).max()),
                "scale": float(np.abs(ref).max()),
                "n": n_sum,
            }

        outputs = {"y": err("y", y, k), "dx": err("dx", dx, n)}
        for g, size in enumerate(GROUP_SIZES):
            if size:
                outputs[f"dw{g}"] = err("dw", dw, size, g)
        end = sum(GROUP_SIZES)
        cases[recipe] = {
            "outputs": outputs,
            "empty_expert_dw_zero": bool(not np.any(dw[1]) and not np.any(torch_out["dw"][1])),
            "rows_past_sum_zero": bool(not np.any(y[end:]) and not np.any(dx[end:])),
            "custom_vjp_diff": vjp_diff,
        }
    return {"group_sizes": list(GROUP_SIZES), "shape": [m, k, n], "cases": cases}


DIM, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
SMALL = dict(DIM=512, HEADS=4, KV_HEADS=2, HEAD_DIM=128, FFN=1024)
"""`--small`: the same block at widths that compile in seconds (the test's)."""


def _rmsnorm(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + 1e-5)).astype(x.dtype) * w


W8 = "float8_tensorwise_w8"
"""`compile`'s name for float8_tensorwise with SimpleFSDP's float8 all-gather: each linear's weight
enters the block as the gathered float8_e4m3fn tensor and its scale (qmatmul.forward_w8 /
backward_w8), its gradient through a zero carrier, as the trainer's op does."""


def _w8_linear_fwd(h, carrier, w_q, w_scale):
    return qmatmul.forward_w8(h, w_q, w_scale, "float8_tensorwise"), (h, w_q, w_scale)


def _w8_linear_bwd(saved, dy):
    h, w_q, w_scale = saved
    dx, dw = qmatmul.backward_w8(h, w_q, w_scale, dy, "float8_tensorwise")
    return dx, dw, None, None


_w8_linear = jax.custom_vjp(lambda h, carrier, w_q, w_scale: _w8_linear_fwd(h, carrier, w_q, w_scale)[0])
_w8_linear.defvjp(_w8_linear_fwd, _w8_linear_bwd)


def block(params, x, recipe: str, seq: int):
    """One decoder block on x [tokens, dim] (sequences of `seq`), bf16. Under `W8` a linear weight
    is the triple (float8 values, scale, carrier)."""

    def lin(h, w):
        if recipe == "bf16":  # bf16 operands and result (the MXU accumulates in f32), as torch's bf16 linear
            return jax.lax.dot_general(h, w, (((1,), (1,)), ((), ())), preferred_element_type=h.dtype)
        if recipe == W8:
            w_q, w_scale, carrier = w
            return _w8_linear(h, carrier, w_q, w_scale)
        return qmatmul.linear(h, w, recipe)

    t = x.shape[0]
    b = t // seq
    h = _rmsnorm(x, params["attention_norm"])
    q = lin(h, params["wq"]).reshape(b, seq, HEADS, HEAD_DIM)
    k = lin(h, params["wk"]).reshape(b, seq, KV_HEADS, HEAD_DIM)
    v = lin(h, params["wv"]).reshape(b, seq, KV_HEADS, HEAD_DIM)
    k = jnp.repeat(k, HEADS // KV_HEADS, axis=2)
    v = jnp.repeat(v, HEADS // KV_HEADS, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) / HEAD_DIM**0.5
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1).astype(x.dtype)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(t, HEADS * HEAD_DIM)
    y = x + lin(o, params["wo"])
    h2 = _rmsnorm(y, params["ffn_norm"])
    z = lin(jax.nn.silu(lin(h2, params["w1"])) * lin(h2, params["w3"]), params["w2"])
    return y + z


def _shapes() -> dict:
    """The block's parameter shapes at the module's widths (read at call time: `--small`)."""
    return {
        "attention_norm": (DIM,),
        "ffn_norm": (DIM,),
        "wq": (HEADS * HEAD_DIM, DIM),
        "wk": (KV_HEADS * HEAD_DIM, DIM),
        "wv": (KV_HEADS * HEAD_DIM, DIM),
        "wo": (DIM, HEADS * HEAD_DIM),
        "w1": (FFN, DIM),
        "w3": (FFN, DIM),
        "w2": (DIM, FFN),
    }


_DEF = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[", re.M)
_DOT = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\w+)\[[^\n]*? (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", re.M)


def dots(hlo: str) -> dict[str, int]:
    """Dot / convolution instructions of a compiled HLO module by 'lhs x rhs -> result' element
    types; an operand's type is that of the instruction defining it (names are module-unique)."""
    types = dict(_DEF.findall(hlo))
    found = collections.Counter(
        f"{types.get(lhs, '?')} x {types.get(rhs, '?')} -> {out}" for out, lhs, rhs in _DOT.findall(hlo)
    )
    return dict(sorted(found.items()))


_SHLO_DOT = re.compile(r"stablehlo.dot_general.*?: \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")


def stablehlo_dots(text: str) -> dict[str, int]:
    """`stablehlo.dot_general` ops of the lowered program by operand and result element types."""
    found = collections.Counter(
        f"{a.split('x')[-1]} x {b.split('x')[-1]} -> {c.split('x')[-1]}" for a, b, c in _SHLO_DOT.findall(text)
    )
    return dict(sorted(found.items()))


def compile_block(gen: str, recipe: str, tokens: int, seq: int) -> dict:
    import tiles
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=tiles.GENERATIONS[gen].topology, platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    S = jax.ShapeDtypeStruct
    params = {name: S(shape, jnp.bfloat16, sharding=sharding) for name, shape in _shapes().items()}
    x = S((tokens, DIM), jnp.bfloat16, sharding=sharding)
    cot = S((tokens, DIM), jnp.bfloat16, sharding=sharding)

    def step(params, x, cot):
        out, vjp = jax.vjp(lambda p, xx: block(p, xx, recipe, seq), params, x)
        return vjp(cot)

    if recipe == W8:  # the linears' weights arrive as float8 and a scale; the gradients reach carriers
        linears = [name for name in params if name.startswith("w")]
        quantized = {
            n: (S(params[n].shape, jnp.float8_e4m3fn, sharding=sharding), S((), jnp.float32, sharding=sharding))
            for n in linears
        }
        params = {n: p for n, p in params.items() if n not in linears}

        def step(params, quantized, x, cot):  # noqa: F811
            def f(norms, carriers, xx):
                full = {**norms, **{n: (*quantized[n], carriers[n]) for n in linears}}
                return block(full, xx, recipe, seq)

            carriers = {n: jnp.zeros(quantized[n][0].shape, jnp.bfloat16) for n in linears}
            out, vjp = jax.vjp(f, params, carriers, x)
            return vjp(cot)

        params = (params, quantized)
        lowered_args = (*params, x, cot)
    else:
        lowered_args = (params, x, cot)

    start = time.perf_counter()
    lowered = jax.jit(step).lower(*lowered_args)
    compiled = lowered.compile()
    entry = {"device_kind": device.device_kind, "compile_s": round(time.perf_counter() - start, 1)}
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    entry["cost"] = {
        k: float(v) for k, v in (cost or {}).items() if k in ("flops", "bytes accessed", "optimal_seconds")
    }
    try:
        entry["dots"], entry["counted_in"] = dots(compiled.as_text()), "compiled"
    except Exception as e:  # jaxlib cannot always print what libtpu compiled
        entry["dots"], entry["counted_in"] = {}, f"none ({type(e).__name__})"
    entry["stablehlo_dots"] = stablehlo_dots(lowered.as_text())
    return entry


_OP = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[[^\n]*? (dot|convolution|custom-call)\(([^)]*)\)([^\n]*)", re.M)


def ragged_dots(hlo: str) -> dict[str, int]:
    """The compiled program's matmuls by 'kind: operand types -> result': `dot` / `convolution`
    instructions, and XLA:TPU's ragged-dot kernels (custom calls named ragged-dot-*, whose last two
    operands are the matrices; the others are its group metadata)."""
    types = dict(_DEF.findall(hlo))
    found = collections.Counter()
    for name, out, kind, args, rest in _OP.findall(hlo):
        operands = [types.get(a.split("*/")[-1].strip().lstrip("%"), "?") for a in args.split(",") if a.strip()]
        if kind == "custom-call":
            if not name.startswith("ragged-dot") or "tpu_custom_call" not in rest:
                continue
            kind = "ragged-dot"
        found[f"{kind}: {' x '.join(operands[-2:])} -> {out}"] += 1
    return dict(sorted(found.items()))


_ENTRY_VALUE = re.compile(r"^\s*(?:ROOT )?%[\w.\-]+ = (\w+\[[\d,]*\])", re.M)


def token_buffers(hlo: str, tokens: int) -> list[str]:
    """The compiled program's top-level values (ENTRY's instructions: each its own buffer) of
    `tokens` rows and more than one column in float32 or wider, parameters aside: e.g. a
    matmul's float32 product or a gather of scales to every row."""
    entry = hlo[hlo.index("\nENTRY") :]
    values = _ENTRY_VALUE.findall("\n".join(line for line in entry.splitlines() if " parameter(" not in line))
    return sorted(
        v for v in values if v.startswith(("f32[", "s32[", "f64[")) and v.split("[")[1].startswith(f"{tokens},")
    )


def compile_grouped(gen: str, recipe: str, tokens: int) -> dict:
    """qgmm.grouped_mm (forward output and both gradients) at x [tokens, 512], w [8, 256, 512]
    bf16, group sizes a runtime array, compiled by XLA:TPU for device 0 of GEN's topology: its
    matmuls, its top-level float32 [tokens, C] values and its temporary bytes."""
    import tiles
    from jax.experimental import topologies

    device = topologies.get_topology_desc(topology_name=tiles.GENERATIONS[gen].topology, platform="tpu").devices[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    S = jax.ShapeDtypeStruct
    x = S((tokens, 512), jnp.bfloat16, sharding=sharding)
    w = S((8, 256, 512), jnp.bfloat16, sharding=sharding)
    sizes = S((8,), jnp.int32, sharding=sharding)
    cot = S((tokens, 256), jnp.bfloat16, sharding=sharding)

    def step(x, w, sizes, cot):
        y, vjp = jax.vjp(lambda a, b: qgmm.grouped_mm(a, b, sizes, recipe), x, w)
        return y, vjp(cot)

    start = time.perf_counter()
    compiled = jax.jit(step).lower(x, w, sizes, cot).compile()
    hlo = compiled.as_text()
    return {
        "compile_s": round(time.perf_counter() - start, 1),
        "matmuls": ragged_dots(hlo),
        "wide_token_values": token_buffers(hlo, tokens),
        "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
    }


def register_check() -> dict:
    import traceback

    import torch
    import torch_tpu  # noqa: F401  (explicit: autoload is off in tests)
    from torch._subclasses.fake_tensor import FakeTensorMode

    sys.path.insert(0, str(ROOT))
    from titan_kernels.tpu import qlinear

    def check(fn) -> str:
        try:
            with FakeTensorMode():
                fn()
            return "ok"
        except Exception as e:
            return f"{type(e).__name__}: {e}"[:1500] + "\n" + traceback.format_exc()[-1500:]

    qlinear.build()
    qlinear.build_grouped()
    fwd = torch.ops.titan_tpu.qlinear_fwd
    checks = {}
    for recipe in qmatmul.RECIPES:

        def dense(recipe=recipe):
            x = torch.empty(512, 256, dtype=torch.bfloat16).requires_grad_()
            w = torch.empty(384, 256, dtype=torch.bfloat16).requires_grad_()
            y = fwd(x, w, recipe)
            assert y.shape == (512, 384) and y.dtype == torch.bfloat16, y
            dx, dw = torch.autograd.grad(y.float().sum(), (x, w))
            assert dx.shape == x.shape and dw.shape == w.shape and dx.dtype == torch.bfloat16

        def grouped(recipe=recipe):
            # The experts' op as the MoE layer calls it: w [G, K, N], group sizes int32 on the device.
            x = torch.empty(512, 256, dtype=torch.bfloat16).requires_grad_()
            w = torch.empty(4, 256, 384, dtype=torch.bfloat16).requires_grad_()
            sizes = torch.empty(4, dtype=torch.int32)
            y = torch.ops.titan_tpu.qgmm_fwd(x, w.transpose(-2, -1).contiguous(), sizes, recipe)
            assert y.shape == (512, 384) and y.dtype == torch.bfloat16, y
            dx, dw = torch.autograd.grad(y.float().sum(), (x, w))
            assert dx.shape == x.shape and dw.shape == w.shape and dw.dtype == torch.bfloat16

        checks[recipe] = check(dense)
        checks[f"grouped:{recipe}"] = check(grouped)

    def w8():
        # SimpleFSDP's float8 all-gather through the autograd.Function the implementation wraps
        # qlinear_w8_fwd / _bwd in: the float8 weight, its scale and the gradient's carrier.
        x = torch.empty(512, 256, dtype=torch.bfloat16).requires_grad_()
        w_q = torch.empty(384, 256, dtype=torch.float8_e4m3fn)
        scale = torch.empty((), dtype=torch.float32)
        carrier = torch.zeros((), dtype=torch.bfloat16).expand(384, 256).requires_grad_()
        y = qlinear._BUILT["w8"].apply(x, carrier, w_q, scale, "float8_tensorwise")
        assert y.shape == (512, 384) and y.dtype == torch.bfloat16, y
        dx, dw = torch.autograd.grad(y.float().sum(), (x, carrier))
        assert dx.shape == x.shape and dw.shape == (384, 256) and dw.dtype == torch.bfloat16

    def w8_ops():
        x = torch.empty(512, 256, dtype=torch.bfloat16)
        w_q = torch.empty(384, 256, dtype=torch.float8_e4m3fn)
        scale = torch.empty((), dtype=torch.float32)
        y = torch.ops.titan_tpu.qlinear_w8_fwd(x, w_q, scale, "float8_tensorwise")
        assert y.shape == (512, 384) and y.dtype == torch.bfloat16, y
        dx, dw = torch.ops.titan_tpu.qlinear_w8_bwd(x, w_q, scale, y, "float8_tensorwise")
        assert dx.shape == x.shape and dw.shape == (384, 256) and dw.dtype == torch.bfloat16

    checks["w8_ops"] = check(w8_ops)
    checks["w8_autograd"] = check(w8)
    names = sorted(n for n in dir(torch.ops.titan_tpu) if n.startswith(("qlinear", "qgmm")))
    return {"ops": names, "checks": checks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("cpu", "grouped", "compile", "compile_grouped", "register"))
    parser.add_argument("targets", nargs="*", help="GEN:RECIPE, e.g. v7x:float8_rowwise (compile)")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--small", action="store_true", help="the block at SMALL's widths")
    parser.add_argument("--no-baseline", action="store_true", help="skip the bf16 compile")
    args = parser.parse_args()
    if args.small:
        globals().update(SMALL)
    import importlib.metadata as md

    versions = {}
    for p in ("jax", "jaxlib", "libtpu"):
        try:
            versions[p] = md.version(p)
        except md.PackageNotFoundError:
            pass
    if args.mode == "cpu":
        print(json.dumps({"versions": versions, **cpu_check()}))
        return
    if args.mode == "grouped":
        print(json.dumps({"versions": versions, **grouped_check()}))
        return
    if args.mode == "register":
        print(json.dumps({"versions": versions, **register_check()}))
        return
    if args.mode == "compile_grouped":
        compiles = {}
        for target in args.targets:
            try:
                compiles[target] = compile_grouped(*target.split(":"), args.tokens)
            except Exception as e:
                compiles[target] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        print(json.dumps({"versions": versions, "tokens": args.tokens, "compiles": compiles}))
        return
    compiles = {}
    for target in args.targets:
        gen, recipe = target.split(":")
        for r in (recipe,) if args.no_baseline else ("bf16", recipe):
            key = f"{gen}:{r}"
            if key in compiles:
                continue
            try:
                compiles[key] = compile_block(gen, r, args.tokens, args.seq)
            except Exception as e:
                compiles[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
    widths = {"dim": DIM, "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "ffn": FFN}
    print(
        json.dumps(
            {"versions": versions, "tokens": args.tokens, "seq": args.seq, "widths": widths, "compiles": compiles}
        )
    )


if __name__ == "__main__":
    main()
