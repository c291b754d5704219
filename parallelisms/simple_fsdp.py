"""SimpleFSDP: fully sharded data parallelism written with DTensor redistribute.

Each parameter is stored as a DTensor sharded `Shard(0)` on the `dp_shard` mesh axis and
`Replicate()` on `dp_replicate` (HSDP). The module's class is swapped for a subclass with
one property per parameter, so `module.weight` *computes* the full weight when the module
uses it: the shard is all-gathered by `DTensor.redistribute(-> Replicate)` (cast to
`param_dtype` first, so the all-gather moves bf16), and the gradient is declared
`Partial("avg")`, so autograd's backward of the all-gather is a reduce-scatter (an
all-reduce on `dp_replicate`) run in `reduce_dtype`; with `replicate_reduce="step"` it is
`Replicate` on `dp_replicate` instead, and parallelisms/replicate_reduce.py takes that mean once
per optimizer step. The optimizer sees fp32 DTensor
shards: master weights, gradients and optimizer state all take 1/dp_shard of the memory.

Module paths and state-dict keys do not change (`layers.0.attention.wq.weight` stays the
same): the parameter still lives in `module._parameters`, only attribute access goes
through the property. With tensor parallelism a parameter is a DTensor on the 2-D mesh
`(dp_shard, tp)`; only the dp axes are gathered and the result is the TP DTensor that the
TP styles expect. When no dp axis has more than one rank, the property only casts to
`param_dtype`, so single-device bf16 training runs through the same code.

Float8 all-gather (`data_parallel(float8_weights=...)`, `[quantize] fsdp_float8_all_gather`):
the weights of float8_tensorwise linears are gathered as e4m3 bytes instead: each rank takes its
shard's amax, one all-reduce (max) over the dp axes gives the weight's amax and so its one scale
(amax / 448, as the recipe computes it), each rank rounds its shard to e4m3 with that scale, and
the all-gather moves 1 byte per element (the uint8 view of the e4m3 values: the same bytes, on any
backend). The module's `float8_weight()` returns the gathered e4m3 values (`float8_e4m3fn`, the
bytes as gathered), the scale and a carrier for the weight's gradient (zeros, no memory), and
the op `quantized_linear` uses them without quantizing the weight again. The backward reduce-scatters the weight's gradient in `reduce_dtype`
as for any parameter. docs/low_precision.md, "Float8 all-gather under SimpleFSDP".

Granularity: each parameter is gathered where it is used (a block's weights are gathered
one after the other as the block runs). Under torch.compile the gathers are ordinary graph
ops that the compiler can bucket and reorder; see docs/parallelism.md.

Also here: `clip_grad_norm_` for gradients sharded over any mesh and `local_bytes` for
per-rank memory accounting.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, _get_device_handle
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from models.common.quantize import E4M3, QMAX, Operand, round_to_float8, scale_of_amax
from parallelisms.device_order import shard_rank
from parallelisms.replicate_reduce import REPLICATE_REDUCE

__all__ = [
    "data_parallel",
    "disable_active_parametrization",
    "clip_grad_norm_",
    "local_bytes",
    "is_data_parallel",
]


@dataclass(frozen=True, eq=False)
class _GatherSpec:
    """How to turn one stored parameter into the tensor the module computes with."""

    param_dtype: torch.dtype | None
    """Compute dtype (None: keep the stored dtype)."""
    reduce_dtype: torch.dtype | None
    """Dtype of the gradient reduction (None: the compute dtype)."""
    dp_mesh: DeviceMesh | None = None
    """Mesh of the data-parallel axes with more than one rank (None: nothing to gather)."""
    dp_placements: tuple[Placement, ...] = ()
    """Placements of the stored shard on `dp_mesh` (Replicate / Shard(d) per axis; d = 0 but
    for experts that do not go round, see `data_parallel(shard_dim_fn=...)`)."""
    dp_shape: tuple[int, ...] = ()
    dp_stride: tuple[int, ...] = ()
    """Shape and stride of what the dp axes split: the parameter, or its TP-local part."""
    tp_mesh: DeviceMesh | None = None
    """Mesh of the parameter's non-dp axes (TP), if the parameter was a DTensor before."""
    tp_placements: tuple[Placement, ...] = ()
    shape: tuple[int, ...] = ()
    stride: tuple[int, ...] = ()
    """Global shape and stride of the parameter."""
    float8: bool = False
    """All-gather it as e4m3 bytes with one tensorwise scale (`_Float8Gather`); dp axes only, no TP."""
    deferred_axis: int | None = None
    """Index in `dp_mesh` of `dp_replicate` when its reduction is deferred to once per step
    (`training.replicate_reduce = "step"`, parallelisms/replicate_reduce.py): the gradient is
    declared `Replicate` there, so the backward reduces over the other dp axes only."""
    replicate_mesh: DeviceMesh | None = None
    """The 1-D `dp_replicate` mesh of a deferred reduction (`deferred_meshes` in
    parallelisms/replicate_reduce.py reads it); None otherwise."""

    @property
    def grad_placements(self) -> list[Placement]:
        """What the gathered weight's gradient is on the dp axes: a mean still to take (`Partial`)
        on each, but `Replicate` on a deferred `dp_replicate` (each replica keeps its own)."""
        return [Replicate() if i == self.deferred_axis else Partial("avg") for i in range(self.dp_mesh.ndim)]


