"""Probe: the chunked gated delta rule's Pallas kernel (titan_kernels/tpu/delta_rule.py).

    python delta_rule.py interpret [small] [selfcheck]  # xla venv: interpret mode vs the references
    python delta_rule.py compile GEN...      # tpuc venv: deviceless Mosaic + XLA:TPU compile
    python delta_rule.py register            # ttpu venv: the torch-tpu op on fake tensors
    python delta_rule.py capture             # ttpu venv: estimate_xla's capture ops, lowered

`interpret`: each case runs the op as a TPU run composes it (titan_kernels/tpu/register.py: the
torch side `gated_delta._prepare`, then the JAX op `delta_rule.gated_delta_rule`, whose forward
and backward are the Pallas kernels in Pallas' interpreter), float32, forward (output and final
state) and a VJP with fixed random cotangents for both outputs (gradients of q, k, v, g, beta,
the initial state). The same inputs go through the torch reference
`gated_delta.chunk_gated_delta_rule` (float32) and through the token-by-token recurrence in
float64 written here (the exact value). Errors are max |x - exact|, `scale` max |exact|.
`export`: the forward and backward ops exported for TPU (Mosaic lowering, no device): their
Mosaic calls and triangular solves. `control`: the kernel with the documents case's resets
dropped, against the exact value with them (what a wrong mask costs). `small`: the first case
only. `selfcheck`: also the start-up self-check (titan_kernels/tpu/selfcheck.py) with this kernel
as the implementation, bf16 inputs, dk = dv = 128: {"selfcheck": {"ok", "worst", "reason",
"tolerance"}}.

`compile GEN...`: forward (the Mosaic kernel) and forward + backward (three kernels) at Qwen 3.5 9B's
Gated DeltaNet widths (32 value heads of dk = dv = 128) over 4096 tokens, lowered for and
compiled on each generation's compile-only device (tiles.GENERATIONS topology). Reports the
compile time, the Mosaic calls in the compiled program, the compiler's memory analysis and the
kernel's VMEM per grid step (`delta_rule.vmem_bytes`) beside the scoped limit.

`register`: `register._build_gated_delta(torch.tpu.pallas.jax_op)` defines
`titan_tpu::gated_delta_fwd / _bwd`; under FakeTensorMode (shapes only) the implementation runs
forward and backward with GQA, an initial state and resets; shapes and dtypes are checked.
`capture`: scripts/estimate_xla.py's capture ops lowered (not compiled) by
`capture.add_lowerings` over a compile-only v6e:2x2 mesh: {"lowered": {"fwd"|"bwd":
{"mosaic_calls"}}, "costs": [[kernel, FLOPs, bytes]]}.

Prints one JSON line.
"""

from __future__ import annotations

import json
import sys
import time

CASES = (
    # name, b, s, k_heads, v_heads, dk, dv, resets, initial state
    ("gqa_padded_state", 1, 150, 1, 2, 32, 16, (), True),
    ("documents_two_chunks", 2, 128, 2, 2, 16, 32, (5, 64, 100), True),
    ("short_documents_no_state", 1, 40, 2, 4, 16, 16, (0, 17), False),
)


def _inputs(b, s, hk, hv, dk, dv, resets, with_state, seed):
    import numpy as np

    rng = np.random.default_rng(seed)
    f = np.float32
    q = rng.standard_normal((b, s, hk, dk)).astype(f)
    k = rng.standard_normal((b, s, hk, dk)).astype(f)
    v = rng.standard_normal((b, s, hv, dv)).astype(f)
    g = (-np.log1p(np.exp(rng.standard_normal((b, s, hv))))).astype(f)  # -softplus: log decays <= 0
    beta = (1.0 / (1.0 + np.exp(-rng.standard_normal((b, s, hv))))).astype(f)
    h0 = (rng.standard_normal((b, hv, dk, dv)) * 0.5).astype(f) if with_state else None
    reset = np.zeros((b, s), bool)
    for i, t in enumerate(resets):
        reset[i % b, t] = True  # different documents per row
    cot_out = rng.standard_normal((b, s, hv, dv)).astype(f)
    cot_state = rng.standard_normal((b, hv, dk, dv)).astype(f)
    return [q, k, v, g, beta, h0], reset, cot_out, cot_state


