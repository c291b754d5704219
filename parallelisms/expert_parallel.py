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
  brings the results back, after an all-to-all of the per-expert counts. Nothing is dropped.
  `select_dispatch` picks how: the ragged `dispatch_combine` (uneven all-to-alls, split sizes
  read on the host) in eager CPU/CUDA runs; `dispatch_combine_static` (static shapes, no host
  read, worst-case buffers whose padding no expert computes) when traced (compile, graph
  mode, layer scan) and on TPU, where torch-tpu's ragged all-to-all moves only the real rows.
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

import functools
from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

from models.common.plan import ModelPlan
from parallelisms.device_order import shard_rank
from parallelisms.parallel_dims import ParallelDims, build_ep_mesh
from parallelisms.simple_fsdp import data_parallel, is_data_parallel
from titan_kernels.collectives import ragged_all_to_all_for

__all__ = [
    "EP_STYLES",
    "apply_ep",
    "apply_global_load_balance",
    "capacity_all_to_all",
    "dispatch_combine",
    "dispatch_combine_static",
    "ep_grad_scale",
    "ep_scan_class",
    "expert_shard_dim",
    "is_expert_parallel",
    "scale_grad",
    "select_dispatch",
]

EP_STYLES = ("experts", "moe", "router")


def apply_ep(
    model: nn.Module,
    *,
    plan: ModelPlan,
    parallel_dims: ParallelDims,
    mesh: DeviceMesh,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    replicate_reduce: str = "micro_batch",
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
                _shard_experts(
                    module,
                    expert_mesh=expert_mesh,
                    grad_scale=grad_scale,
                    param_dtype=param_dtype,
                    reduce_dtype=reduce_dtype,
                    replicate_reduce=replicate_reduce,
                )
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
    """Make every "moe" layer's load-balancing loss global over the mesh, and its sequence-wise
    loss whole-sequence over the ranks sharing the sequences (models/common/moe.py).

    `mesh` is the world mesh; the expert counts are summed over all its ranks (the world group)
    with a functional all-reduce (traced into graph mode like any collective). Counting each rank's own tokens once is right on any
    mesh: data-parallel ranks hold different sequences, TP ranks different sequence shards
    (the "moe" style), EP ranks their own tokens before dispatch. With pipeline parallelism `mesh`
    is this pp rank's stage mesh and the counts are summed over the stage's ranks (`stage_group_mesh`):
    they run the same layers on the same pipeline chunk of their own rows at the same time.
    """
    if mesh is None or mesh.size() == 1:
        return model
    if mesh.size() == torch.distributed.get_world_size():
        reduce_counts = _sum_over(torch.distributed.group.WORLD.group_name)
    else:
        from parallelisms.parallel_dims import pp_mesh, stage_group_mesh

        assert pp_mesh(mesh) is not None, "the world mesh, or with pp > 1 a stage mesh, is expected"
        reduce_counts = _sum_over(stage_group_mesh(mesh).get_group().group_name)
    # The ranks holding shards of the same sequences: cp (each rank two chunks of every sequence)
    # x tp (the MoE runs on the rank's sequence shard); their per-sequence counts are summed for
    # DeepSeek's sequence-wise loss.
    seq_axes = [name for name in ("cp", "tp") if mesh[name].size() > 1]
    reduce_seq_counts = None
    if seq_axes:
        seq_mesh = mesh[seq_axes[0]] if len(seq_axes) == 1 else mesh["cp", "tp"]._flatten("cp_tp")
        reduce_seq_counts = _sum_over(seq_mesh.get_group().group_name)

    paths = [path for path, style in plan.ep_block.items() if style == "moe"]
    # The multi-token-prediction modules' blocks (models/common/mtp.py) sit outside the plan's
    # block stacks; their MoE's loss is global too (a per-rank count moved Qwen 3.5's MoE MTP run
    # on dp_shard 2 x ep 2 off one process by 1.6e-4 from step 2).
    from models.common.mtp import MTPModule

    mtp_blocks = [block for m in model.modules() if isinstance(m, MTPModule) for block in m.layers.values()]
    for block in [*(block for _, block in plan.iter_blocks(model)), *mtp_blocks]:
        for path in paths:
            module = _submodule(block, path)
            if module is not None:
                module.reduce_counts = reduce_counts
                module.reduce_seq_counts = reduce_seq_counts
    return model


def _sum_over(group_name: str):
    """A functional all-reduce (sum) over the group of that name, traced into graph mode like any
    collective. Named by its process-group name, not the group object: a collective inside a
    layer-scan body must not close over a ProcessGroup (Dynamo would lift it as an opaque object)."""

    def reduce(t: torch.Tensor) -> torch.Tensor:
        return funcol.all_reduce(t, "sum", group_name)

    return reduce


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
    expert_of_row = torch.repeat_interleave(local_ids, counts_recv.reshape(-1), output_size=x_recv.shape[0])
    order = torch.argsort(expert_of_row, stable=True)
    out = experts_fn(x_recv[order], counts_recv.sum(dim=0))
    # Undo the regrouping with a gather (deterministic, unlike a scatter-add).
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
    out = out[inverse]
    # 4. Combine: the reverse all-to-all returns every row to the rank it came from.
    return funcol.all_to_all_single_autograd(out, input_splits, output_splits, group=ep_mesh)


def dispatch_combine_static(
    x: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    experts_fn,
    ep_group: DeviceMesh | tuple[str, int, int],
    *,
    ragged_all_to_all: Callable | None = None,
) -> torch.Tensor:
    """`dispatch_combine` with static shapes and no host read; the experts see only real rows.

    Same contract and result as `dispatch_combine` (dropless). Every buffer is sized for the
    worst case: a rank may receive `P = x.shape[0]` rows from each of its `ep` peers (all their
    token copies could come here), so it holds an `[ep * P, dim]` receive buffer in which
    peer r's rows start at row `r * P`. The split sizes and offsets stay device tensors.

    The rows are then put in local-expert order with the padding **after** every group, and
    the experts get the counts of the real rows only: a grouped matmul that visits the rows its
    group sizes cover (torch._grouped_mm, megablox gmm) does the work of the ragged dispatch,
    not `ep` times it. The experts' outputs for padding rows are unspecified (torch._grouped_mm
    leaves them uninitialised) and are replaced by zeros before they go anywhere; they are never
    sent back, so neither they nor their gradients reach a real row.

    Transport: with `ragged_all_to_all` (torch-tpu's op, or `titan_kernels.collectives`' emulation;
    contract in titan_kernels/collectives.py) only real rows travel, with device-side offsets; without
    it, equal-split all-to-alls of the worst-case buffers (`ep x P` rows each way; any backend).
    `ep_group` is the 1-D EP mesh or `(process group name, size, rank in it)`: a layer-scan body
    must name its groups (a mesh or ProcessGroup object cannot enter torch's scan).
    """
    group, ep, rank = _ep_group_of(ep_group)
    num_experts = num_tokens_per_expert.numel()
    assert num_experts % ep == 0, f"{num_experts} experts do not split over ep={ep}"
    num_local = num_experts // ep
    rows, dim = x.shape
    per_peer = rows  # worst case: every copy of a peer comes here
    device = x.device
    # 1. One all-to-all of ints: for every peer, its counts for this rank's experts and the
    #    row at which its copies for this rank start (where the combine must write them back).
    send_counts = num_tokens_per_expert.view(ep, num_local)
    send_per_rank = send_counts.sum(dim=1)
    input_offsets = torch.cumsum(send_per_rank, 0) - send_per_rank
    table = torch.cat([send_counts, input_offsets.unsqueeze(1)], dim=1).reshape(-1)
    table = funcol.all_to_all_single(table, None, None, group=group).view(ep, num_local + 1)
    counts_recv, peer_offsets = table[:, :num_local], table[:, num_local]
    recv_per_rank = counts_recv.sum(dim=1)
    # 2. Dispatch: peer r's rows at r * P of the receive buffer, zero rows after them.
    block_starts = torch.arange(ep, device=device) * per_peer
    if ragged_all_to_all is None:
        recv = _equal_split_send(x, input_offsets, send_per_rank, per_peer, group)
    else:
        recv = ragged_all_to_all(
            x,
            x.new_zeros(ep * per_peer, dim),
            input_offsets,
            send_per_rank,
            torch.full_like(send_per_rank, rank * per_peer),
            recv_per_rank,
            group,
        )
    # 3. Compute: real rows by local expert, padding last and in no group; padding outputs zeroed.
    position = _expert_order(counts_recv, per_peer)
    gather = torch.empty_like(position).scatter_(0, position, torch.arange(position.numel(), device=device))
    counts = counts_recv.sum(dim=0)
    out = experts_fn(recv[gather], counts)
    real = torch.arange(out.shape[0], device=device) < counts.sum()
    out = torch.where(real.unsqueeze(-1), out, out.new_zeros(()))[position]
    # 4. Combine: the real rows go back, each to the row of x it answers.
    if ragged_all_to_all is None:
        return _equal_split_return(out, send_per_rank, input_offsets, per_peer, group)
    return ragged_all_to_all(
        out, x.new_zeros(rows, dim), block_starts, recv_per_rank, peer_offsets, send_per_rank, group
    )


def capacity_all_to_all(
    x: torch.Tensor,
    experts_fn: Callable[[torch.Tensor], torch.Tensor],
    ep_group: DeviceMesh | tuple[str, int, int],
    chunks: int = 1,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The capacity dispatch over EP: x [E, rows, dim] (this rank's buffer, expert-major) ->
    [E, rows, dim], each expert's rows answered by the rank that owns it.

    One equal-split all-to-all each way of exactly the capacity buffer: peer r receives the row
    blocks of its experts `r*L .. r*L + L-1` from every rank and runs `experts_fn` on `[L, ep x
    rows, dim]` (its local experts, every peer's rows side by side). No counts are exchanged:
    the unused slots are zero rows, computed and sent like the rest (their cost is bounded by
    the capacity, not by the worst case).

    `chunks > 1` (`[moe] dispatch_chunks` when it does not divide the batch; otherwise the MoE
    layer lays the buffer out chunk-major and sends each chunk through here, with no copy to split
    it) splits the rows into that many chunks (sizes differ by at most one row, the same on every
    rank), each sent, computed and returned on its own:
    the same products per row, and chunk i + 1's all-to-all has no data dependence on chunk i's
    expert matmuls, so a compiler with asynchronous all-to-alls (XLA on TPU) can overlap them,
    forward and backward.

    `weights` [E, rows] (the slots' router weights, `MoE._capacity_experts`): sent beside the rows
    (a [E x rows] all-to-all, 1/dim of the rows' bytes) and multiplied into the experts' outputs on
    the owning rank, so what comes back is already weighted. The backward then needs the experts'
    outputs only where they are computed (the weights' gradient, a sum over dim there, returns by
    the small all-to-all), and full AC's recompute of the layer sends nothing back: five
    all-to-alls of the buffer per layer and step (the forward's two, the recompute's dispatch, the
    backward's two) instead of six with the weighting on the token's rank.
    """
    if chunks > 1 and x.shape[1] > 1:
        n = min(chunks, x.shape[1])
        parts = x.tensor_split(n, dim=1)
        part_weights = weights.tensor_split(n, dim=1) if weights is not None else [None] * n
        return torch.cat(
            [capacity_all_to_all(p, experts_fn, ep_group, weights=w) for p, w in zip(parts, part_weights)], dim=1
        )
    group, ep, _ = _ep_group_of(ep_group)
    num_experts, rows, dim = x.shape
    assert num_experts % ep == 0, f"{num_experts} experts do not split over ep={ep}"
    num_local = num_experts // ep
    recv = funcol.all_to_all_single_autograd(x.reshape(-1, dim), None, None, group=group)
    recv = recv.view(ep, num_local, rows, dim).transpose(0, 1).reshape(num_local, ep * rows, dim)
    out = experts_fn(recv)
    if weights is not None:
        w = funcol.all_to_all_single_autograd(weights.reshape(-1), None, None, group=group)
        out = out * w.view(ep, num_local, rows).transpose(0, 1).reshape(num_local, ep * rows, 1)
    out = out.view(num_local, ep, rows, dim).transpose(0, 1).reshape(-1, dim)
    return funcol.all_to_all_single_autograd(out, None, None, group=group).view(num_experts, rows, dim)


def _ep_group_of(ep_group: DeviceMesh | tuple[str, int, int]) -> tuple[object, int, int]:
    """(what funcol takes as the group, size, this rank's index in it)."""
    if isinstance(ep_group, tuple):
        return ep_group
    return ep_group, ep_group.size(), shard_rank(ep_group)


def _expert_order(counts_recv: torch.Tensor, per_peer: int) -> torch.Tensor:
    """Position of every receive-buffer row `(r, slot)` once sorted by local expert, padding last.

    `counts_recv` [ep, L]: rows peer r sent to each local expert, sorted by expert within its
    block of `per_peer` rows. The order is that of a stable sort by local expert (then peer,
    then slot), computed with cumulative sums instead of a sort: a real row of expert e goes
    to (rows of experts < e) + (rows of e from peers < r) + (its rank within r's e rows); the
    padding rows follow all real rows, in buffer order. Returns [ep * per_peer] int64.
    """
    ep, num_local = counts_recv.shape
    slot = torch.arange(per_peer, device=counts_recv.device)
    ends = torch.cumsum(counts_recv, dim=1)  # [ep, L], within each peer's block
    expert = (slot.view(1, -1, 1) >= ends.unsqueeze(1)).sum(dim=-1)  # [ep, P]; L = padding
    totals = counts_recv.sum(dim=0)
    base = (torch.cumsum(totals, 0) - totals).unsqueeze(0) + torch.cumsum(counts_recv, 0) - counts_recv
    base = base - (ends - counts_recv)  # [ep, L]: position of slot 0 if it were expert e's
    index = expert.clamp(max=num_local - 1)
    real_position = base.gather(1, index) + slot
    recv = ends[:, -1]  # [ep]
    pad_before = torch.arange(ep, device=slot.device) * per_peer - (torch.cumsum(recv, 0) - recv)
    pad_position = totals.sum() + pad_before.unsqueeze(1) + slot - recv.unsqueeze(1)
    return torch.where(expert < num_local, real_position, pad_position).reshape(-1)


def _equal_split_send(
    x: torch.Tensor, input_offsets: torch.Tensor, send_per_rank: torch.Tensor, per_peer: int, group
) -> torch.Tensor:
    """[ep * per_peer, dim]: peer r's rows at r * per_peer, zeros after (equal-split all-to-all)."""
    rows, dim = x.shape
    slot = torch.arange(per_peer, device=x.device)
    src = (input_offsets.unsqueeze(1) + slot).clamp(max=rows - 1)  # [ep, P]
    valid = slot < send_per_rank.unsqueeze(1)
    send = torch.where(valid.unsqueeze(-1), x[src], x.new_zeros(()))
    return funcol.all_to_all_single_autograd(send.reshape(-1, dim), None, None, group=group)


def _equal_split_return(
    out: torch.Tensor, send_per_rank: torch.Tensor, input_offsets: torch.Tensor, per_peer: int, group
) -> torch.Tensor:
    """The reverse of `_equal_split_send`: [rows, dim] in the order of the dispatched x."""
    ep = send_per_rank.numel()
    back = funcol.all_to_all_single_autograd(out, None, None, group=group).view(ep, per_peer, -1)
    row = torch.arange(per_peer, device=out.device)  # x had per_peer rows
    # Row i of x went to peer dest(i), slot i - input_offsets[dest(i)].
    dest = (row.unsqueeze(1) >= torch.cumsum(send_per_rank, 0)).sum(dim=1).clamp(max=ep - 1)
    return back[dest, row - input_offsets[dest]]


def select_dispatch(x: torch.Tensor, *, static: bool = False) -> Callable:
    """The EP dispatch for `x`: the one place that chooses (docs/expert_parallel.md).

    - TPU: `dispatch_combine_static` over torch-tpu's `ragged_all_to_all` (static shapes for
      its compiler, only real rows on the wire);
    - traced (torch.compile, the graph trainer, a layer-scan body: `static`), meta or fake
      tensors: `dispatch_combine_static` with equal-split all-to-alls (no unbacked sizes);
    - eager CPU/CUDA: the ragged `dispatch_combine`, which moves and sorts only the real rows
      (faster there; its host read of the split sizes costs nothing extra on the CPU).
    """
    op = ragged_all_to_all_for(x.device)
    if op is not None:
        return functools.partial(dispatch_combine_static, ragged_all_to_all=op)
    if static or torch.compiler.is_compiling() or x.device.type == "meta" or isinstance(x, FakeTensor):
        return dispatch_combine_static
    return dispatch_combine


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
        dispatch = select_dispatch(x)
        group = self._ep_mesh if dispatch is dispatch_combine else self._ep_group
        return dispatch(x, num_tokens_per_expert, compute, group)

    def scan_forward(self: nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        # Inside a layer-scan body: weights are the body's gathered rows (plain attributes),
        # dispatch has static shapes and names its group.
        compute = lambda rows, counts: base.forward(self, rows, counts)  # noqa: E731
        if self._ep_group[1] == 1:
            return compute(x, num_tokens_per_expert)
        return select_dispatch(x, static=True)(x, num_tokens_per_expert, compute, self._ep_group)

    def forward_capacity_weighted(self: nn.Module, x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        # The capacity-bounded dispatch (models/common/moe.py): eager, traced and scanned alike,
        # static shapes; the group by name (a scan body cannot hold a mesh). With `weights`, each
        # output row times its slot's router weight, applied on the rank that owns the expert
        # (models/common/moe.py `weighted_capacity`).
        compute = lambda rows: base.forward_capacity(self, rows)  # noqa: E731
        if self._ep_group[1] == 1:
            out = compute(x)
            return out if weights is None else out * weights.unsqueeze(-1)
        return capacity_all_to_all(x, compute, self._ep_group, self.dispatch_chunks, weights)

    def forward_capacity(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return forward_capacity_weighted(self, x, None)

    def forward_capacity_chunks(
        self: nn.Module, parts: list[torch.Tensor], weights: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        # The buffer in `capacity_chunks` sequence chunks: each crosses the all-to-all on its own.
        compute = lambda rows: base.forward_capacity(self, rows)  # noqa: E731
        return [capacity_all_to_all(part, compute, self._ep_group, weights=w) for part, w in zip(parts, weights)]

    def capacity_chunks(self: nn.Module, batch: int) -> int:
        chunks = self.dispatch_chunks
        return chunks if self._ep_group[1] > 1 and chunks > 1 and batch % chunks == 0 else 1

    attrs: dict[str, object] = {name: _local_weight_property(name, base) for name in names}
    attrs.update(
        forward=forward,
        forward_capacity=forward_capacity,
        forward_capacity_weighted=forward_capacity_weighted,
        forward_capacity_chunks=forward_capacity_chunks,
        capacity_chunks=capacity_chunks,
        _ep_base=base,
    )
    cls = type(f"ExpertParallel{base._simple_fsdp_base.__name__}", (base,), attrs)
    cls._ep_scan_class = type(
        f"ScannedExpertParallel{base._simple_fsdp_base.__name__}",
        (base._simple_fsdp_base,),
        dict(
            forward=scan_forward,
            forward_capacity=forward_capacity,
            forward_capacity_weighted=forward_capacity_weighted,
            forward_capacity_chunks=forward_capacity_chunks,
            capacity_chunks=capacity_chunks,
            _ep_base=base,
        ),
    )
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
    replicate_reduce: str = "micro_batch",
) -> None:
    assert not is_data_parallel(module), "apply_ep must run before data_parallel"
    ep_mesh = expert_mesh["ep"]
    names = tuple(name for name, p in module._parameters.items() if p is not None)
    for name in names:
        param = module._parameters[name]
        assert not isinstance(param, DTensor), f"expert weight {name} is already sharded"
        assert param.shape[0] % ep_mesh.size() == 0, (
            f"{name}: {param.shape[0]} experts do not split over ep={ep_mesh.size()}"
        )
        # src_data_rank=None: every rank cuts its experts from its own (identical) copy, by its
        # coordinate, which is the rank the dispatch sends them to (`shard_rank`: device_order.py).
        sharded = distribute_tensor(param.detach(), ep_mesh, [Shard(0)], src_data_rank=None)
        module._parameters[name] = nn.Parameter(sharded, param.requires_grad)
    # SimpleFSDP on the expert mesh: the local experts are sharded over efsdp (by expert, or
    # along a hidden dim when they do not go round: `expert_shard_dim`), replicated over
    # dp_replicate; the stored DTensor spans (efsdp, ep) with the full [E, ...] shape.
    data_parallel(
        module,
        mesh=expert_mesh,
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        replicate_axis="dp_replicate",
        shard_axis="efsdp",
        shard_dim_fn=expert_shard_dim,
        replicate_reduce=replicate_reduce,
    )
    base = type(module)
    key = (base, names)
    if key not in _CLASS_CACHE:
        _CLASS_CACHE[key] = _ep_class(base, names)
    module.__class__ = _CLASS_CACHE[key]
    module._ep_mesh = ep_mesh
    module._ep_group = (ep_mesh.get_group().group_name, ep_mesh.size(), shard_rank(ep_mesh))
    module._ep_grad_scale = grad_scale


# --- "moe" style (tensor parallelism only) --------------------------------------------------


def _local_tokens(module: nn.Module, args: tuple) -> tuple:
    """The sequence-sharded DTensor input becomes this rank's tokens (grad stays Shard(1))."""
    x, *rest = args
    if isinstance(x, DTensor):
        x = x.to_local()
    return (x, *rest)


def _scale_loss_grads(scale: float):
    def hook(module: nn.Module, args: tuple, output: tuple[torch.Tensor, torch.Tensor, torch.Tensor]):
        out, aux_loss, load = output  # MoE.forward returns (out, aux_loss, load)
        return out, scale_grad(aux_loss, scale), load

    return hook


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None
