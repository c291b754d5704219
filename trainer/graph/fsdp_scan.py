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

Tensor-parallel (2-D DTensor) block parameters are not supported with scan (ConfigError), nor
are expert-parallel experts (ep > 1): their dispatch moves a data-dependent number of rows per
layer, so the body's intermediates that the backward keeps (received rows, sort orders) have a
different size in every layer, and torch's scan must stack them into one `[n_layers, ...]`
tensor (torch 2.13 fails with "'SymInt' object has no attribute 'unsqueeze'" on the split
sizes it would stack). MoE blocks without EP scan (their dispatch has static shapes).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.tensor import DTensor, Shard

from models.errors import ConfigError


class GatherShard(torch.autograd.Function):
    """Forward: cast + all-gather along dim 0; backward: reduce-scatter / all-reduce (mean)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, shard_group: tuple[str, int] | None,
                replicate_groups: tuple[tuple[str, int], ...], param_dtype: torch.dtype | None,
                reduce_dtype: torch.dtype | None) -> torch.Tensor:
        ctx.shard_group, ctx.replicate_groups = shard_group, replicate_groups
        ctx.shard_dtype, ctx.reduce_dtype = shard.dtype, reduce_dtype
        out = shard if param_dtype is None else shard.to(param_dtype)
        if shard_group is not None:
            name, size = shard_group
            out = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_gather_into_tensor(out, size, name))
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce_dtype is not None:
            grad = grad.to(ctx.reduce_dtype)
        if ctx.shard_group is not None:
            name, size = ctx.shard_group
            grad = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.reduce_scatter_tensor(grad, "avg", size, name))
        for name, _ in ctx.replicate_groups:
            grad = torch.ops._c10d_functional.wait_tensor(
                torch.ops._c10d_functional.all_reduce(grad, "avg", name))
        return grad.to(ctx.shard_dtype), None, None, None, None


def _gather_args(spec, name: str) -> tuple:
    """(shard_group, replicate_groups, param_dtype, reduce_dtype) of one parameter's spec."""
    if spec.tp_mesh is not None:
        raise ConfigError(f"compile.scan_layers: {name} is tensor-parallel; layer scan supports data "
                          "parallelism only; allowed: parallelism.tensor_parallel_degree = 1 with scan")
    shard_group, replicate_groups = None, []
    if spec.dp_mesh is not None:
        for i, placement in enumerate(spec.dp_placements):
            group = (spec.dp_mesh.get_group(i).group_name, spec.dp_mesh.size(i))
            if isinstance(placement, Shard):
                assert placement.dim == 0 and shard_group is None, spec.dp_placements
                if spec.dp_shape[0] % group[1] != 0:
                    raise ConfigError(f"compile.scan_layers: {name} has {spec.dp_shape[0]} rows, not divisible "
                                      f"by data_parallel_shard_degree {group[1]}; allowed: even shards")
                shard_group = group
            else:
                replicate_groups.append(group)
    # SimpleFSDP leaves reduce_dtype None when it equals the compute dtype.
    return shard_group, tuple(replicate_groups), spec.param_dtype, spec.reduce_dtype


def scan_param_fn(stack, *, name: str = "layers") -> tuple[Callable | None, Callable[[], contextlib.AbstractContextManager]]:
    """(`param_fn` for `BlockStack.enable_scan`, a context factory to wrap each scanned step).

    Without SimpleFSDP on the blocks: (None, nullcontext). With it: the row gather above, and a
    context that switches off SimpleFSDP's properties on the template block (block "0").
    `name` is the stack's attribute (for messages); a model with several stacks calls this once
    per stack.
    """
    from parallelisms.simple_fsdp import disable_active_parametrization, is_data_parallel

    from parallelisms.expert_parallel import is_expert_parallel

    template = stack["0"]
    specs: dict[str, tuple] = {}
    for mod_name, module in template.named_modules():
        if is_expert_parallel(module):
            raise ConfigError(f"compile.scan_layers: {name}.*.{mod_name} is expert-parallel, whose all-to-all "
                              "moves a data-dependent number of rows per layer, which a layer scan cannot "
                              "stack (docs/graph_trainer.md); allowed: scan_layers = false with "
                              "expert_parallel_degree > 1 or tensor_parallel_degree > 1, or "
                              "expert_parallel_degree = 1 with scan")
        if not is_data_parallel(module):
            continue
        for pname, spec in module._simple_fsdp_specs.items():
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            specs[full_name] = _gather_args(spec, f"{name}.*.{full_name}")
    for pname, p in template.named_parameters():
        if isinstance(p, DTensor) and pname not in specs:
            raise ConfigError(f"compile.scan_layers: {name}.*.{pname} is a DTensor not managed by SimpleFSDP; "
                              "allowed: SimpleFSDP-sharded or plain block parameters")
    if not specs:
        return None, contextlib.nullcontext

    def gather(pname: str, t: torch.Tensor) -> torch.Tensor:
        shard_group, replicate_groups, param_dtype, _ = args = specs[pname]
        if shard_group is None and not replicate_groups and param_dtype in (None, t.dtype):
            return t  # nothing to gather or cast
        return GatherShard.apply(t, *args)

    def param_fn(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {n: gather(n, t) if n in specs else t for n, t in row.items()}

    return param_fn, lambda: disable_active_parametrization(template)
