"""Expert parallelism (EP) for dropless top-k MoE layers, from a model's plan.

`apply_ep` reads `ModelPlan.ep_block` (paths relative to each block; entries for modules a
block lacks are skipped, so one plan covers dense and MoE blocks) and applies these styles:

- "experts": a grouped-experts module (models/common/moe.py `GroupedExperts` contract: stacked
  weights with the expert on dim 0, `forward(x [N, dim] sorted by expert, num_tokens_per_expert
  [E]) -> [N, dim]`). Its weights are split by expert over the `ep` mesh axis and then sharded
  by SimpleFSDP over the data-parallel ranks left (`efsdp`, and replicated on `dp_replicate`):
  by expert when efsdp divides the E/ep local experts, else along a hidden dim
  (`expert_shard_dim`), so every rank holds 1/(efsdp x ep) of them even beyond E ranks; on
  the expert mesh `("dp_replicate", "efsdp", "ep")` of `build_ep_mesh`. Its forward is
  wrapped: *dispatch* sends every token copy to the rank that owns its expert and *combine*
  brings the results back, both with `all_to_all_single_autograd` of torch's functional
  collectives, after an all-to-all of the per-expert counts gives the (variable, possibly
  zero) split sizes. Nothing is dropped or padded.
- "moe": the MoE layer around the experts. With tensor parallelism its input is the
  sequence-sharded residual stream, a DTensor; the layer takes the rank's own tokens as a
  plain tensor (and returns plain, sequence-sharded output, like a rowwise projection). The
  auxiliary loss it returns next to its output is then a per-rank statistics of a
  sequence shard whose gradients are summed over the TP ranks, so their gradients are
  scaled by 1/tp: the TP group trains on the mean of its shards' losses.
- "router": a per-token linear layer inside the MoE (the router gate). With tensor
  parallelism its weight is replicated over the TP ranks, which see different tokens, so
  its gradient is summed over them (sequence parallelism along the token dim 0).

Without tensor parallelism "moe" and "router" change nothing; the router weight is then an
ordinary data-parallel parameter.

Gradient scale of the experts: SimpleFSDP averages gradients over the expert mesh's data
axes (`dp_replicate x efsdp` ranks), while an expert's local gradient already sums the token
contributions of its whole EP group (the all-to-all backward brings them in) and, with TP,
each TP rank holds only its own tokens' share. The local gradients are multiplied by
`tp / ep` so that expert gradients equal the data-parallel mean, exactly as a run without EP.

The module paths and state-dict keys do not change: the expert module keeps its class
family (SimpleFSDP's subclass, subclassed once more for the EP forward) and its
parameters, which are DTensors of the full `[E, ...]` shape, so checkpoints load across EP
degrees.
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from models.common.plan import ModelPlan
from parallelisms.parallel_dims import ParallelDims, build_ep_mesh
from parallelisms.simple_fsdp import data_parallel, is_data_parallel

__all__ = ["EP_STYLES", "apply_ep", "apply_global_load_balance", "dispatch_combine",
           "dispatch_combine_padded", "ep_grad_scale",
           "ep_scan_class", "expert_shard_dim", "is_expert_parallel", "scale_grad"]

EP_STYLES = ("experts", "moe", "router")


def apply_ep(
    model: nn.Module,
    *,
    plan: ModelPlan,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """Apply the plan's EP styles to every block of `model` in place; returns the model.

    Runs after TP and before activation checkpointing, compile and SimpleFSDP (see
    parallelize.py). `mesh` is the world mesh `("dp_replicate", "dp_shard", "tp")`; the
    expert weights are made data parallel here, on the expert mesh, and the final
    `data_parallel(model, ...)` leaves them alone. `ep == 1` is allowed (useful with TP:
    experts stay whole and are sharded over `dp_shard x tp`).
    """
    for style in plan.ep_block.values():
        assert style in EP_STYLES, f"plan: unknown EP style {style!r}"
    expert_mesh = build_ep_mesh(parallel_dims, mesh)
    tp_mesh = mesh["tp"] if parallel_dims.tp_enabled else None
    # See the module docstring (gradient scale of the experts).
    grad_scale = parallel_dims.tp / parallel_dims.ep
    for _, block in plan.iter_blocks(model):
        for path, style in plan.ep_block.items():
            module = _submodule(block, path)
            if module is None:
                continue
            if style == "experts":
                _shard_experts(module, expert_mesh=expert_mesh, grad_scale=grad_scale,
                               param_dtype=param_dtype, reduce_dtype=reduce_dtype)
            elif tp_mesh is not None and style == "moe":
                module.register_forward_pre_hook(_local_tokens)
                module.register_forward_hook(_scale_loss_grads(1.0 / parallel_dims.tp))
            elif tp_mesh is not None and style == "router":
                router = SequenceParallel(sequence_dim=0, use_local_output=True)
                # Every rank holds the same (meta or seeded) weights: no broadcast.
                router.src_data_rank = None
                parallelize_module(module, tp_mesh, router)
    return model


def apply_global_load_balance(model: nn.Module, *, plan: ModelPlan, mesh: DeviceMesh | None) -> nn.Module:
    """Make every "moe" layer's load-balancing loss global over the mesh (models/common/moe.py).

    `mesh` is the world mesh; the expert counts are summed over all its ranks (the world group)
    with a functional all-reduce (traced into graph mode like any collective). Counting each rank's own tokens once is right on any
    mesh: data-parallel ranks hold different sequences, TP ranks different sequence shards
    (the "moe" style), EP ranks their own tokens before dispatch.
    """
    if mesh is None or mesh.size() == 1:
        return model
    assert mesh.size() == torch.distributed.get_world_size(), "the world mesh is expected"
    # Named by its process-group name, not the group object: a collective inside a layer-scan
    # body must not close over a ProcessGroup (Dynamo would lift it as an opaque object).
    group_name = torch.distributed.group.WORLD.group_name

    def reduce_counts(t: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(t, "sum", group_name)

    paths = [path for path, style in plan.ep_block.items() if style == "moe"]
    for _, block in plan.iter_blocks(model):
        for path in paths:
            module = _submodule(block, path)
            if module is not None:
                module.reduce_counts = reduce_counts
    return model


def is_expert_parallel(module: nn.Module) -> bool:
    """True if `apply_ep` wrapped this module's forward ("experts" style)."""
    return hasattr(type(module), "_ep_base")


