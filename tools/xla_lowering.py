"""The captured graph step as a JAX function: torchax lowering for the XLA tier and estimate_xla.

Never imported by the trainer. A process that uses it captures first and lowers after:
importing torchax renames PrivateUse1 to `jax`, after which Dynamo fails on every frame
(so the XLA tier's lowering probe captures every variant before it imports torchax; docs/tpu.md,
"The XLA test tier"). The route (tests/xla, scripts/estimate_xla.py):

1. `record_first_call()`, then build and call the graph step with `backend="aot_eager"`: the
   ATen graph's flat inputs are recorded (before and after its first run) and its outputs;
2. `load_torchax()` and `add_lowerings(env)`;
3. `as_jax_function(record)`: the graph as a JAX function of its tensor inputs returning
   (outputs, updated inputs), to `jax.jit(...).lower(...)` on XLA:CPU or a TPU topology.

Pieces for torchax 0.0.13 on torch 2.13:

- `load_torchax()`: torch 2.13 removed the Dimname overloads (`prod.dim_Dimname`, ...) that
  torchax names in its amp and decomposition tables. Missing `*Dimname*` / `*names*` overload
  lookups answer an inert placeholder in this process; torchax only uses them as dictionary
  keys, which no traced op ever matches.
- `add_lowerings(env)`: ATen ops of the captured step that torchax has no rule for:
  the scan higher-order op (-> `jax.lax.scan`, one `stablehlo.while`; `reverse=True` for a body
  that `trainer.graph.passes.tag_reverse_scans` tagged, as torch-tpu honours it), `detach_copy`
  (functionalized `detach` in scan bodies), `native_layer_norm_backward` (torchax 0.0.13 takes 5-6
  of its 8 arguments), `convolution_backward` (none in torchax 0.0.13; Qwen 3.5's conv1d), `prims.fma` (torch 2.13's `lerp_` decomposition
  in the AdamW update), `ldexp` (float8 rounding), `view_copy.dtype` (a bitcast; torchax reads the dtype
  as a shape), `repeat_interleave(..., output_size=)` (MoE dispatch) and the remat
  fence `titan::optimization_barrier` (-> `jax.lax.optimization_barrier`; trainer/graph/remat.py).
"""

from __future__ import annotations

import torch
import torch._ops

RECORD: dict = {}
"""What `record_first_call` saw: gm, pre, post, out, originals (the input tensors themselves)."""


class CaptureDone(Exception):
    """Raised instead of running the graph by `record_first_call(stop=True)`."""


_STOP = [False]


