"""Probe: splash attention with sinks and a sliding window (titan_kernels/tpu/splash.py `sink_*`).

    python sink_splash.py interpret          (xla venv: Pallas interpret mode on the CPU, torch)
    python sink_splash.py compile GEN [...]  (tpuc venv: deviceless Mosaic + XLA:TPU compile)
    python sink_splash.py register           (ttpu venv: the torch-tpu ops on fake tensors)
    python sink_splash.py selfcheck          (xla venv: the start-up self-check on the real kernel, bf16)

interpret: forward and backward (q, k, v, sinks) of `splash_sink_attention` in float32 against the
op's torch reference `ops.sdpa_sink_attention` (gpt-oss's formulation) on the same inputs, both
compared with that reference in float64 (the "exact" value), with a fixed random cotangent; GQA,
lengths that are not a multiple of the 128 tile, a window, full layers, segment ids, and the
traced window (an int32 array picking the sliding or the causal kernel on the device, as a layer
scan hands it). Prints one JSON line {"cases": [{"case", "n", "outputs": {name: {"pallas_err",
"torch_err", "scale"}}, "seconds"}]}.

compile: forward + backward from residuals with the traced window (both kernels in the program),
bf16, GQA 8 / 2, 1000 tokens (padded to 1024), head_dim 64 (gpt-oss), window 128, segment ids,
for device 0 of each generation's compile-only topology, with that generation's tiles. Prints
{"versions", "compiles": {gen: {"compile_s", "mosaic_calls"} | {"error"}}}.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "titan_kernels" / "tpu"))
import splash  # noqa: E402

RNG = np.random.default_rng(0)


def _normal(*shape, std=1.0):
    return (RNG.standard_normal(shape) * std).astype(np.float32)


CASES = (
    # (b, hq, hkv, s, d, window, sliding_window for a traced window or None, segment ids)
    (2, 4, 2, 200, 32, 48, None, False),  # sliding, GQA, padded 200 -> 256
    (1, 4, 2, 200, 32, 0, None, True),  # full causal with documents
    (1, 2, 1, 300, 64, 100, None, True),  # window across a document boundary, MQA, 3 tiles
    (1, 4, 2, 200, 32, 48, 48, False),  # traced window holding 48: the sliding kernel runs
    (1, 4, 2, 200, 32, 0, 48, False),  # traced window holding 0: the causal kernel runs
)


def interpret(cases) -> dict:
    import torch

    from models.common import ops

    def vjp_torch(fn, inputs, cot, dtype):
        ts = [torch.tensor(x, dtype=dtype, requires_grad=True) for x in inputs]
        out = fn(*ts)
        grads = torch.autograd.grad(out, ts, torch.tensor(cot, dtype=dtype))
        return [out.detach().double().numpy()] + [g.double().numpy() for g in grads]

    def vjp_jax(fn, inputs, cot):
        out, vjp = jax.vjp(fn, *[jnp.asarray(x) for x in inputs])
        return [np.asarray(out, np.float64)] + [np.asarray(g, np.float64) for g in vjp(jnp.asarray(cot))]

    results = []
    for b, hq, hkv, s, d, window, traced, docs in cases:
        q, k, v = _normal(b, hq, s, d), _normal(b, hkv, s, d), _normal(b, hkv, s, d)
        sinks = _normal(hq)
        seg = np.sort(RNG.integers(0, 3, (b, s)), axis=1).astype(np.int32) if docs else None
        seg_t = None if seg is None else torch.tensor(seg, dtype=torch.int64)
        seg_j = None if seg is None else jnp.asarray(seg)
        window_t = torch.tensor(window, dtype=torch.int64)
        if traced is None:
            label, jax_window, sliding = f"window {window}", window, 0
        else:
            label, jax_window, sliding = f"traced window {window} of {traced}", jnp.asarray([window], jnp.int32), traced

        def torch_fn(q, k, v, sinks, seg_t=seg_t, window_t=window_t):
            return ops.sdpa_sink_attention(q, k, v, sinks, window_t, seg_t)

        def jax_fn(q, k, v, sinks, seg_j=seg_j, jax_window=jax_window, sliding=sliding):
            return splash.splash_sink_attention(
                q, k, v, sinks, jax_window, seg_j, sliding_window=sliding, interpret=True
            )

        inputs, cot = [q, k, v, sinks], _normal(b, hq, s, d)
        start = time.perf_counter()
        exact = vjp_torch(torch_fn, inputs, cot, torch.float64)
        ref32 = vjp_torch(torch_fn, inputs, cot, torch.float32)
        pallas = vjp_jax(jax_fn, inputs, cot)
        names = ["out", "dq", "dk", "dv", "dsinks"]
        results.append(
            {
                "case": f"b{b} hq{hq} hkv{hkv} s{s} d{d} {label}{' segments' if docs else ''}",
                # The longest float32 reduction: a row's s keys and d channels; dsinks: b s rows of d.
                "n": {name: (b * s + d if name == "dsinks" else s + d) for name in names},
                "outputs": {
                    name: {
                        "pallas_err": float(np.abs(p - e).max()),
                        "torch_err": float(np.abs(t - e).max()),
                        "scale": float(np.abs(e).max()),
                    }
                    for name, e, p, t in zip(names, exact, pallas, ref32)
                },
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
    return {"jax": jax.__version__, "torch": torch.__version__, "cases": results}


def selfcheck_bf16() -> dict:
    """The start-up self-check (titan_kernels/tpu/selfcheck.py) with the real kernel in interpret
    mode as its implementation, bf16 (bf16 operands, float32 accumulation, as the MXU), at
    gpt-oss's head width 64 and window 128: {"ok", "worst", "reason", "tolerance"}."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kernels_interpret import _as_torch_op

    from titan_kernels.tpu import selfcheck

    window = 128
    plain = _as_torch_op(
        lambda q, k, v, sinks, win: splash.splash_sink_attention(
            q, k, v, sinks, win, sliding_window=window, interpret=True
        ),
        4,
    )
    segmented = _as_torch_op(
        lambda q, k, v, sinks, win, seg: splash.splash_sink_attention(
            q, k, v, sinks, win, seg, sliding_window=window, interpret=True
        ),
        4,
    )

    def sink_attention(q, k, v, sinks, win, segment_ids=None, sliding_window=0):
        assert sliding_window == window, sliding_window
        win = win.reshape(1).to(torch.int32)
        if segment_ids is None:
            return plain(q, k, v, sinks, win)
        return segmented(q, k, v, sinks, win, segment_ids.to(torch.int32))

    shapes = selfcheck.KernelShapes(qk_head_dim=64, v_head_dim=64, sliding_window=window)
    v = selfcheck.check(
        "sink_attention", sink_attention, device=torch.device("cpu"), dtype=torch.bfloat16, shapes=shapes
    )
    return {"ok": v.ok, "worst": v.worst, "reason": v.reason, "tolerance": selfcheck.TOLERANCE, "checked": v.checked}


