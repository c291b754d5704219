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
A weight SimpleFSDP gathers in float8 (`[quantize] fsdp_float8_all_gather`) is gathered so in the
body too (`Float8GatherShard`): the module gets the gradient's carrier as its weight and the e4m3
values and scale as two more `functional_call` entries (parallelisms/quantize.py `SCAN_FLOAT8`).

Tensor-parallel blocks: the stacked tensors hold each layer's TP-local shard (a weight
`Shard(d)` over TP is `Shard(d + 1)` of the stack) and the body computes on it; the TP styles'
DTensor hooks on the template block are swapped for local ones that issue the sequence
all-gather / reduce-scatter by TP group name, and `param_fn` sums the gradients of TP-replicated
norm weights over TP (`_ScanTP`). Styles without a scan form (FLUX's) and MoE blocks under TP
are refused (ConfigError).

Expert-parallel experts (parallelisms/expert_parallel.py) are: their weights live on the
expert mesh, split by expert over `ep` and sharded over `efsdp` (by expert or along a hidden
dim, `Shard(d)`); the body gathers the `efsdp` shards along `d` into this rank's `E/ep`
experts and applies EP's gradient scale, and the template's experts take `ep_scan_class`: no
gathering properties and the static-shape dispatch (`dispatch_combine_static`). The ragged
dispatch cannot run in a scan: its all-to-all sizes are data-dependent, so the values the
backward keeps differ in size from layer to layer and cannot be stacked (torch 2.13 fails
with "'SymInt' object has no attribute 'unsqueeze'").
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from models.errors import ConfigError


def _all_gather(x: torch.Tensor, dim: int, group: tuple[str, int]) -> torch.Tensor:
    """Concatenate the group's `x` along `dim` (functional collective, by group name)."""
    name, size = group
    # The collective concatenates along dim 0: move `dim` there and back.
    x = (x.movedim(dim, 0) if dim else x).contiguous()
    out = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_gather_into_tensor(x, size, name))
    return out.movedim(0, dim) if dim else out


def _reduce_scatter(x: torch.Tensor, dim: int, op: str, group: tuple[str, int]) -> torch.Tensor:
    """Reduce (`op`: sum | avg) the group's `x` and keep this rank's chunk along `dim`."""
    name, size = group
    x = (x.movedim(dim, 0) if dim else x).contiguous()
    out = torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.reduce_scatter_tensor(x, op, size, name))
    return out.movedim(0, dim).contiguous() if dim else out


def _all_reduce(x: torch.Tensor, op: str, group: tuple[str, int]) -> torch.Tensor:
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, op, group[0]))