def record_first_call(*, clone: bool = True, stop: bool = False) -> None:
    """Wrap functorch's `make_boxed_func`, which the aot_eager capture calls on the ATen graph,
    so that the next graph's first call records its inputs before and after and its outputs
    into `RECORD` (cleared by the caller). `clone=False` keeps references only; `stop=True`
    records the inputs and raises `CaptureDone` instead of running the graph."""
    import functorch.compile as fc

    _STOP[0] = stop
    if getattr(fc.make_boxed_func, "_titan_recording", False):
        return
    original = fc.make_boxed_func

    def keep(values):
        return [v.detach().clone() if clone and torch.is_tensor(v) else v for v in values]

    def recording(fn):
        boxed = original(fn)
        self_gm = getattr(fn, "__self__", None)

        def call(args):
            if "pre" in RECORD:
                return boxed(args)
            originals = list(args)
            RECORD.update(gm=self_gm, pre=keep(originals), originals=originals)
            if _STOP[0]:
                raise CaptureDone
            out = boxed(args)
            RECORD.update(post=keep(originals), out=keep(out))
            return out

        call._boxed_call = True
        return call

    recording._titan_recording = True
    fc.make_boxed_func = recording


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
    from torchax.tensor import OperatorNotFound

    def to_jax(values):
        return [v.jax() if hasattr(v, "jax") else env.t2j_iso(v) for v in values]

    def scan(combine_fn, init, xs, additional_inputs=()):
        num_carry = len(init)
        constants = to_jax(additional_inputs)

        def body(carry, x):
            carry_t, x_t, const_t = env.j2t_iso((list(carry), list(x), constants))
            try:
                with env:
                    outs = [o.jax() for o in combine_fn(*carry_t, *x_t, *const_t)]
            except OperatorNotFound as e:
                # Re-raised as another type: torchax's function mode takes an OperatorNotFound
                # out of the scan rule as "scan has no rule" and retries it as a plain call,
                # which fails with a message naming scan rather than the body's op.
                raise NotImplementedError(f"in a scan body: {e}") from None
            return outs[:num_carry], outs[num_carry:]

        # A body tagged by trainer.graph.passes.tag_reverse_scans runs from the last row to the
        # first, its outputs stored at the row they came from: `reverse=True`, as torch-tpu does.
        carry, ys = jax.lax.scan(body, to_jax(init), to_jax(xs), reverse=_reversed(combine_fn))
        return env.j2t_iso(list(carry) + list(ys))

    def repeat_interleave_self(x, repeats, dim=None, output_size=None):
        return interop.call_jax(lambda a, r: jnp.repeat(a, r, axis=dim, total_repeat_length=output_size), x, repeats)

    def repeat_interleave_counts(repeats, output_size=None):
        return interop.call_jax(
            lambda r: jnp.repeat(jnp.arange(r.shape[0], dtype=r.dtype), r, total_repeat_length=output_size), repeats
        )

    def layer_norm_backward(grad, x, normalized_shape, mean, rstd, weight, bias, output_mask):
        # torchax 0.0.13's rule takes 5-6 arguments; ATen's op has 8 (FLUX's LayerNorms reach it).
        # dx = rstd (g w - mean(g w) - xhat mean(g w xhat)) over the normalized dims.
        def fn(g, x, mean, rstd, w):
            axes = tuple(range(x.ndim - len(normalized_shape), x.ndim))
            outer = tuple(range(x.ndim - len(normalized_shape)))
            xhat = (x.astype(jnp.float32) - mean) * rstd
            gf = g.astype(jnp.float32)
            gw = gf if w is None else gf * w.astype(jnp.float32)
            dx = rstd * (gw - gw.mean(axis=axes, keepdims=True) - xhat * (gw * xhat).mean(axis=axes, keepdims=True))
            dw = None if w is None else (gf * xhat).sum(axis=outer).astype(w.dtype)
            db = None if w is None else gf.sum(axis=outer).astype(w.dtype)
            return dx.astype(x.dtype), dw, db

        dx, dw, db = interop.call_jax(fn, grad, x, mean, rstd, weight)
        return (
            dx if output_mask[0] else None,
            dw if output_mask[1] and weight is not None else None,
            db if output_mask[2] and bias is not None else None,
        )

    env.override_op_definition(torch.ops.aten.native_layer_norm_backward.default, layer_norm_backward)
    env.override_op_definition(torch.ops.aten.convolution_backward.default, _convolution_backward)
    env.override_op_definition(torch.ops.higher_order.scan, scan)
    env.override_op_definition(torch.ops.aten.detach_copy.default, lambda x: x.clone())
    fma = getattr(torch.ops.prims, "fma", None)  # registered once a capture has decomposed lerp_
    if fma is not None:
        env.override_op_definition(fma.default, lambda a, b, c: a * b + c)
    # ldexp(x, e) = x * 2**e: the float8 grid spacing of models/common/quantize.py round_to_float8
    env.override_op_definition(
        torch.ops.aten.ldexp.Tensor, lambda x, e: interop.call_jax(lambda a, b: jnp.ldexp(a, b.astype(jnp.int32)), x, e)
    )
    env.override_op_definition(torch.ops.aten.view_copy.dtype, lambda x, dtype: interop.call_jax(_bitcast, x, dtype))
    env.override_op_definition(torch.ops.aten.repeat_interleave.self_Tensor, repeat_interleave_self)
    env.override_op_definition(torch.ops.aten.repeat_interleave.Tensor, repeat_interleave_counts)
    from trainer.graph.remat import OPTIMIZATION_BARRIER

    env.override_op_definition(
        OPTIMIZATION_BARRIER, lambda xs: list(interop.call_jax(jax.lax.optimization_barrier, list(xs)))
    )
    add_offload_lowerings(env, host=False)
    return env


def add_offload_lowerings(env, *, host: bool) -> None:
    """`torch.ops.ao.offload` / `ao.reload` (the layer scan's saved block inputs,
    trainer.graph.passes.offload_block_inputs_pass): with `host`, `jax.device_put` into the
    `pinned_host` memory space and back into device memory (XLA's host offloader: what MaxText's
    remat offload emits, and the TPU program compile's rule, tools/tpu_compile_worker.py);
    without, copies (the XLA tier on XLA:CPU, one memory)."""
    import jax
    from torchax import interop

    from trainer.graph.passes import host_offload_ops

    offload, reload = host_offload_ops()

    def to_host(x):
        return interop.call_jax(lambda a: jax.device_put(a, jax.memory.Space.Host), x) if host else x.clone()

    def to_device(x, device=None):
        return interop.call_jax(lambda a: jax.device_put(a, jax.memory.Space.Device), x) if host else x.clone()

    env.override_op_definition(offload, to_host)
    env.override_op_definition(reload, to_device)


