"""What torchax 0.0.13 needs to import on torch 2.13 and to lower the graph step (probes only).

Imported only inside an XLA-tier probe process, after the step was captured: importing torchax
renames PrivateUse1 to `jax`, after which Dynamo fails on every frame (reference/xla_cpu_path.md
§B.0), so capture first, then `load_torchax()`.

- `load_torchax()`: torch 2.13 removed the Dimname overloads (`prod.dim_Dimname`, ...) that
  torchax names in its amp and decomposition tables at import time. Missing `*Dimname*` /
  `*names*` overload lookups answer an inert placeholder while torchax imports; torchax only
  uses them as dictionary keys, which no traced op ever matches.
- `add_lowerings(env)`: ATen ops of the captured step that torchax has no rule for:
  the scan higher-order op (-> `jax.lax.scan`, one `stablehlo.while`), `detach_copy`
  (functionalized `detach` in scan bodies), `prims.fma` (torch 2.13's `lerp_` decomposition
  in the AdamW update) and `repeat_interleave(..., output_size=)` (MoE dispatch).
"""

from __future__ import annotations

import torch
import torch._ops


def load_torchax():
    """Import torchax (and jax) on torch 2.13; returns the torchax module."""
    packet = torch._ops.OpOverloadPacket
    original = packet.__getattr__

    def lenient(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if "imname" in key or "names" in key:
                return f"<removed overload {self._qualified_op_name}.{key}>"
            raise

    # Left in place: torchax imports its decomposition table lazily, on the first environment.
    packet.__getattr__ = lenient
    import torchax

    return torchax


def add_lowerings(env):
    """Register the missing lowerings (module docstring) on torchax environment `env`."""
    import jax
    import jax.numpy as jnp
    from torchax import interop

    def to_jax(values):
        return [v.jax() if hasattr(v, "jax") else env.t2j_iso(v) for v in values]

    def scan(combine_fn, init, xs, additional_inputs=()):
        num_carry = len(init)
        constants = to_jax(additional_inputs)

        def body(carry, x):
            carry_t, x_t, const_t = env.j2t_iso((list(carry), list(x), constants))
            with env:
                outs = [o.jax() for o in combine_fn(*carry_t, *x_t, *const_t)]
            return outs[:num_carry], outs[num_carry:]

        carry, ys = jax.lax.scan(body, to_jax(init), to_jax(xs))
        return env.j2t_iso(list(carry) + list(ys))

    def repeat_interleave_self(x, repeats, dim=None, output_size=None):
        return interop.call_jax(
            lambda a, r: jnp.repeat(a, r, axis=dim, total_repeat_length=output_size), x, repeats)

    def repeat_interleave_counts(repeats, output_size=None):
        return interop.call_jax(
            lambda r: jnp.repeat(jnp.arange(r.shape[0], dtype=r.dtype), r, total_repeat_length=output_size),
            repeats)

    env.override_op_definition(torch.ops.higher_order.scan, scan)
    env.override_op_definition(torch.ops.aten.detach_copy.default, lambda x: x.clone())
    env.override_op_definition(torch.ops.prims.fma.default, lambda a, b, c: a * b + c)
    env.override_op_definition(torch.ops.aten.repeat_interleave.self_Tensor, repeat_interleave_self)
    env.override_op_definition(torch.ops.aten.repeat_interleave.Tensor, repeat_interleave_counts)
    return env
