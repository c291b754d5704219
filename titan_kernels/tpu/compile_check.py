"""Compile-only checks of the Pallas kernels at a run's shapes: lowered and compiled, never run.

The start-up self-check (selfcheck.py) runs each kernel on small inputs; some of what the run
calls is too large to run there: the fused loss over the whole vocabulary (Llama 3 70B: a
128256 x 8192 weight, 2 GiB, and as much of gradient) at the run's rows, whose blocks and VMEM
are what decide whether it compiles. `compile_kernel(op, shapes, generation)` lowers the kernel
(Mosaic, not interpreted) at those shapes with `generation`'s tiles and compiles it with XLA:TPU
for a compile-only device of that generation (`jax.experimental.topologies` over libtpu; no
data, no TPU touched: the same path as the XLA tier's deviceless compiles): blocks that cannot
fit VMEM fail here with the compiler's `CompileTimeScopedVmemOom`, as they would at step 1.

- `linear_cross_entropy`: forward and backward (`fused_ce.forward_rows` / `backward_rows`, the two
  halves titan_kernels/tpu/register.py binds) at the run's rows per device, hidden size and vocabulary;
- `grouped_mm`: forward and backward of both expert matmuls (dim -> expert hidden in the experts'
  nn.Linear layout, and back) at tokens x top_k rows (MoE models only);
- `gated_delta_rule`: the forward kernel and forward + backward (the chunk states' forward pass and
  the backward kernel, titan_kernels/tpu/delta_rule.py) over the run's tokens per device, with
  the model's DeltaNet heads and widths (Qwen 3.5 only: `shapes.delta_heads`);
- splash: nothing here (its numeric check runs at the run's head widths on the device).
Where no compile-only device can be made (the generation is not detected, libtpu refuses the
topology in this process, or a TPU is attached to this process: the training process, whose
torch-tpu PJRT client owns the chips, never opens a second libtpu client), the decision falls to the tile rule's VMEM arithmetic
(`tiles.ce_vmem_bytes` against the loss' limit; `tiles.gmm_vmem_bytes` against the scoped limit),
and the note says which decided.

Pure JAX (no torch): `shapes` is any object with selfcheck.KernelShapes' attributes.
"""

from __future__ import annotations

import functools
import re
import time

import jax
import jax.numpy as jnp

from titan_kernels.tpu import delta_rule, fused_ce, gmm, tiles

DEFAULT_TOKENS = 8192
"""Rows per device compiled when the run's are not known."""

MiB = 2**20


@functools.lru_cache(maxsize=8)
def device(generation: str):
    """Device 0 of `generation`'s compile-only topology (tiles.GENERATIONS[...].topology)."""
    from jax.experimental import topologies

    return topologies.get_topology_desc(topology_name=tiles.GENERATIONS[generation].topology, platform="tpu").devices[0]