def _convolution_backward(
    grad, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, output_mask
):
    """ATen's `convolution_backward` (torchax 0.0.13 has no rule; Qwen 3.5's depthwise causal conv1d
    reaches it): the VJP of `lax.conv_general_dilated` in ATen's layout (N, C, spatial...), grouped
    as the op's `groups`; transposed convolutions are not lowered."""
    import jax
    from torchax import interop

    if transposed:
        raise NotImplementedError("aten::convolution_backward: transposed convolutions have no lowering")

    def fn(g, x, w):
        spatial = "DHW"[3 - (x.ndim - 2) :]
        layout = ("NC" + spatial, "OI" + spatial, "NC" + spatial)

        def conv(x, w):
            return jax.lax.conv_general_dilated(
                x,
                w,
                window_strides=tuple(stride),
                padding=[(p, p) for p in padding],
                rhs_dilation=tuple(dilation),
                dimension_numbers=layout,
                feature_group_count=groups,
            )

        out, vjp = jax.vjp(conv, x, w)
        dx, dw = vjp(g.astype(out.dtype))
        return dx, dw, g.sum(axis=(0, *range(2, g.ndim)))

    dx, dw, db = interop.call_jax(fn, grad, x, w)
    return (
        dx if output_mask[0] else None,
        dw if output_mask[1] else None,
        db if output_mask[2] and bias_sizes is not None else None,
    )


def _bitcast(a, dtype):
    """`Tensor.view(dtype)` in JAX: the bytes reread, the last dim scaled by the itemsize ratio
    (the float8 all-gather moves float8 weights as uint8; torchax 0.0.13 takes the dtype overload
    of `view_copy` for a shape)."""
    import jax
    import jax.numpy as jnp
    from torchax.ops.mappings import t2j_dtype

    to = t2j_dtype(dtype) if isinstance(dtype, torch.dtype) else jnp.dtype(dtype)  # call_jax converts it
    src, dst = jnp.dtype(a.dtype).itemsize, jnp.dtype(to).itemsize
    if src == dst:
        return jax.lax.bitcast_convert_type(a, to)
    if src > dst:  # each element becomes src/dst elements along a new last dim, merged into the last
        out = jax.lax.bitcast_convert_type(a, to)
        return out.reshape(*a.shape[:-1], a.shape[-1] * (src // dst))
    return jax.lax.bitcast_convert_type(a.reshape(*a.shape[:-1], a.shape[-1] // (dst // src), dst // src), to)


def _reversed(combine_fn) -> bool:
    from torch import fx

    from trainer.graph.passes import scan_is_reversed

    return isinstance(combine_fn, fx.GraphModule) and scan_is_reversed(combine_fn)


def _drop_device_args(gm) -> None:
    """Remove `device=` from `_to_copy` nodes (also in scan bodies): the graph was captured on the
    CPU, and torchax takes `_to_copy(..., device=cpu)` (a mixed-precision cast spelled with its
    device) as a copy out of JAX, which fails under tracing. The whole step is on one device."""
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        changed = False
        for node in graph.nodes:
            if node.target is torch.ops.aten._to_copy.default and "device" in node.kwargs:
                node.kwargs = {k: v for k, v in node.kwargs.items() if k != "device"}
                changed = True
        if changed:
            module.recompile()


def as_jax_function(record: dict):
    """(fn, tensor_indices): `fn(*tensors) -> (outputs, updated tensors)` as a JAX function.

    `tensors` are the graph's tensor inputs (`record["pre"][i]` for i in tensor_indices); the
    graph updates parameters and optimizer state in place (`copy_` into its inputs), so the
    updated inputs are returned. Needs `load_torchax()` first.
    """
    from torchax import interop

    gm, pre = record["gm"], record["pre"]
    _drop_device_args(gm)
    tensor_idx = [i for i, a in enumerate(pre) if torch.is_tensor(a)]

    def step(*tensors):
        args = list(pre)
        for i, t in zip(tensor_idx, tensors):
            args[i] = t
        outs = gm(*args)
        return list(outs), [args[i] for i in tensor_idx]

    return interop.jax_view(step), tensor_idx


def flip_count(gm) -> int:
    """`aten.flip` nodes in the captured graph and its subgraphs (torch 2.13's scan backward reads
    flipped copies of the stacked weights and saved activations; docs/graph_trainer.md)."""
    flips = (torch.ops.aten.flip.default, torch.ops.prims.rev.default)
    return sum(1 for m in gm.modules() if hasattr(m, "graph") for n in m.graph.nodes if n.target in flips)


def mutated_inputs(gm) -> set[int]:
    """Positions of the graph inputs the step writes (`copy_` into a placeholder): parameters,
    moments, the step count. The rest (tokens, buffers) is read only."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    index = {n: i for i, n in enumerate(places)}
    return {index[n.args[0]] for n in gm.graph.nodes if n.target is torch.ops.aten.copy_.default and n.args[0] in index}