# --- dispatch and combine -------------------------------------------------------------------


def dispatch_combine(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    experts_fn,
    ep_mesh: DeviceMesh,
) -> torch.Tensor:
    """Run `experts_fn` on the ranks that own the experts and return its rows here.

    `x` [N, dim] holds this rank's token copies sorted by (global) expert, and
    `num_tokens_per_expert` [E] their counts; rank `r` of the 1-D `ep_mesh` owns experts
    `r * E/ep ... (r + 1) * E/ep - 1`. `experts_fn(x_local, num_tokens_per_local_expert)`
    computes the local experts on rows sorted by local expert. Returns [N, dim] in the
    order of `x`. Differentiable (the backward is the reverse all-to-all pair).
    """
    ep = ep_mesh.size()
    num_experts = num_tokens_per_expert.numel()
    assert num_experts % ep == 0, f"{num_experts} experts do not split over ep={ep}"
    num_local = num_experts // ep
    # 1. Exchange counts: afterwards row r of `counts_recv` holds what rank r sends to each of
    #    this rank's experts (the equal-split all-to-all of the [ep, num_local] count table).
    counts_recv = funcol.all_to_all_single(num_tokens_per_expert, None, None, group=ep_mesh)
    counts_recv = counts_recv.view(ep, num_local)
    send_per_rank = num_tokens_per_expert.view(ep, num_local).sum(dim=1)
    recv_per_rank = counts_recv.sum(dim=1)
    # The split sizes must be host ints (one sync for both; under torch.compile they become
    # unbacked SymInts, which needs torch._dynamo.config.capture_scalar_outputs).
    splits = torch.cat([send_per_rank, recv_per_rank]).tolist()
    input_splits, output_splits = splits[:ep], splits[ep:]
    # 2. Dispatch. Rows arrive grouped by (source rank, local expert).
    x_recv = funcol.all_to_all_single_autograd(x, output_splits, input_splits, group=ep_mesh)
    # 3. Regroup by local expert (stable: within an expert, source rank then token order).
    local_ids = torch.arange(num_local, device=x.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(local_ids, counts_recv.reshape(-1),
                                            output_size=x_recv.shape[0])
    order = torch.argsort(expert_of_row, stable=True)
    out = experts_fn(x_recv[order], counts_recv.sum(dim=0))
    # Undo the regrouping with a gather (deterministic, unlike a scatter-add).
    inverse = torch.empty_like(order).scatter_(
        0, order, torch.arange(order.numel(), device=order.device))
    out = out[inverse]
    # 4. Combine: the reverse all-to-all returns every row to the rank it came from.
    return funcol.all_to_all_single_autograd(out, input_splits, output_splits, group=ep_mesh)


def dispatch_combine_padded(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    experts_fn,
    ep_mesh: DeviceMesh | tuple[str, int],
) -> torch.Tensor:
    """`dispatch_combine` with static shapes: no host read, every buffer sized for the worst case.

    Same contract and result as `dispatch_combine` (dropless: nothing is dropped), but each rank
    sends every EP peer a buffer of `M = x.shape[0]` rows (all its token copies could go to one
    peer), so both all-to-alls are equal-split with sizes known at trace time. Costs `ep` times
    the all-to-all volume and expert-input rows of the ragged version; the expert compute runs
    on the padded rows too (zero rows, counted in the last local expert, whose output is
    discarded). Meant for programs that need static shapes (a layer-scan body, XLA).
    `ep_mesh` may be `(process group name, size)`: a layer-scan body must name its groups (a
    mesh or ProcessGroup object cannot enter torch's scan).
    """
    if isinstance(ep_mesh, tuple):
        ep_mesh, ep = ep_mesh
    else:
        ep = ep_mesh.size()
    num_experts = num_tokens_per_expert.numel()
    assert num_experts % ep == 0, f"{num_experts} experts do not split over ep={ep}"
    num_local = num_experts // ep
    rows, dim = x.shape
    device = x.device
    counts_recv = funcol.all_to_all_single(num_tokens_per_expert, None, None, group=ep_mesh).view(ep, num_local)
    send_per_rank = num_tokens_per_expert.view(ep, num_local).sum(dim=1)
    recv_per_rank = counts_recv.sum(dim=1)
    # 1. Send buffer [ep, M, dim]: slot j of peer r holds row start_r + j (zero past send_r).
    start = torch.cumsum(send_per_rank, 0) - send_per_rank
    slot = torch.arange(rows, device=device)
    src = start.unsqueeze(1) + slot  # [ep, M]
    valid = slot < send_per_rank.unsqueeze(1)
    send = torch.where(valid.unsqueeze(-1), x[src.clamp(max=rows - 1)], x.new_zeros(()))
    recv = funcol.all_to_all_single_autograd(send.reshape(ep * rows, dim), None, None, group=ep_mesh)
    # 2. Local expert of every received row (rows past recv_r: padding, sorted last).
    ends = torch.cumsum(counts_recv, dim=1)  # [ep, num_local]
    expert_of_row = (slot.view(1, rows, 1) >= ends.unsqueeze(1)).sum(dim=-1)  # [ep, M]; num_local = padding
    order = torch.argsort(expert_of_row.reshape(-1), stable=True)
    counts = counts_recv.sum(dim=0)
    # The padding rows (zeros) join the last expert's group so the counts cover every row.
    counts = counts + torch.nn.functional.one_hot(torch.tensor(num_local - 1, device=device), num_local) * (
        ep * rows - counts.sum())
    out = experts_fn(recv[order], counts)
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=device))
    out = out[inverse]
    # 3. Combine: the equal-split reverse all-to-all; slot j of peer r answers row start_r + j.
    back = funcol.all_to_all_single_autograd(out, None, None, group=ep_mesh).view(ep, rows, dim)
    # Row i of x went to peer dest(i) at slot i - start_dest(i).
    dest = (torch.arange(rows, device=device).unsqueeze(1) >= torch.cumsum(send_per_rank, 0)).sum(dim=1)
    dest = dest.clamp(max=ep - 1)
    return back[dest, torch.arange(rows, device=device) - start[dest]]