def compile_for(generations: list[str]) -> dict:
    import tiles
    from jax.experimental import topologies

    b, hq, hkv, s, d, window = 1, 8, 2, 1000, 64, 128
    bf16, S = jnp.bfloat16, jax.ShapeDtypeStruct

    def step(q, k, v, sinks, win, seg, do, gen):
        kw = dict(sliding_window=window, generation=gen)
        out, lse = splash.sink_forward(q, k, v, sinks, win, seg, **kw)
        return out, splash.sink_backward(q, k, v, sinks, win, seg, out, lse, do, **kw)

    result = {"versions": {"jax": jax.__version__}, "compiles": {}}
    try:
        from importlib.metadata import version

        result["versions"]["libtpu"] = version("libtpu")
    except Exception:  # noqa: BLE001 - a version string only
        pass
    for gen in generations:
        dev = topologies.get_topology_desc(topology_name=tiles.GENERATIONS[gen].topology, platform="tpu").devices[0]
        sharding = jax.sharding.SingleDeviceSharding(dev)
        avals = [
            S((b, hq, s, d), bf16),
            S((b, hkv, s, d), bf16),
            S((b, hkv, s, d), bf16),
            S((hq,), jnp.float32),
            S((1,), jnp.int32),
            S((b, s), jnp.int32),
            S((b, hq, s, d), bf16),
        ]
        placed = [S(a.shape, a.dtype, sharding=sharding) for a in avals]
        start = time.perf_counter()
        try:
            lowered = jax.jit(lambda *a, gen=gen: step(*a, gen)).lower(*placed)
            compiled = lowered.compile()
            try:
                text = compiled.as_text()
            except Exception:  # noqa: BLE001 - count in the lowered module instead
                text = lowered.as_text()
            result["compiles"][gen] = {
                "compile_s": round(time.perf_counter() - start, 1),
                "mosaic_calls": text.count("tpu_custom_call"),
                "blocks": list(tiles.splash_blocks(gen, 1024, d)),
                "device": dev.device_kind,
            }
        except Exception as exc:  # noqa: BLE001 - recorded for the test to print
            result["compiles"][gen] = {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}
    return result


def register_checks() -> dict:
    """ttpu venv: titan_kernels/tpu/register.py's `sink_attention` under torch-tpu (no TPU): the
    `titan_tpu::sink_splash_w*` ops defined through jax_op, run forward and backward on fake
    tensors (shapes from `jax.export` of the kernels for TPU) with a tensor window (the kernel
    picked on the device), an int window and segment ids."""
    import traceback

    import torch
    import torch_tpu  # noqa: F401  (explicit: autoload is off in tests)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_kernels.tpu import register

    impls = register.build()
    register._on_tpu = lambda *tensors: True
    bf16 = torch.bfloat16

    def leaf(*shape):
        return torch.empty(*shape, dtype=bf16).requires_grad_(True)

    def call(window, sliding, segments):
        q, k, v, sinks = leaf(2, 8, 200, 64), leaf(2, 2, 200, 64), leaf(2, 2, 200, 64), leaf(8)
        seg = torch.zeros(2, 200, dtype=torch.int64) if segments else None
        if sliding:  # the model's per-layer buffer: a 0-dim int64 tensor (made fake here)
            window = torch.tensor(window, dtype=torch.int64)
        out = impls["sink_attention"](q, k, v, sinks, window, seg, sliding)
        assert out.shape == q.shape and out.dtype == bf16, out
        grads = torch.autograd.grad(out.float().sum(), (q, k, v, sinks))
        assert [g.shape for g in grads] == [t.shape for t in (q, k, v, sinks)], grads

    checks = {}
    for name, args in (
        ("tensor_window", (128, 128, False)),
        ("tensor_window_segments", (0, 128, True)),
        ("int_window", (64, 0, False)),
    ):
        try:
            with FakeTensorMode():
                call(*args)
            checks[name] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported, the test asserts
            checks[name] = f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc()[-1500:]
    names = sorted(n for n in dir(torch.ops.titan_tpu) if n.startswith("sink_splash"))
    saved = sorted(op.name() for op in register.saved_ops() if "sink" in op.name())
    return {"ops": names, "saved": saved, "checks": checks}


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "compile":
        print(json.dumps(compile_for(rest)))
    elif mode == "selfcheck":
        print(json.dumps(selfcheck_bf16()))
    elif mode == "register":
        print(json.dumps(register_checks()))
    else:
        print(json.dumps(interpret(CASES)))
