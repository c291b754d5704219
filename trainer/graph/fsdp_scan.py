"""SimpleFSDP inside the layer scan: each layer's shards are gathered in the scan body.

With layer scan the stacked tensors hold each layer's *local shard* (`[n_layers, *shard]`),
so the scan carries 1/dp_shard of the block weights and gathers one layer at a time, as
SimpleFSDP does for unrolled blocks. The gather cannot go through SimpleFSDP's properties
there: they build DTensors, and a DTensor inside a scan body makes Dynamo lift the process
group as an opaque object, which scan rejects (torch 2.13). So while the scanned step runs,
the template block's SimpleFSDP properties are switched off (`disable_active_parametrization`)
and `GatherShard` does the same work with functional collectives named by process-group
name: cast to `param_dtype`, all-gather over `dp_shard` in the forward; in the backward the
gradient is cast to `reduce_dtype`, reduce-scattered (mean) over `dp_shard`, all-reduced
(mean) over `dp_replicate`, and cast back to the shard's dtype: SimpleFSDP's semantics.

Tensor-parallel (2-D DTensor) block parameters are not supported with scan (ConfigError).

Expert-parallel experts (parallelisms/expert_parallel.py) are: their weights live on the
expert mesh, split by expert over `ep` and sharded over `efsdp` (by expert or along a hidden
dim, `Shard(d)`); the body gathers the `efsdp` shards along `d` into this rank's `E/ep`
experts and applies EP's gradient scale, and the template's experts take `ep_scan_class`: no
gathering properties and the static-shape dispatch (`dispatch_combine_padded`). The ragged
dispatch cannot run in a scan: its all-to-all sizes are data-dependent, so the values the
backward keeps differ in size from layer to layer and cannot be stacked (torch 2.13 fails
with "'SymInt' object has no attribute 'unsqueeze'").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from models.errors import ConfigError


class GatherShard(torch.autograd.Function):
    """Forward: cast + all-gather along `dim`; backward: reduce-scatter / all-reduce (mean)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, shard_group: tuple[str, int] | None,
                replicate_groups: tuple[tuple[str, int], ...], param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None, dim: int = 0) -> torch.Tensor:
        ctx.shard_group, ctx.replicate_groups, ctx.dim = shard_group, replicate_groups, dim
        ctx.shard_dtype, ctx.reduce_dtype = shard.dtype, reduce_dtype
        out = shard if param_dtype is None else shard.to(param_dtype)
        if shard_group is not None:
            name, size = shard_group
            # The collective concatenates along dim 0: move `dim` there and back.
            out = out.movedim(dim, 0).contiguous() if dim else out
            out = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_gather_into_tensor(out, size, name))
            out = out.movedim(0, dim) if dim else out
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_dtype is not None:
            grad = grad.to(ctx.reduce_dtype)
        if ctx.shard_group is not None:
            name, size = ctx.shard_group
            dim = ctx.dim
            grad = grad.movedim(dim, 0).contiguous() if dim else grad
            grad = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.reduce_scatter_tensor(grad, "avg", size, name))
            grad = grad.movedim(0, dim).contiguous() if dim else grad
        for name, _ in ctx.replicate_groups:
            grad = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(grad, "avg", name))
        return grad.to(ctx.shard_dtype), None, None, None, None, None


def _gather_args(spec, name: str, *, expert_parallel: bool = False) -> tuple:
    """(shard_group, replicate_groups, param_dtype, reduce_dtype, dim) of one parameter's spec.

    `expert_parallel`: the non-dp mesh is the EP axis, which the body does not gather."""
    if spec.tp_mesh is not None and not expert_parallel:
        raise ConfigError(f"compile.scan_layers: {name} is tensor-parallel; layer scan supports data "
                          "parallelism only; allowed: parallelism.tensor_parallel_degree = 1 with scan")
    shard_group, replicate_groups, dim = None, [], 0
    if spec.dp_mesh is not None:
        for i, placement in enumerate(spec.dp_placements):
            group = (spec.dp_mesh.get_group(i).group_name, spec.dp_mesh.size(i))
            if isinstance(placement, Shard):
                assert shard_group is None, spec.dp_placements
                dim = placement.dim
                if spec.dp_shape[dim] % group[1] != 0:
                    raise ConfigError(f"compile.scan_layers: {name} has {spec.dp_shape[dim]} rows on dim {dim}, "
                                      f"not divisible by its data-parallel shard degree {group[1]}; "
                                      "allowed: even shards")
                shard_group = group
            else:
                replicate_groups.append(group)
    # SimpleFSDP leaves reduce_dtype None when it equals the compute dtype.
    return shard_group, tuple(replicate_groups), spec.param_dtype, spec.reduce_dtype, dim


def scan_param_fn(stack, *, name: str = "layers") -> tuple[Callable | None, Callable[[], contextlib.AbstractContextManager]]:
    """(`param_fn` for `BlockStack.enable_scan`, a context factory to wrap each scanned step).

    Without SimpleFSDP on the blocks: (None, nullcontext). With it: the row gather above, and a
    context that switches off SimpleFSDP's properties on the template block (block "0").
    `name` is the stack's attribute (for messages); a model with several stacks calls this once
    per stack.
    """
    from parallelisms.expert_parallel import ep_grad_scale, is_expert_parallel
    from parallelisms.simple_fsdp import is_data_parallel

    template = stack["0"]
    specs: dict[str, tuple] = {}
    grad_scales: dict[str, float] = {}
    for mod_name, module in template.named_modules():
        if not is_data_parallel(module):
            continue
        ep = is_expert_parallel(module)
        for pname, spec in module._simple_fsdp_specs.items():
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            specs[full_name] = _gather_args(spec, f"{name}.*.{full_name}", expert_parallel=ep)
            if ep:
                grad_scales[full_name] = ep_grad_scale(module)
    for pname, p in template.named_parameters():
        if isinstance(p, DTensor) and pname not in specs:
            raise ConfigError(f"compile.scan_layers: {name}.*.{pname} is a DTensor not managed by SimpleFSDP; "
                              "allowed: SimpleFSDP-sharded or plain block parameters")
    if not specs:
        return None, contextlib.nullcontext

    from parallelisms.expert_parallel import scale_grad

    def gather(pname: str, t: torch.Tensor) -> torch.Tensor:
        shard_group, replicate_groups, param_dtype, _, _ = args = specs[pname]
        if shard_group is not None or replicate_groups or param_dtype not in (None, t.dtype):
            t = GatherShard.apply(t, *args)
        return scale_grad(t, grad_scales[pname]) if pname in grad_scales else t

    def param_fn(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: gather(n, t) if n in specs else t for n, t in row.items()}

    return param_fn, lambda: _plain_template(template)


@contextlib.contextmanager
def _plain_template(template):
    """Inside, the template block's modules read their weights as stored (SimpleFSDP's gathering
    properties off: the scan body gathers); expert-parallel experts take `ep_scan_class`."""
    from parallelisms.expert_parallel import ep_scan_class, is_expert_parallel
    from parallelisms.simple_fsdp import is_data_parallel

    swapped = [(m, type(m)) for m in template.modules() if is_data_parallel(m)]
    for module, cls in swapped:
        module.__class__ = ep_scan_class(module) if is_expert_parallel(module) else cls._simple_fsdp_base
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