# --- "experts" style ------------------------------------------------------------------------


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; multiplies the gradient by a constant."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def scale_grad(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity whose gradient is multiplied by `scale`."""
    return x if scale == 1.0 else _ScaleGrad.apply(x, scale)


def _local_weight_property(name: str, base: type) -> property:
    gathered = getattr(base, name)
    assert isinstance(gathered, property), f"{base.__name__}.{name} is not a SimpleFSDP property"

    def getter(self: nn.Module) -> torch.Tensor:
        # SimpleFSDP gives the full-on-dp, compute-dtype DTensor on the ep axis (Shard(0));
        # the experts compute with this rank's experts only. to_local's backward hands the
        # local gradient back as the Shard(0) gradient: no communication on ep.
        weight = gathered.fget(self)
        if isinstance(weight, DTensor):
            weight = weight.to_local()
        return scale_grad(weight, self._ep_grad_scale)

    return property(getter)


def _ep_class(base: type, names: tuple[str, ...]) -> type:
    """Subclass of the SimpleFSDP class `base` whose forward dispatches tokens over ep."""

    def forward(self: nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        compute = lambda rows, counts: base.forward(self, rows, counts)  # noqa: E731
        if self._ep_mesh.size() == 1:
            return compute(x, num_tokens_per_expert)
        return dispatch_combine(x, num_tokens_per_expert, compute, self._ep_mesh)

    def scan_forward(self: nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Inside a layer-scan body: weights are the body's gathered rows (plain attributes),
        # dispatch has static shapes and names its group.
        compute = lambda rows, counts: base.forward(self, rows, counts)  # noqa: E731
        if self._ep_group[1] == 1:
            return compute(x, num_tokens_per_expert)
        return dispatch_combine_padded(x, num_tokens_per_expert, compute, self._ep_group)

    attrs: dict[str, object] = {name: _local_weight_property(name, base) for name in names}
    attrs.update(forward=forward, _ep_base=base)
    cls = type(f"ExpertParallel{base._simple_fsdp_base.__name__}", (base,), attrs)
    cls._ep_scan_class = type(f"ScannedExpertParallel{base._simple_fsdp_base.__name__}",
                              (base._simple_fsdp_base,), dict(forward=scan_forward, _ep_base=base))
    return cls


def ep_scan_class(module: nn.Module) -> type:
    """The class an expert-parallel module takes inside a layer-scan body: no SimpleFSDP
    properties (the scan gathers the weights) and the static-shape dispatch."""
    return type(module)._ep_scan_class


def ep_grad_scale(module: nn.Module) -> float:
    """The factor EP multiplies this module's local expert gradients by (module docstring)."""
    return module._ep_grad_scale


_CLASS_CACHE: dict[tuple[type, tuple[str, ...]], type] = {}


def expert_shard_dim(local_shape: tuple[int, ...], efsdp: int) -> int:
    """The dim of an EP-local expert weight `[E/ep, a, b]` that the `efsdp` axis splits.

    Dim 0 (whole experts per rank) when `efsdp` divides the local expert count; otherwise the
    first hidden dim it divides (w1/w3 `[E/ep, hidden, dim]`: the expert hidden size; w2
    `[E/ep, dim, hidden]`: the model dim), so that every rank holds exactly 1/(efsdp x ep)
    of the expert weights even when efsdp x ep exceeds the number of experts (a pod larger
    than E). If no dim divides, dim 0 (uneven shards, as DTensor allows).
    """
    for dim, size in enumerate(local_shape):
        if size % efsdp == 0:
            return dim
    return 0


def _shard_experts(
    module: nn.Module,
    *,
    expert_mesh: DeviceMesh,
    grad_scale: float,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
) -> None:
    assert not is_data_parallel(module), "apply_ep must run before data_parallel"
    ep_mesh = expert_mesh["ep"]
    names = tuple(name for name, p in module._parameters.items() if p is not None)
    for name in names:
        param = module._parameters[name]
        assert not isinstance(param, DTensor), f"expert weight {name} is already sharded"
        assert param.shape[0] % ep_mesh.size() == 0, (
            f"{name}: {param.shape[0]} experts do not split over ep={ep_mesh.size()}")
        # src_data_rank=None: every rank cuts its experts from its own (identical) copy.
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        module._parameters[name] = nn.Parameter(sharded, param.requires_grad)
    # SimpleFSDP on the expert mesh: the local experts are sharded over efsdp (by expert, or
    # along a hidden dim when they do not go round: `expert_shard_dim`), replicated over
    # dp_replicate; the stored DTensor spans (efsdp, ep) with the full [E, ...] shape.
    data_parallel(module, mesh=expert_mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                  replicate_axis="dp_replicate", shard_axis="efsdp", shard_dim_fn=expert_shard_dim)
    base = type(module)
    key = (base, names)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = _ep_class(base, names)
    module.__class__ = _CLASS_CACHE[key]
    module._ep_mesh = ep_mesh
    module._ep_group = (ep_mesh.get_group().group_name, ep_mesh.size())
    module._ep_grad_scale = grad_scale


# --- "moe" style (tensor parallelism only) --------------------------------------------------


def _local_tokens(module: nn.Module, args: tuple) -> tuple:
    """The sequence-sharded DTensor input becomes this rank's tokens (grad stays Shard(1))."""
    x, *rest = args
    if isinstance(x, DTensor):
        x = x.to_local()
    return (x, *rest)


def _scale_loss_grads(scale: float):
    def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor]):
        out, aux_loss = output  # MoE.forward returns (out, aux_loss)
        return out, scale_grad(aux_loss, scale)

    return hook


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