def _gather(param: torch.Tensor, spec: _GatherSpec) -> torch.Tensor:
    """The full-on-dp, compute-dtype view of `param` (differentiable)."""
    if spec.dp_mesh is None and spec.tp_mesh is None:
        return param if spec.param_dtype is None else param.to(spec.param_dtype)
    # Work on the local shard so that the dp gather and the TP layout are handled
    # separately: the dp axes see a 1-D/2-D DTensor of the TP-local tensor.
    local = param.to_local()
    if spec.dp_mesh is not None:
        sharded = DTensor.from_local(
            local,
            spec.dp_mesh,
            spec.dp_placements,
            run_check=False,
            shape=spec.dp_shape,
            stride=spec.dp_stride,
        )
        full = sharded.redistribute(
            spec.dp_mesh,
            [Replicate()] * spec.dp_mesh.ndim,
            forward_dtype=spec.param_dtype,
            backward_dtype=spec.reduce_dtype,
        )
        # Partial("avg"): the backward of the all-gather reduce-scatters (all-reduces on
        # dp_replicate, unless deferred to once per step) the mean gradient over the dp ranks.
        local = full.to_local(grad_placements=spec.grad_placements)
    elif spec.param_dtype is not None:
        local = local.to(spec.param_dtype)
    if spec.tp_mesh is None:
        return local
    # from_local's backward redistributes the gradient to the TP placements, e.g. sums the
    # Partial gradient of a replicated (sequence-parallel norm) weight over TP ranks.
    return DTensor.from_local(
        local,
        spec.tp_mesh,
        spec.tp_placements,
        run_check=False,
        shape=spec.shape,
        stride=spec.stride,
    )


_TENSORWISE_E4M3 = Operand(E4M3)
"""float8_tensorwise's weight operand: e4m3, one scale per tensor (models/common/quantize.py)."""