def _recurrent64(q, k, v, g, beta, h0, reset):
    """The definition, token by token, float64 (q/k l2-normalised, GQA repeated, q scaled)."""
    import torch

    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    b, s, h, dk = k.shape
    state = h0 if h0 is not None else torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64)
    keep = (~reset).to(torch.float64)
    outs = []
    for t in range(s):
        state = state * (g[:, t].exp() * keep[:, t, None])[..., None, None]
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
    return torch.stack(outs, 1), state


def _vjp_torch(fn, arrays, dtype, cot_out, cot_state):
    import torch

    leaves = [torch.tensor(a, dtype=dtype, requires_grad=True) for a in arrays if a is not None]
    args = list(leaves)
    if arrays[5] is None:
        args.append(None)
    out, state = fn(*args)
    grads = torch.autograd.grad(
        (out, state), leaves, (torch.tensor(cot_out, dtype=dtype), torch.tensor(cot_state, dtype=dtype))
    )
    return [out.detach().double().numpy(), state.detach().double().numpy()] + [g.double().numpy() for g in grads]


def _interpreted_op():
    """`fwd(q, k, v, g, beta, h0, reset) -> (out, state)` as torch-tpu's `jax_op` op with its
    autograd (register.py), the JAX op run with the Pallas forward interpreted on the CPU."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from titan_kernels.tpu import delta_rule

    class JaxOp(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ts):
            *arrays, reset = [jnp.asarray(t.detach().numpy()) for t in ts]
            (out, state), ctx.vjp = jax.vjp(
                lambda *a: delta_rule.gated_delta_rule(*a, reset, delta_rule.CHUNK, True), *arrays
            )
            return torch.tensor(np.asarray(out)), torch.tensor(np.asarray(state))

        @staticmethod
        def backward(ctx, d_out, d_state):
            grads = ctx.vjp((jnp.asarray(d_out.contiguous().numpy()), jnp.asarray(d_state.contiguous().numpy())))
            return (*(torch.tensor(np.asarray(x)) for x in grads), None)

    return JaxOp.apply


def kernel_impl(q, k, v, g, beta, *, chunk_size=64, **kwargs):
    """The op's TPU implementation (register.py's `chunk_gated_delta_rule`) over the interpreted kernel."""
    from models.common import gated_delta

    assert chunk_size == 64
    return gated_delta.call_prepared(_interpreted_op(), q, k, v, g, beta, **kwargs)


def _pallas_op(q, k, v, g, beta, h0, reset):
    """The op as register.py composes it on a TPU, with the kernel interpreted: (out, state)."""
    import torch

    return kernel_impl(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, qk_l2norm=True, reset=torch.tensor(reset)
    )


def interpret(small: bool, with_selfcheck: bool = False) -> dict:
    import jax
    import numpy as np
    import torch

    from models.common import gated_delta

    results = []
    for seed, (name, b, s, hk, hv, dk, dv, resets, with_state) in enumerate(CASES[:1] if small else CASES):
        start = time.perf_counter()
        arrays, reset, cot_out, cot_state = _inputs(b, s, hk, hv, dk, dv, resets, with_state, seed)
        reset_t = torch.tensor(reset)

        def exact(*a):
            a = list(a) + [None] * (6 - len(a))
            return _recurrent64(*a[:6], reset_t)

        def reference(*a):
            a = list(a) + [None] * (6 - len(a))
            return gated_delta.chunk_gated_delta_rule(
                *a[:5], initial_state=a[5], output_final_state=True, qk_l2norm=True, reset=reset_t
            )

        def pallas(*a):
            a = list(a) + [None] * (6 - len(a))
            return _pallas_op(*a[:6], reset)

        want = _vjp_torch(exact, arrays, torch.float64, cot_out, cot_state)
        ref = _vjp_torch(reference, arrays, torch.float32, cot_out, cot_state)
        got = _vjp_torch(pallas, arrays, torch.float32, cot_out, cot_state)
        names = ["out", "final_state", "dq", "dk", "dv", "dg", "dbeta"] + (["dh0"] if with_state else [])
        outputs = {}
        for n, w, r, p in zip(names, want, ref, got):
            outputs[n] = {
                "scale": float(np.abs(w).max()),
                "pallas_err": float(np.abs(p - w).max()),
                "torch_err": float(np.abs(r - w).max()),
                "pallas_vs_torch": float(np.abs(p - r).max()),
            }
        results.append(
            {
                "case": name,
                "shape": {"b": b, "s": s, "k_heads": hk, "v_heads": hv, "dk": dk, "dv": dv},
                "chunks": -(-s // 64),
                "resets": list(resets),
                "outputs": outputs,
                "seconds": round(time.perf_counter() - start, 2),
            }
        )
    # A control the comparison must catch: the documents case with its resets dropped on the
    # kernel's side (the state crosses document boundaries), forward only.
    name, b, s, hk, hv, dk, dv, resets, with_state = CASES[1]
    arrays, reset, _, _ = _inputs(b, s, hk, hv, dk, dv, resets, with_state, 1)
    ts = [torch.tensor(a) for a in arrays]
    want, _ = _recurrent64(*(t.double() for t in ts), torch.tensor(reset))
    dropped, _ = _pallas_op(*ts, reset & False)
    control = {"case": f"{name} without its resets", "scale": float(want.abs().max())}
    control["pallas_err"] = float((dropped.double() - want).abs().max())
    result = {"jax": jax.__version__, "torch": torch.__version__, "cases": results, "control": control}
    result["export"] = _export_structure()
    if with_selfcheck:  # the start-up self-check with this kernel, bf16 inputs, at Qwen 3.5's widths
        from titan_kernels.tpu import selfcheck

        start = time.perf_counter()
        shapes = selfcheck.KernelShapes(delta_k_dim=128, delta_v_dim=128, delta_heads=32)
        v = selfcheck.check(
            "gated_delta_rule", kernel_impl, device=torch.device("cpu"), dtype=torch.bfloat16, shapes=shapes
        )
        result["selfcheck"] = {
            "ok": v.ok,
            "worst": v.worst,
            "reason": v.reason,
            "tolerance": selfcheck.TOLERANCE,
            "seconds": round(time.perf_counter() - start, 1),
        }
    return result


def _export_structure() -> dict:
    """The forward and backward ops exported for TPU (`jax.export(platforms=["tpu"])`, what torch-tpu's
    jax_op does; Mosaic lowering, no device): the Mosaic calls and triangular solves in each."""
    import jax
    import jax.numpy as jnp

    from titan_kernels.tpu import delta_rule

    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    b, h, s, dk, dv = 1, 2, 300, 128, 128
    args = [S((b, h, s, dk), f32), S((b, h, s, dk), f32), S((b, h, s, dv), f32), S((b, h, s), f32)]
    args += [S((b, h, s), f32), S((b, h, dk, dv), f32), S((b, s), jnp.int32)]
    cot = [S((b, h, s, dv), f32), S((b, h, dk, dv), f32)]
    out = {}
    for name, fn, avals in (("forward", delta_rule.forward, args), ("backward", delta_rule.backward, args + cot)):
        text = jax.export.export(jax.jit(fn), platforms=["tpu"])(*avals).mlir_module()
        out[name] = {"mosaic_calls": text.count("tpu_custom_call"), "triangular_solves": text.count("triangular_solve")}
    return out


def compile_(generations: list[str], *, b: int = 1, h: int = 32, s: int = 4096, dk: int = 128, dv: int = 128) -> dict:
    """The kernel's forward and forward + backward compiled deviceless on each generation, at batch
    `b`, `h` value heads, `s` tokens, `dk` key and `dv` value columns (the defaults: Qwen 3.5 9B's
    Gated DeltaNet; tests/xla/probes/cp_delta_rule.py passes a cp rank's widths)."""
    import re
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from jax.experimental import topologies

    # Plain modules (the tpuc venv has no torch, which the titan_kernels package imports).
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "titan_kernels" / "tpu"))
    import delta_rule
    import tiles

    S, f32 = jax.ShapeDtypeStruct, jnp.float32
    shapes = [(b, h, s, dk), (b, h, s, dk), (b, h, s, dv), (b, h, s), (b, h, s), (b, h, dk, dv)]
    out = {"jax": jax.__version__, "shape": {"b": b, "heads": h, "s": s, "dk": dk, "dv": dv}, "compiles": {}}
    try:
        from importlib.metadata import version

        import libtpu  # noqa: F401

        out["libtpu"] = version("libtpu")
    except Exception as exc:  # report only
        out["libtpu"] = f"unknown ({type(exc).__name__})"
    for gen in generations:
        hw = tiles.GENERATIONS[gen]
        dev = topologies.get_topology_desc(topology_name=hw.topology, platform="tpu").devices[0]
        sh = jax.sharding.SingleDeviceSharding(dev)
        avals = [S(x, f32, sharding=sh) for x in shapes] + [S((b, s), jnp.int32, sharding=sh)]
        cot = [S((b, h, s, dv), f32, sharding=sh), S((b, h, dk, dv), f32, sharding=sh)]

        def step(q, k, v, g, beta, h0, reset, d_out, d_state):
            (o, st), vjp = jax.vjp(lambda *a: delta_rule.gated_delta_rule(*a, reset), q, k, v, g, beta, h0)
            return o, st, vjp((d_out, d_state))

        for name, fn, args in (("forward", delta_rule.forward, avals), ("forward+backward", step, avals + cot)):
            start = time.perf_counter()
            try:
                lowered = jax.jit(fn).lower(*args)
                compiled = lowered.compile()
                seconds = round(time.perf_counter() - start, 1)
                try:  # as tests/xla/probes/kernels_compile.py: the compiled HLO, else the lowered text
                    text, counted_in = compiled.as_text(), "compiled"
                except Exception:
                    text, counted_in = lowered.as_text(), "lowered"
                mem = compiled.memory_analysis()
                out["compiles"][f"{name}@{gen}"] = {
                    "device": dev.device_kind,
                    "seconds": seconds,
                    "mosaic_calls": len(re.findall(r"tpu_custom_call", text)),
                    "counted_in": counted_in,
                    "temp_mib": round(mem.temp_size_in_bytes / 2**20, 1),
                    "argument_mib": round(mem.argument_size_in_bytes / 2**20, 1),
                    "output_mib": round(mem.output_size_in_bytes / 2**20, 1),
                    "vmem_est_mib": round(delta_rule.vmem_bytes(dk, dv, s) / 2**20, 2),
                    "scoped_vmem_limit_mib": hw.scoped_vmem_bytes // 2**20,
                }
            except Exception as exc:
                out["compiles"][f"{name}@{gen}"] = {"error": f"{type(exc).__name__}: {str(exc)[:2000]}"}
    return out