def programs(op: str, shapes, generation: str | None) -> list[tuple[str, object, list, str, tuple[int, int]]]:
    """[(name, jax function, abstract args, tiles in words, (estimated VMEM bytes, limit))] that
    the run calls for `op` at `shapes`; empty: nothing to compile for `op`."""
    S, bf16, i32, f32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32, jnp.float32
    rows = shapes.tokens or DEFAULT_TOKENS
    if op == "linear_cross_entropy" and shapes.vocab:
        n, d, vocab = rows, shapes.hidden, shapes.vocab
        bn, bv = tiles.ce_blocks(generation, n, vocab, d)
        vmem = (tiles.ce_vmem_bytes(bn, bv, d), tiles.ce_vmem_limit(generation))
        words = f"rows {n}, hidden {d}, vocab {vocab}, blocks {bn} x {bv}"
        fwd = functools.partial(fused_ce.forward_rows, generation=generation)
        bwd = functools.partial(fused_ce.backward_rows, generation=generation)
        return [
            ("forward", fwd, [S((n, d), bf16), S((vocab, d), bf16), S((n,), i32)], words, vmem),
            (
                "backward",
                bwd,
                [S((n, d), bf16), S((vocab, d), bf16), S((n,), i32), S((n,), f32), S((n,), f32)],
                words,
                vmem,
            ),
        ]
    if op == "gated_delta_rule" and shapes.delta_heads:
        b, h, dk, dv = 1, shapes.delta_heads, shapes.delta_k_dim, shapes.delta_v_dim
        qkv, heads = [S((b, h, rows, d), f32) for d in (dk, dk, dv)], [S((b, h, rows), f32)] * 2
        state, reset = S((b, h, dk, dv), f32), S((b, rows), i32)
        vmem = (delta_rule.vmem_bytes(dk, dv, rows), tiles.hardware(generation).scoped_vmem_bytes)
        words = f"tokens {rows}, {h} heads of k {dk} / v {dv}, chunks of {delta_rule.CHUNK}"

        def both(q, k, v, g, beta, h0, reset, d_out, d_state):
            outs, vjp = jax.vjp(lambda *a: delta_rule.gated_delta_rule(*a, reset), q, k, v, g, beta, h0)
            return outs, vjp((d_out, d_state))

        args = [*qkv, *heads, state, reset]
        return [
            ("forward", delta_rule.forward, args, words, vmem),
            ("backward", both, [*args, S((b, h, rows, dv), f32), state], words, vmem),
        ]
    if op == "grouped_mm" and shapes.num_experts:
        m, groups = rows * max(shapes.top_k, 1), shapes.num_experts
        out = []
        for name, k, n in (("up", shapes.hidden, shapes.expert_hidden), ("down", shapes.expert_hidden, shapes.hidden)):

            def step(x, w_nk, sizes, dy):
                y, vjp = jax.vjp(
                    lambda x, w: gmm.grouped_mm(x, w, sizes, transpose_rhs=True, generation=generation), x, w_nk
                )
                return y, vjp(dy)

            tm, tk, tn = tiles.gmm_tiles(generation, m, k, n, groups)
            vmem = (tiles.gmm_vmem_bytes(tm, tk, tn), tiles.hardware(generation).scoped_vmem_bytes)
            out.append(
                (
                    name,
                    step,
                    [S((m, k), bf16), S((groups, n, k), bf16), S((groups,), i32), S((m, n), bf16)],
                    f"rows {m}, {k} -> {n}, {groups} experts, tiles {tm} x {tk} x {tn}",
                    vmem,
                )
            )
        return out
    return []


def _vmem_words(message: str) -> str:
    m = re.search(r"size ([0-9.]+[MK]) and limit ([0-9.]+[MK])", message) or re.search(
        r"Used ([0-9.]+[MK]) of ([0-9.]+[MK]) vmem", message
    )
    return f" ({m.group(1)} of {m.group(2)} scoped VMEM)" if m else ""


def compile_kernel(op: str, shapes, generation: str | None, *, attached: bool = False) -> tuple[bool, str] | None:
    """None (nothing to compile for `op`), (True, what compiled) or (False, why not): every
    program of `programs(op, ...)` compiled for `generation`'s compile-only device, or, where none
    can be made, judged by the tile rule's VMEM arithmetic (module docstring). `attached`: a TPU
    is attached to this process (torch-tpu owns the chips): no compile-only device is made, since
    that would open a second libtpu client here; the tile rule decides and step 1 compiles."""
    progs = programs(op, shapes, generation)
    if not progs:
        return None
    target = generation or "an undetected generation"
    dev, why_estimate = None, "generation not detected"
    if attached:
        why_estimate = "a TPU is attached to this process: no second libtpu client; step 1 compiles it"
    elif generation is not None:
        try:
            dev = device(generation)
        except Exception as exc:  # libtpu refused a compile-only topology here: the tile rule decides
            why_estimate = f"no compile-only {generation} device ({type(exc).__name__})"
    if dev is None:
        for _, _, _, words, (est, limit) in progs:
            if est > limit:
                return False, (
                    f"{words}: the largest kernel needs ~{est / MiB:.1f} MiB of VMEM, over the "
                    f"{limit / MiB:.0f} MiB limit for {target} (tile rule; {why_estimate})"
                )
        words = "; ".join(dict.fromkeys(p[3] for p in progs))
        return True, f"fits {target}'s VMEM by the tile rule ({why_estimate}): {words}"
    sharding = jax.sharding.SingleDeviceSharding(dev)
    start = time.perf_counter()
    for name, fn, avals, words, _ in progs:
        placed = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) for a in avals]
        try:
            jax.jit(fn).lower(*placed).compile()
        except Exception as exc:
            message = f"{type(exc).__name__}: {exc}"
            first = next((line for line in message.splitlines() if "Error" in line or "Oom" in line), message)
            return False, (
                f"{name} at {words} does not compile for {generation}: {first.strip()[:160]}{_vmem_words(message)}"
            )
    words = "; ".join(dict.fromkeys(p[3] for p in progs))
    return True, (
        f"{' + '.join(p[0] for p in progs)} compiled for {generation} at {words} "
        f"({time.perf_counter() - start:.1f} s, not run)"
    )