def _pad_rows(x: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """`x` with zero rows appended along `dim` up to `rows`."""
    missing = rows - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


class GatherShard(torch.autograd.Function):
    """Forward: cast + all-gather along `dim`; backward: reduce-scatter / all-reduce (mean).

    `rows`: the parameter's full size along `dim`. SimpleFSDP shards like `torch.chunk` (chunks
    of ceil(rows / n), the last ones short or empty: a 128-row q_norm weight over 256 ranks), so
    every shard is padded to the chunk size for the equal-split collectives and the gathered
    tensor is cut back to `rows`; the backward pads the gradient, reduce-scatters it and keeps
    this rank's own rows."""

    @staticmethod
    def forward(
        ctx,
        shard: torch.Tensor,
        shard_group: tuple[str, int] | None,
        replicate_groups: tuple[tuple[str, int], ...],
        param_dtype: torch.dtype | None,
        reduce_dtype: torch.dtype | None,
        dim: int = 0,
        rows: int | None = None,
    ) -> torch.Tensor:
        _save_reduce(ctx, shard, shard_group, replicate_groups, reduce_dtype, dim)
        out = shard if param_dtype is None else shard.to(param_dtype)
        if shard_group is None:
            return out
        return _gather_rows(out, dim, rows, shard_group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_grad(ctx, grad), None, None, None, None, None, None


def _gather_rows(t: torch.Tensor, dim: int, rows: int | None, group: tuple[str, int]) -> torch.Tensor:
    """All-gather the shards `t` along `dim` into the parameter's `rows` (None: every shard is
    whole): each shard padded to the chunk size `torch.chunk` gives, the result cut back."""
    chunk = -(-rows // group[1]) if rows is not None else t.shape[dim]
    full = _all_gather(_pad_rows(t, dim, chunk), dim, group)
    return full if rows is None or full.shape[dim] == rows else full.narrow(dim, 0, rows)


def _save_reduce(ctx, shard: torch.Tensor, shard_group, replicate_groups, reduce_dtype, dim: int) -> None:
    """What `_reduce_grad` needs of a gather's forward."""
    ctx.shard_group, ctx.replicate_groups, ctx.dim = shard_group, replicate_groups, dim
    ctx.shard_dtype, ctx.reduce_dtype = shard.dtype, reduce_dtype
    ctx.local_rows = shard.shape[dim]


def _reduce_grad(ctx, grad: torch.Tensor) -> torch.Tensor:
    """The gathered weight's gradient -> this rank's shard of its mean over the dp ranks (cast
    to `reduce_dtype`, reduce-scatter over `dp_shard`, all-reduce over `dp_replicate`)."""
    if ctx.reduce_dtype is not None:
        grad = grad.to(ctx.reduce_dtype)
    if ctx.shard_group is not None:
        size = ctx.shard_group[1]
        chunk = -(-grad.shape[ctx.dim] // size)
        grad = _reduce_scatter(_pad_rows(grad, ctx.dim, chunk * size), ctx.dim, "avg", ctx.shard_group)
        if grad.shape[ctx.dim] != ctx.local_rows:
            grad = grad.narrow(ctx.dim, 0, ctx.local_rows)
    for group in ctx.replicate_groups:
        grad = _all_reduce(grad, "avg", group)
    return grad.to(ctx.shard_dtype)


class Float8GatherShard(torch.autograd.Function):
    """`GatherShard` for a float8_tensorwise weight gathered in float8 (`[quantize]
    fsdp_float8_all_gather`), SimpleFSDP's `_Float8Gather` in functional collectives: the amax
    all-reduced (max) over `dp_shard` (replicas hold the same values), the shard quantized to e4m3
    with the whole weight's scale, its uint8 view all-gathered -> (e4m3 values, scale, carrier: the
    zeros that take the weight's gradient, in `param_dtype`). Backward: `GatherShard`'s, on the
    carrier's gradient."""

    @staticmethod
    def forward(ctx, shard, shard_group, replicate_groups, param_dtype, reduce_dtype, dim=0, rows=None):
        from parallelisms.simple_fsdp import float8_wire, global_amax_input

        _save_reduce(ctx, shard, shard_group, replicate_groups, reduce_dtype, dim)
        local = shard.detach().float()
        amax = global_amax_input(local)
        if shard_group is not None:
            amax = _all_reduce(amax, "max", shard_group)
        wire, scale = float8_wire(local, amax)
        if shard_group is not None:
            wire = _gather_rows(wire, dim, rows, shard_group)
        values = wire.view(torch.float8_e4m3fn)
        carrier = shard.new_zeros((), dtype=param_dtype or shard.dtype).expand(values.shape)
        ctx.mark_non_differentiable(values, scale)
        return values, scale, carrier

    @staticmethod
    def backward(ctx, _values_grad, _scale_grad, grad: torch.Tensor):
        return _reduce_grad(ctx, grad), None, None, None, None, None, None


class SequenceAllGather(torch.autograd.Function):
    """TP `block_input` in the body: all-gather the sequence shards; backward: reduce-scatter (sum)
    of the partial input gradients the column-parallel projections leave."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: tuple[str, int]) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _reduce_scatter(grad, ctx.dim, "sum", ctx.group), None, None


class SequenceReduceScatter(torch.autograd.Function):
    """TP `rowwise` in the body: reduce-scatter (sum) the partial outputs of a row-parallel
    projection to sequence shards; backward: all-gather the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, group: tuple[str, int]) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, "sum", group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class SumGrad(torch.autograd.Function):
    """Identity forward; backward: all-reduce (sum) of the gradient over `group`. A TP-replicated
    weight applied to a rank's shard of the activations (sequence-parallel and head norms) gets
    a partial gradient on each rank; DTensor sums it over TP, and so does this."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: tuple[str, int]) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad.contiguous(), "sum", ctx.group), None


def _gather_args(spec, name: str) -> tuple:
    """(shard_group, replicate_groups, param_dtype, reduce_dtype, dim, rows) of one parameter's spec."""
    # A parameter's non-dp axes (TP, or EP for experts) are not gathered: `dp_shape` is the shape
    # of its local part on them, and the body computes on that local part.
    shard_group, replicate_groups, dim = None, [], 0
    if spec.dp_mesh is not None:
        for i, placement in enumerate(spec.dp_placements):
            group = (spec.dp_mesh.get_group(i).group_name, spec.dp_mesh.size(i))
            if i == getattr(spec, "deferred_axis", None):
                continue  # replicate_reduce = "step": averaged once per step (reduce_grads), not here
            if isinstance(placement, Shard):
                assert shard_group is None, spec.dp_placements
                dim = placement.dim
                shard_group = group
            else:
                replicate_groups.append(group)
    # SimpleFSDP leaves reduce_dtype None when it equals the compute dtype.
    rows = spec.dp_shape[dim] if shard_group is not None else None
    return shard_group, tuple(replicate_groups), spec.param_dtype, spec.reduce_dtype, dim, rows


def scan_param_fn(
    stack, *, name: str = "layers"
) -> tuple[Callable | None, Callable[[], contextlib.AbstractContextManager]]:
    """(`param_fn` for `BlockStack.enable_scan`, a context factory to wrap each scanned step).

    Without SimpleFSDP or TP on the blocks: (None, nullcontext). Otherwise `param_fn` gathers
    each row's dp shards and marks the TP-replicated weights whose gradient is summed over TP,
    and the context switches the template block (block "0") to local tensors: SimpleFSDP's
    properties off, the TP styles' hooks replaced by the body's collectives (`_ScanTP`).
    `name` is the stack's attribute (for messages); a model with several stacks calls this once
    per stack.
    """
    # the first block this stack holds (a pipeline stage: not "0"), or a hybrid stack's first period
    return body_param_fn(stack.scan_template(), name=name)


def body_param_fn(
    template: nn.Module, *, name: str = "layers"
) -> tuple[Callable | None, Callable[[], contextlib.AbstractContextManager]]:
    """`scan_param_fn` for any module a scan body calls with `functional_call`: one block (layer
    scan's template), or a pipeline stage's whole stack (graph-mode PP's iteration scan,
    trainer/graph/pipeline.py); `param_fn` maps `{name: local shard}` of `template`'s parameters
    to what its modules compute with."""
    from parallelisms.expert_parallel import ep_grad_scale, is_expert_parallel
    from parallelisms.simple_fsdp import is_data_parallel

    specs: dict[str, tuple] = {}
    grad_scales: dict[str, float] = {}
    float8: set[str] = set()  # weights gathered in float8 (`[quantize] fsdp_float8_all_gather`)
    for mod_name, module in template.named_modules():
        if not is_data_parallel(module):
            continue
        ep = is_expert_parallel(module)
        for pname, spec in module._simple_fsdp_specs.items():
            full_name = f"{mod_name}.{pname}" if mod_name else pname
            specs[full_name] = _gather_args(spec, f"{name}.*.{full_name}")
            if ep:
                grad_scales[full_name] = ep_grad_scale(module)
            if pname == "weight" and "float8_weight" in type(module).__dict__:
                float8.add(full_name)
    tp = _ScanTP.of(template, name)
    for pname, p in template.named_parameters():
        if isinstance(p, DTensor) and pname not in specs and (tp is None or pname not in tp.params):
            raise ConfigError(
                f"compile.scan_layers: {name}.*.{pname} is a DTensor not managed by SimpleFSDP "
                "or tensor parallelism; allowed: SimpleFSDP-sharded, TP-sharded or plain block "
                "parameters"
            )
    if not specs and tp is None:
        return None, contextlib.nullcontext

    from parallelisms.expert_parallel import scale_grad
    from parallelisms.quantize import SCAN_FLOAT8

    grad_sums = tp.grad_sums if tp is not None else {}

    def gather(pname: str, t: torch.Tensor) -> torch.Tensor:
        if pname in specs:
            shard_group, replicate_groups, param_dtype, _, _, _ = args = specs[pname]
            if shard_group is not None or replicate_groups or param_dtype not in (None, t.dtype):
                t = GatherShard.apply(t, *args)
            if pname in grad_scales:
                t = scale_grad(t, grad_scales[pname])
        if pname in grad_sums:
            t = SumGrad.apply(t, grad_sums[pname])
        return t

    def param_fn(row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {}
        for n, t in row.items():
            if n in float8:
                # The module gets the carrier as its weight and the gathered float8 values and scale
                # as two more attributes for the body's `functional_call` (QuantizedLinear.
                # float8_weight reads them): no module state is mutated inside the scan.
                prefix = n.removesuffix("weight")
                values, scale, out[n] = Float8GatherShard.apply(t, *specs[n])
                out[prefix + SCAN_FLOAT8[0]], out[prefix + SCAN_FLOAT8[1]] = values, scale
            else:
                out[n] = gather(n, t)
        return out

    return param_fn, lambda: _plain_template(template, tp)


# TP styles (models/common/plan.py) the scan body runs on local tensors. FLUX's styles
# (rowwise_replicate, replicate, colwise on a replicated input) have no scan form yet.
SCAN_TP_STYLES = ("sequence_parallel", "head_norm", "block_input", "colwise", "rowwise")
_SEQUENCE_DIM = 1  # the residual stream's sequence shards (GatherSequenceInput, "rowwise")
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class _ScanTP:
    """The template block's tensor parallelism re-expressed on local tensors for the scan body.

    DTensor TP (parallelisms/tensor_parallel.py) lives in forward hooks that wrap activations in
    DTensors; in the body those hooks are swapped for ones that issue the same collectives on
    plain tensors, by process-group name:
    - "block_input" (attention, feed_forward): all-gather the sequence shards of the input
      (`SequenceAllGather`; backward: reduce-scatter, sum, of the partial input gradients);
    - "colwise": nothing; the weight row is the TP-local shard, so `F.linear` on the gathered
      input gives the local heads / hidden features, as DTensor's local output does;
    - "rowwise": reduce-scatter, sum, of the partial outputs to sequence shards
      (`SequenceReduceScatter`; backward: all-gather);
    - "sequence_parallel", "head_norm": nothing on the activations (the norm is per token or
      per head); the weight's gradient, partial on each rank, is all-reduced (sum) over TP by
      `param_fn` (`SumGrad`), as DTensor's Partial -> Replicate does.
    The hook dicts holding these are built once, so each step's capture sees the same objects.
    """

    def __init__(self, params: set[str], grad_sums: dict[str, tuple[str, int]], swaps: list[tuple[nn.Module, list]]):
        self.params = params
        """Names of the block parameters owned by TP-styled modules."""
        self.grad_sums = grad_sums
        """Parameter name -> TP group whose ranks' partial gradients are summed."""
        self.swaps = swaps
        """(module, its local hook dicts, in `_HOOK_DICTS` order)."""

    @classmethod
    def of(cls, template: nn.Module, stack_name: str) -> _ScanTP | None:
        from parallelisms.tensor_parallel import block_style

        modules = dict(template.named_modules())
        if not any(block_style(m) for m in modules.values()):
            return None
        params, grad_sums, swaps = set(), {}, []
        for mod_name, module in modules.items():
            where = f"{stack_name}.*.{mod_name}" if mod_name else f"{stack_name}.*"
            hook_ids = (frozenset(module._forward_pre_hooks), frozenset(module._forward_hooks))
            style = block_style(module)
            if style is None:
                if any(hook_ids):
                    raise ConfigError(
                        f"compile.scan_layers: {where} has forward hooks outside the model's TP plan (e.g. the "
                        "MoE layer's tensor-parallel router and token hooks), which the scan body cannot run on "
                        "local tensors; allowed with tensor_parallel_degree > 1: false (unrolled blocks)"
                    )
                continue
            if style.style not in SCAN_TP_STYLES:
                raise ConfigError(
                    f"compile.scan_layers: {where} has TP style {style.style!r}, which has no scan form; "
                    f"allowed with tensor_parallel_degree > 1: false (unrolled blocks), or a plan of "
                    f"{', '.join(SCAN_TP_STYLES)}"
                )
            if hook_ids != (style.pre_hooks, style.hooks):
                raise ConfigError(
                    f"compile.scan_layers: {where} carries forward hooks besides its TP style's, "
                    "which the scan body would drop; allowed: false (unrolled blocks)"
                )
            if style.style == "colwise" and not _under_block_input(modules, mod_name):
                raise ConfigError(
                    f"compile.scan_layers: {where} is colwise on a replicated input (no block_input "
                    "around it), which has no scan form; allowed with tensor_parallel_degree > 1: false"
                )
            if style.style == "rowwise" and getattr(module, "bias", None) is not None:
                raise ConfigError(
                    f"compile.scan_layers: {where} is rowwise with a bias, which has no scan "
                    "form; allowed with tensor_parallel_degree > 1: false"
                )
            for pname, _ in module.named_parameters(recurse=False):
                full_name = f"{mod_name}.{pname}" if mod_name else pname
                params.add(full_name)
                if style.style in ("sequence_parallel", "head_norm"):
                    grad_sums[full_name] = style.group
            swaps.append((module, _local_hook_dicts(module, style.style, style.group)))
        return cls(params, grad_sums, swaps)


def _under_block_input(modules: dict[str, nn.Module], name: str) -> bool:
    from parallelisms.tensor_parallel import block_style

    parts = name.split(".")
    ancestors = (modules.get(".".join(parts[:i])) for i in range(len(parts)))
    return any((s := block_style(m)) is not None and s.style == "block_input" for m in ancestors if m is not None)


def _local_hook_dicts(module: nn.Module, style: str, group: tuple[str, int]) -> list:
    """The hook dicts `module` runs with in the scan body: the local form of `style` only."""
    original = [getattr(module, attr) for attr in _HOOK_DICTS]
    for attr in _HOOK_DICTS:
        setattr(module, attr, OrderedDict())
    try:
        if style == "block_input":
            module.register_forward_pre_hook(_gather_input_hook(group), with_kwargs=True)
        elif style == "rowwise":
            module.register_forward_hook(_scatter_output_hook(group))
        return [getattr(module, attr) for attr in _HOOK_DICTS]
    finally:
        for attr, hooks in zip(_HOOK_DICTS, original):
            setattr(module, attr, hooks)


def _gather_input_hook(group: tuple[str, int]):
    def hook(module, args, kwargs):
        # As GatherSequenceInput: the first positional input, or `hidden_states` when called
        # with keywords only.
        if not args and "hidden_states" in kwargs:
            return args, {
                **kwargs,
                "hidden_states": SequenceAllGather.apply(kwargs["hidden_states"], _SEQUENCE_DIM, group),
            }
        x, *rest = args
        return (SequenceAllGather.apply(x, _SEQUENCE_DIM, group), *rest), kwargs

    return hook


def _scatter_output_hook(group: tuple[str, int]):
    def hook(module, args, out):
        if out.shape[_SEQUENCE_DIM] % group[1] != 0:
            raise ConfigError(
                f"compile.scan_layers: sequence length {out.shape[_SEQUENCE_DIM]} does not split "
                f"evenly over tensor_parallel_degree {group[1]}; allowed: a multiple of it"
            )
        return SequenceReduceScatter.apply(out, _SEQUENCE_DIM, group)

    return hook


@contextlib.contextmanager
def _plain_template(template, tp: _ScanTP | None = None):
    """Inside, the template block runs on local tensors: its modules read their weights as stored
    (SimpleFSDP's gathering properties off: the scan body gathers), expert-parallel experts take
    `ep_scan_class`, and TP-styled modules run the local hooks of `tp`."""
    from parallelisms.expert_parallel import ep_scan_class, is_expert_parallel
    from parallelisms.simple_fsdp import is_data_parallel

    swapped = [(m, type(m)) for m in template.modules() if is_data_parallel(m)]
    hooks = [(m, [getattr(m, attr) for attr in _HOOK_DICTS], local) for m, local in (tp.swaps if tp else [])]
    for module, cls in swapped:
        module.__class__ = ep_scan_class(module) if is_expert_parallel(module) else cls._simple_fsdp_base
    for module, _, local in hooks:
        for attr, value in zip(_HOOK_DICTS, local):
            setattr(module, attr, value)
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls
        for module, original, _ in hooks:
            for attr, value in zip(_HOOK_DICTS, original):
                setattr(module, attr, value)