def register() -> dict:
    import torch
    import torch_tpu  # noqa: F401  (explicit: autoload is off in tests)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from titan_kernels.tpu import register as reg

    impl = reg._build_gated_delta(torch.tpu.pallas.jax_op)
    reg._on_tpu = lambda *tensors: True
    checks = {}

    def run(with_state: bool, with_reset: bool):
        b, s, hk, hv, dk, dv = 2, 200, 2, 4, 128, 128

        def leaf(*shape, dtype=torch.bfloat16):
            return torch.empty(*shape, dtype=dtype).requires_grad_(True)

        q, k, v = leaf(b, s, hk, dk), leaf(b, s, hk, dk), leaf(b, s, hv, dv)
        g, beta = leaf(b, s, hv, dtype=torch.float32), leaf(b, s, hv)
        h0 = leaf(b, hv, dk, dv, dtype=torch.float32) if with_state else None
        reset = torch.zeros(b, s, dtype=torch.bool) if with_reset else None
        out, state = impl(
            q, k, v, g, beta, chunk_size=64, initial_state=h0, output_final_state=True, qk_l2norm=True, reset=reset
        )
        assert out.shape == (b, s, hv, dv) and out.dtype == torch.bfloat16, out
        assert state.shape == (b, hv, dk, dv) and state.dtype == torch.float32, state
        leaves = [q, k, v, g, beta] + ([h0] if with_state else [])
        grads = torch.autograd.grad((out.float().sum() + state.sum(),), leaves)
        for x, dx in zip(leaves, grads):
            assert dx.shape == x.shape and dx.dtype == x.dtype, (x.shape, x.dtype, dx.shape, dx.dtype)

    for name, args in (("plain", (False, False)), ("state_and_resets", (True, True))):
        try:
            with FakeTensorMode():
                run(*args)
            checks[name] = "ok"
        except Exception as exc:
            import traceback

            checks[name] = f"{type(exc).__name__}: {exc}"[:1500] + "\n" + traceback.format_exc()[-1500:]
    ops = sorted(n for n in dir(torch.ops.titan_tpu) if n.startswith("gated_delta"))
    return {"ops": ops, "checks": checks}