def float8_wire(shard: torch.Tensor, amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the fp32 `shard` quantized with the whole weight's `amax` as e4m3 bytes viewed as uint8,
    the tensorwise scale): `scale_of_amax`, divide, clamp to +-448, `round_to_float8` (bitwise
    torch's float8 cast), cast (exact: grid values). SimpleFSDP's gather and the scan body's."""
    scale = scale_of_amax(amax, _TENSORWISE_E4M3)
    grid = round_to_float8((shard / scale).clamp(-QMAX[E4M3], QMAX[E4M3]), E4M3)
    return grid.to(E4M3).view(torch.uint8), scale


def global_amax_input(shard: torch.Tensor) -> torch.Tensor:
    """The shard's amax as the all-reduce (max) input: 0 for an empty shard, inf for a non-finite
    element (max keeps an inf on any backend, a NaN not necessarily)."""
    amax = shard.abs().amax() if shard.numel() else shard.new_zeros(())
    return torch.where(torch.isfinite(amax), amax, torch.full_like(amax, math.inf))


class _Float8Gather(torch.autograd.Function):
    """The dp shard of a weight -> (the whole weight's e4m3 values as `float8_e4m3fn`, its scale,
    the gradient's carrier).

    Forward: the shard's amax, all-reduced (max) over the dp axes, gives the tensorwise scale
    exactly as the recipe computes it from the whole weight (`scale_of_amax`); the shard divided
    by it, clamped to +-448 and rounded to e4m3 (`round_to_float8`, bitwise torch's float8 cast)
    is all-gathered as its uint8 view: the e4m3 bytes, 1 per element, on any backend, and handed
    on as `float8_e4m3fn` without a wider copy (a device kernel reads the bytes as they are).
    The values and the scale are not differentiable (a float8 tensor cannot carry the weight's
    gradient: autograd would cast it to float8); the third output, the carrier, does: zeros of
    the weight's shape in `param_dtype`, a broadcast scalar that holds no memory, into which the
    op `quantized_linear` sends the gradient of the dequantized weight (straight-through, as for a
    weight quantized in the op). Backward: that gradient is reduce-scattered to the shard in
    `reduce_dtype`, as `_gather`'s is. A non-finite element makes the amax inf (max keeps an inf,
    whatever a backend does with NaN) and so the scale NaN, as the recipe's."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: _GatherSpec) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mesh, n = spec.dp_mesh, spec.dp_mesh.ndim
        shard = local.detach().float()
        amax = DTensor.from_local(global_amax_input(shard), mesh, [Partial("max")] * n, run_check=False)
        amax = amax.redistribute(mesh, [Replicate()] * n).to_local()
        wire, scale = float8_wire(shard, amax)
        sharded = DTensor.from_local(
            wire, mesh, spec.dp_placements, run_check=False, shape=spec.dp_shape, stride=spec.dp_stride
        )
        gathered = sharded.redistribute(mesh, [Replicate()] * n).to_local().view(E4M3)
        ctx.spec, ctx.local_dtype = spec, local.dtype
        carrier = local.new_zeros((), dtype=spec.param_dtype or local.dtype).expand(gathered.shape)
        ctx.mark_non_differentiable(gathered, scale)
        return gathered, scale, carrier

    @staticmethod
    def backward(ctx, _values_grad, _scale_grad, grad: torch.Tensor):
        spec = ctx.spec
        grad = grad.to(spec.reduce_dtype or grad.dtype)
        partial = DTensor.from_local(
            grad, spec.dp_mesh, spec.grad_placements, run_check=False, shape=spec.dp_shape, stride=spec.dp_stride
        )
        return partial.redistribute(spec.dp_mesh, spec.dp_placements).to_local().to(ctx.local_dtype), None


def _make_float8_weight(name: str):
    def float8_weight(self: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return _Float8Gather.apply(self._parameters[name].to_local(), self._simple_fsdp_specs[name])

    return float8_weight


def _make_property(name: str) -> property:
    def getter(self: nn.Module) -> torch.Tensor:
        return _gather(self._parameters[name], self._simple_fsdp_specs[name])

    return property(getter)


_CLASS_CACHE: dict[tuple[type, tuple[str, ...], str | None], type] = {}


def _swap_class(module: nn.Module, names: tuple[str, ...], float8_name: str | None = None) -> None:
    """Give `module` a subclass of its class with one gathering property per parameter (and a
    `float8_weight()` gathering `float8_name` in float8, see `_Float8Gather`)."""
    base = type(module)
    key = (base, names, float8_name)
    if key not in _CLASS_CACHE:
        attrs: dict[str, object] = {name: _make_property(name) for name in names}
        if float8_name is not None:
            attrs["float8_weight"] = _make_float8_weight(float8_name)
        attrs["_simple_fsdp_base"] = base
        if callable(getattr(base, "init_weights", None)):
            attrs["init_weights"] = _init_weights_unparametrized(base)
        _CLASS_CACHE[key] = type(f"SimpleFSDP{base.__name__}", (base,), attrs)
    module.__class__ = _CLASS_CACHE[key]


def _init_weights_unparametrized(base: type):
    def init_weights(self, *args, **kwargs):
        # init_weights writes into parameters in place; it must see the stored shards,
        # not the gathered copies the properties return.
        with disable_active_parametrization(self):
            if _random_init_is_per_rank(self):
                with _full_size_parameters(self):
                    return base.init_weights(self, *args, **kwargs)
            return base.init_weights(self, *args, **kwargs)

    return init_weights


def _random_init_is_per_rank(model: nn.Module) -> bool:
    """True if random ops on this model's DTensors draw from each rank's own generator.

    DTensor's offset-based RNG (cuda-like devices) fills a shard with the values it has in
    the full tensor; elsewhere (CPU) each rank draws its shard independently, so the
    weights would depend on the mesh and replicas could even disagree.
    """
    for param in model.parameters():
        if isinstance(param, DTensor):
            handle = _get_device_handle(param.device_mesh.device_type)
            return handle is None or not hasattr(handle, "set_rng_state")
    return False


@contextlib.contextmanager
def _full_size_parameters(model: nn.Module) -> Iterator[None]:
    """Temporarily replace DTensor parameters by full-size plain ones, then keep the shards.

    Used to run `init_weights` so that a seed gives the same weights on every mesh (as one
    process would). Costs one full copy of the parameters per rank while it runs; only
    used where DTensor random ops are per rank (CPU), see `_random_init_is_per_rank`.
    """
    swaps: list[tuple[nn.Module, str, DTensor]] = []
    fulls: dict[int, tuple[DTensor, nn.Parameter]] = {}  # by id: tied parameters once
    for module in model.modules():
        for name, param in module._parameters.items():
            if isinstance(param, DTensor):
                if id(param) not in fulls:
                    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
                    fulls[id(param)] = (param, nn.Parameter(full, param.requires_grad))
                swaps.append((module, name, param))
                module._parameters[name] = fulls[id(param)][1]
    try:
        yield
        with torch.no_grad():
            for param, full in fulls.values():
                # src_data_rank=None: each rank cuts its shard from its own (identical) copy.
                shard = distribute_tensor(full.detach(), param.device_mesh, param.placements, src_data_rank=None)
                param.to_local().copy_(shard.to_local())
    finally:
        for module, name, param in swaps:
            module._parameters[name] = param


def is_data_parallel(module: nn.Module) -> bool:
    """True if `data_parallel` already converted this module (its own parameters)."""
    return hasattr(type(module), "_simple_fsdp_base")


@contextlib.contextmanager
def disable_active_parametrization(model: nn.Module) -> Iterator[None]:
    """Inside, `module.weight` returns the stored DTensor shard instead of gathering.

    Use it around code that mutates parameters in place through module attributes
    (weight init, loading by attribute). The root's `init_weights` already runs inside it.
    It swaps the original classes back on this model only, so it is safe with one model
    per thread and costs nothing outside the context.
    """
    swapped = [(m, type(m)) for m in model.modules() if is_data_parallel(m)]
    for module, cls in swapped:
        module.__class__ = cls._simple_fsdp_base
    try:
        yield
    finally:
        for module, cls in swapped:
            module.__class__ = cls


def _chunk(tensor: torch.Tensor, num_chunks: int, index: int, dim: int = 0) -> torch.Tensor:
    """Chunk `index` of `dim` as DTensor's Shard(dim) defines it (torch.chunk, maybe empty)."""
    chunks = torch.chunk(tensor, num_chunks, dim=dim)
    if index < len(chunks):
        return chunks[index]
    shape = list(tensor.shape)
    shape[dim] = 0
    return tensor.new_empty(shape)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


def _dp_shard(
    inner: torch.Tensor,
    mesh: DeviceMesh,
    dp_axes: list[str],
    *,
    replicate_axis: str,
    shard_dim_fn: Callable[[tuple[int, ...], int], int] | None,
    tp_mesh: DeviceMesh | None,
    tp_placements: tuple[Placement, ...],
) -> tuple[torch.Tensor, list[Placement], list[Placement]]:
    """This rank's chunk of the (TP-local) tensor over the data-parallel axes, its placements on
    those axes, and its placements on the whole tensor (a shard of a dim TP or EP split first is
    a _StridedShard)."""
    dp_placements: list[Placement] = []
    full_placements: list[Placement] = []
    local = inner
    for axis in dp_axes:
        if axis == replicate_axis or inner.ndim == 0:
            dp_placements.append(Replicate())
            full_placements.append(Replicate())
            continue
        size, index = mesh[axis].size(), shard_rank(mesh[axis])
        dim = 0 if shard_dim_fn is None else shard_dim_fn(tuple(inner.shape), size)
        local = _chunk(local, size, index, dim)
        dp_placements.append(Shard(dim))
        # TP (or EP) split the same dim first (colwise weights, experts): the dp shard is a
        # shard of the TP shard, which DTensor spells _StridedShard (right-to-left sharding,
        # as FSDP2 + TP).
        tp_splits_dim = (
            math.prod(tp_mesh.size(i) for i, p in enumerate(tp_placements) if isinstance(p, Shard) and p.dim == dim)
            if tp_mesh is not None
            else 1
        )
        if tp_splits_dim > 1:
            full_placements.append(_StridedShard(dim, split_factor=tp_splits_dim))
        else:
            full_placements.append(Shard(dim))
    return local, dp_placements, full_placements


def _shard_param(
    param: torch.Tensor,
    *,
    mesh: DeviceMesh | None,
    replicate_axis: str,
    shard_axis: str,
    param_dtype: torch.dtype | None,
    reduce_dtype: torch.dtype | None,
    shard_dim_fn: Callable[[tuple[int, ...], int], int] | None = None,
    float8: bool = False,
    defer_replicate: DeviceMesh | None = None,
) -> tuple[torch.Tensor, _GatherSpec]:
    """Return the stored (sharded) version of `param` and how to gather it.

    The shard axis splits dim 0 of the (TP-local) tensor, or the dim `shard_dim_fn(local shape,
    shard axis size)` names."""
    shape, stride = tuple(param.shape), tuple(param.stride())
    tp_mesh, tp_placements = None, ()
    inner = param
    if isinstance(param, DTensor):
        tp_mesh, tp_placements = param.device_mesh, tuple(param.placements)
        assert not set(tp_mesh.mesh_dim_names or ()) & {replicate_axis, shard_axis}, (
            f"parameter already sharded on a data-parallel axis: {tp_mesh}"
        )
        inner = param.to_local()

    dp_axes = []
    if mesh is not None:
        names = mesh.mesh_dim_names or ()
        dp_axes = [a for a in (replicate_axis, shard_axis) if a in names and mesh[a].size() > 1]
    if not dp_axes:
        spec = _GatherSpec(
            param_dtype, reduce_dtype, tp_mesh=tp_mesh, tp_placements=tp_placements, shape=shape, stride=stride
        )
        return param, spec

    local, dp_placements, full_placements = _dp_shard(
        inner,
        mesh,
        dp_axes,
        replicate_axis=replicate_axis,
        shard_dim_fn=shard_dim_fn,
        tp_mesh=tp_mesh,
        tp_placements=tp_placements,
    )
    # A copy, not a view: the full tensor must not stay alive behind the shard.
    local = local.clone() if local.device.type != "meta" else local
    tp_names = tuple(tp_mesh.mesh_dim_names) if tp_mesh is not None else ()
    spanned = mesh[tuple(dp_axes) + tp_names] if len(dp_axes) + len(tp_names) > 1 else mesh[dp_axes[0]]
    stored = DTensor.from_local(
        local,
        spanned,
        full_placements + list(tp_placements),
        run_check=False,
        shape=shape,
        stride=stride,
    )
    dp_mesh = mesh[tuple(dp_axes)] if len(dp_axes) > 1 else mesh[dp_axes[0]]
    deferred = dp_axes.index(replicate_axis) if defer_replicate is not None and replicate_axis in dp_axes else None
    spec = _GatherSpec(
        param_dtype,
        reduce_dtype,
        dp_mesh=dp_mesh,
        dp_placements=tuple(dp_placements),
        dp_shape=tuple(inner.shape),
        dp_stride=_contiguous_stride(tuple(inner.shape)),
        tp_mesh=tp_mesh,
        tp_placements=tp_placements,
        shape=shape,
        stride=stride,
        float8=float8,
        deferred_axis=deferred,
        replicate_mesh=defer_replicate if deferred is not None else None,
    )
    assert not (float8 and tp_mesh is not None), "float8 all-gather of a TP-sharded weight (refused by the rules)"
    return stored, spec


def data_parallel(
    model: nn.Module,
    *,
    mesh: DeviceMesh | None,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    replicate_axis: str = "dp_replicate",
    shard_axis: str = "dp_shard",
    shard_dim_fn: Callable[[tuple[int, ...], int], int] | None = None,
    float8_weights: Callable[[nn.Module], bool] | None = None,
    replicate_reduce: str = "micro_batch",
) -> nn.Module:
    """Apply SimpleFSDP to every module of `model` that owns parameters, in place.

    `mesh` is the world mesh (it must contain the parameters' TP axes too); axes named
    `replicate_axis` / `shard_axis` with more than one rank are the data-parallel ones.
    `mesh=None` (single process) keeps plain parameters and only casts. Modules already
    converted (e.g. experts, done first on the expert mesh) are left alone. Works on the
    meta device; call it last, after TP, EP, activation checkpointing and compile.
    `shard_dim_fn(local_shape, shard_axis_size) -> dim` picks the dim the shard axis splits
    (default: dim 0); expert parallelism uses it to shard experts along a hidden dim when
    the experts do not go round (parallelisms/expert_parallel.py).
    `float8_weights(module) -> bool` picks the modules whose `weight` is all-gathered in float8
    (`_Float8Gather`; parallelize_model passes float8_tensorwise's quantized linears under
    `[quantize] fsdp_float8_all_gather`): they get a `float8_weight()` returning the gathered e4m3
    values and scale, which `QuantizedLinear` computes with; their `weight` attribute still gathers
    in `param_dtype` for any other reader. Only where a dp axis shards the weight.
    `replicate_reduce`: "micro_batch" reduces over `replicate_axis` in each backward, "step" leaves
    that mean to `ReplicateReducer` / `reduce_grads` once per step (parallelisms/replicate_reduce.py).
    """
    assert replicate_reduce in REPLICATE_REDUCE, replicate_reduce
    defer = None
    if replicate_reduce == "step" and mesh is not None and replicate_axis in (mesh.mesh_dim_names or ()):
        defer = mesh[replicate_axis] if mesh[replicate_axis].size() > 1 else None
    param_dtype_or_none = param_dtype
    # Casting the gradient to the compute dtype is a no-op; only ask for real casts.
    reduce_dtype_or_none = None if reduce_dtype == param_dtype else reduce_dtype
    converted: dict[int, tuple[nn.Parameter, _GatherSpec]] = {}  # tied parameters
    for module in model.modules():
        if is_data_parallel(module):
            continue
        names = tuple(name for name, p in module._parameters.items() if p is not None)
        if not names:
            continue
        specs = {}
        float8_name = "weight" if float8_weights is not None and float8_weights(module) else None
        for name in names:
            param = module._parameters[name]
            if id(param) not in converted:
                stored, spec = _shard_param(
                    param,
                    mesh=mesh,
                    replicate_axis=replicate_axis,
                    shard_axis=shard_axis,
                    param_dtype=param_dtype_or_none,
                    reduce_dtype=reduce_dtype_or_none,
                    shard_dim_fn=shard_dim_fn,
                    float8=name == float8_name,
                    defer_replicate=defer,
                )
                new = stored if stored is param else nn.Parameter(stored, param.requires_grad)
                converted[id(param)] = (new, spec)
            new, specs[name] = converted[id(param)]
            module._parameters[name] = new
        module._simple_fsdp_specs = specs
        if float8_name is not None and specs[float8_name].dp_mesh is None:
            float8_name = None  # nothing to gather: the op quantizes the weight itself
        _swap_class(module, names, float8_name)
    if not is_data_parallel(model):
        # The root may own no parameters; it still needs the unparametrized init_weights.
        model._simple_fsdp_specs = {}
        _swap_class(model, ())
    return model


# --- gradient clipping and memory accounting ---------------------------------------------


def _norm_group_key(grad: torch.Tensor) -> tuple:
    """Grads are grouped by the mesh axes their shards must be summed over."""
    if not isinstance(grad, DTensor):
        return (None, ())
    placements = grad.placements
    assert not any(p.is_partial() for p in placements), "unreduced (Partial) gradient"
    sharded = tuple(i for i, p in enumerate(placements) if not p.is_replicate())
    return (grad.device_mesh, sharded)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip gradients in place to a global norm of `max_norm`; return the norm.

    Works for plain gradients and DTensor gradients sharded over any mesh (several meshes
    may mix, e.g. dense and expert parameters): each rank sums |g|^p over its local shard,
    the sums are all-reduced over the mesh axes on which the gradient is sharded (never
    over replicated axes, so nothing is counted twice), and the groups are combined. The
    result is a plain tensor, equal on every rank. With pipeline parallelism (`pp_mesh`, the 1-D
    pp axis) each pp rank holds other parameters: the combined sums are also summed over it.
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norm_type = float(norm_type)
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for grad in grads:
        groups[_norm_group_key(grad)].append(grad)

    device = grads[0].to_local().device if isinstance(grads[0], DTensor) else grads[0].device
    totals = []
    for (mesh, sharded_dims), group in groups.items():
        local = [g.to_local() if isinstance(g, DTensor) else g for g in group]
        local = [t for t in local if t.numel() > 0]  # uneven shards may be empty
        if local:
            norms = (
                torch._foreach_norm(local, norm_type)
                if foreach is not False
                else [torch.linalg.vector_norm(t, norm_type) for t in local]
            )
            norms = torch.stack([n.float() for n in norms])
            if math.isinf(norm_type):
                value = norms.max()
            else:
                value = norms.pow(norm_type).sum()
        else:
            value = torch.zeros((), device=device)
        value = value.to(device)
        reduce_op = "max" if math.isinf(norm_type) else "sum"
        for dim in sharded_dims:
            value = funcol.all_reduce(value, reduce_op, (mesh, dim))
        totals.append(value)
    stacked = torch.stack(totals)
    reduced = stacked.max() if math.isinf(norm_type) else stacked.sum()
    if pp_mesh is not None:
        reduced = funcol.all_reduce(reduced, "max" if math.isinf(norm_type) else "sum", pp_mesh)
    total = reduced if math.isinf(norm_type) else reduced.pow(1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    local_grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    if foreach is not False:
        torch._foreach_mul_(local_grads, coef.to(local_grads[0].device))
    else:
        for g in local_grads:
            g.mul_(coef.to(g.device))
    return total


def local_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank holds for `tensors` (DTensors count only their local shard)."""
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