def capture_lowering() -> dict:
    """scripts/estimate_xla.py's path: the `titan_capture::gated_delta_fwd / _bwd` ops lowered by
    `capture.add_lowerings` over a 1-D mesh of a compile-only v6e:2x2 topology (4 devices, the
    batch split over them), lowered only (Mosaic lowering, no compile): the Mosaic calls in each
    program, and the kernel costs the lowering appended (`capture.COSTS`)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from titan_kernels.tpu import capture
    from tools.xla_lowering import load_torchax

    capture._define()
    torchax = load_torchax()  # before anything imports torchax (the torch 2.13 shim)
    from torchax import interop

    devices = topologies.get_topology_desc(topology_name="v6e:2x2", platform="tpu").devices
    mesh = Mesh(np.array(devices), ("fsdp",))
    env = torchax.default_env()
    capture.COSTS.clear()
    capture.add_lowerings(env, mesh, "fsdp", generation="v6e")
    op = torch.ops.titan_capture
    b, h, s, dk, dv = len(devices), 4, 256, 128, 128
    f32 = jnp.float32

    def split(*shape, dtype=f32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P("fsdp")))

    args = (split(b, h, s, dk), split(b, h, s, dk), split(b, h, s, dv), split(b, h, s), split(b, h, s))
    args += (split(b, h, dk, dv), split(b, s, dtype=jnp.int32))
    cot = (split(b, h, s, dv), split(b, h, dk, dv))
    programs = {
        "fwd": (interop.jax_view(lambda *a: tuple(op.gated_delta_fwd(*a))), args),
        "bwd": (interop.jax_view(lambda *a: tuple(op.gated_delta_bwd(*a))), args + cot),
    }
    out = {"devices": len(devices), "lowered": {}}
    for name, (fn, avals) in programs.items():
        try:
            with env:
                text = jax.jit(fn).lower(*avals).as_text()
            out["lowered"][name] = {"mosaic_calls": text.count("tpu_custom_call")}
        except Exception as exc:
            out["lowered"][name] = {"error": f"{type(exc).__name__}: {str(exc)[:1500]}"}
    out["costs"] = [list(c) for c in capture.COSTS]
    return out


def main() -> None:
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "interpret":
        result = interpret(small="small" in rest, with_selfcheck="selfcheck" in rest)
    elif mode == "compile":
        result = compile_(rest)
    elif mode == "register":
        result = register()
    elif mode == "capture":  # not beside `register`: torchax and torch-tpu cannot share a process
        result = capture_lowering()
    else:
        raise SystemExit(f"error: mode {mode!r}: allowed: interpret, compile, register, capture")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
