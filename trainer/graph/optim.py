"""The optimizer half of the graph step: global-norm clipping and a functional AdamW / Muon.

The state lives in the real `torch.optim.AdamW` object (`state[p]` = `step`, `exp_avg`,
`exp_avg_sq`), created eagerly here before capture, so checkpoints have the same format in
every `[compile] mode`. Inside the graph the update is written out as tensor ops on that
state (the arithmetic of `torch.optim.adamw`'s single-tensor path, with `step` and `lr` as
tensors so the schedule never recompiles).

With layer scan, one update covers a whole stacked tensor `[n_layers, ...]`: the optimizer
state of the per-layer parameters is moved into stacked storage too (each per-layer state
tensor becomes a view of its row), and `step` is a `[n_layers]` vector whose rows are the
per-layer `step` tensors. So the graph holds one update per parameter *name*, not per layer.

Muon (`trainer.optim.muon.Muon`) runs the same way: its AdamW groups take the update above, its Muon
groups `muon_update_` on their `momentum_buffer` (stacked like the moments under layer scan: the
Newton-Schulz of a stacked [n_layers, m, n] tensor is batched over the layers). A Muon stack
sharded on a matrix dim is redistributed by an all-to-all into whole matrices, ceil(B / D) of its
B on each of the D ranks, orthogonalised there and sent back (`orthogonalize_sharded`); a shard
of a leading dim (layers, experts) needs no communication.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DTensor

from models.common.stack import view_rows
from models.errors import ConfigError
from parallelisms.device_order import shard_rank


@dataclass
class UpdateSlot:
    """One tensor the graph updates: a parameter (or a stacked block parameter) and its state."""

    param: torch.Tensor
    """The autograd leaf: a model parameter, or a `BlockStack` stacked tensor."""
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: torch.Tensor
    """0-dim, or `[n_layers]` for a stacked parameter."""
    group: int
    """Index of the optimizer param group (hyperparameters)."""
    members: list[torch.Tensor] = field(default_factory=list)
    """Stacked slot only: the per-layer parameters whose optimizer state views the rows."""
    momentum: torch.Tensor | None = None
    """Muon slot: the `momentum_buffer` (then exp_avg, exp_avg_sq and step are None)."""
    shards: tuple = ()
    """Muon slot of a sharded parameter: `(mesh, mesh_dim, tensor_dim, index, size)` per sharded
    mesh axis, tensor_dim counted on the slot's tensor (stacked: + 1)."""


def _is_muon(optimizer: torch.optim.Optimizer) -> bool:
    from trainer.optim.muon import Muon

    return isinstance(optimizer, Muon)


def check_adamw(optimizer: torch.optim.Optimizer) -> None:
    """The graph step implements AdamW's default variant and Muon only; say so early."""
    if _is_muon(optimizer):
        assert optimizer.qk_clip is None, "QK clip in graph mode: the step plan's RULES refuse it first"
        return
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ConfigError(
            f"optimizer: graph mode implements AdamW and Muon, got {type(optimizer).__name__}; "
            "allowed: AdamW, trainer.optim.muon.Muon"
        )
    for i, group in enumerate(optimizer.param_groups):
        # `fused` only picks the kernel of torch.optim's own step, which graph mode replaces.
        for key in ("amsgrad", "maximize", "differentiable", "capturable"):
            if group.get(key):
                raise ConfigError(
                    f"optimizer: param group {i} sets {key}=True, which graph mode does not "
                    "implement; allowed: AdamW with amsgrad/maximize/capturable off"
                )
        if not group.get("decoupled_weight_decay", True):
            raise ConfigError(
                "optimizer: graph mode implements decoupled weight decay (AdamW) only; allowed: AdamW (decoupled_weight_decay on)"
            )


def init_adamw_state(optimizer: torch.optim.AdamW) -> None:
    """Create AdamW's state for every parameter now (torch.optim creates it lazily at step 1).

    Same keys and dtypes as `torch.optim.AdamW`: `step` (float32 scalar), `exp_avg`,
    `exp_avg_sq` (zeros like the parameter, DTensor for DTensor parameters). `step` is kept
    on the parameter's device (torch.optim keeps it on the CPU unless capturable) so the
    compiled graph has no host scalar in it; the value and the checkpoint are the same.
    """
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            device = _local(p).device
            if group.get("use_muon"):
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                continue
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32, device=device)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device != device:
                state["step"] = state["step"].to(device=device, dtype=torch.float32)


class AdamWSlots:
    """The update slots of an optimizer, with stacked storage for scanned block parameters.

    `stacked` maps a stacked tensor (from `BlockStack.stacked_parameters()`) to its per-layer
    parameters. Per-layer optimizer state is moved into stacked tensors of which each layer's
    state is a view; `refresh()` re-establishes that after something replaced state tensors
    (e.g. `optimizer.load_state_dict` on resume) and re-reads everything else.
    """

    def __init__(self, optimizer: torch.optim.AdamW, *, stacked: dict[str, tuple[torch.Tensor, list]] | None = None):
        check_adamw(optimizer)
        self.optimizer = optimizer
        self._stacked = stacked or {}
        self._group_of: dict[int, int] = {}
        for gi, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                self._group_of[id(p)] = gi
        in_stack = {id(p) for _, members in self._stacked.values() for p in members}
        self._flat = [p for group in optimizer.param_groups for p in group["params"] if id(p) not in in_stack]
        self._stack_state: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for name, (stack, members) in self._stacked.items():
            groups = {self._group_of.get(id(p)) for p in members}
            if None in groups:
                raise ConfigError(
                    f"optimizer: layer-scanned parameter {name} is missing from the optimizer "
                    "for some layers; allowed: every layer's copy in the same param group"
                )
            if len(groups) != 1:
                raise ConfigError(
                    f"optimizer: layer-scanned parameter {name} is split over param groups "
                    f"{sorted(groups)}; allowed: one group for all layers' copies"
                )
            if optimizer.param_groups[groups.pop()].get("use_muon"):
                self._stack_state[name] = (torch.zeros_like(stack, requires_grad=False),)
                continue
            exp_avg = torch.zeros_like(stack, requires_grad=False)
            exp_avg_sq = torch.zeros_like(stack, requires_grad=False)
            step = torch.zeros(len(members), dtype=torch.float32, device=stack.device)
            self._stack_state[name] = (exp_avg, exp_avg_sq, step)
        self._shards = {
            id(p): muon_shards(p) for group in optimizer.param_groups if group.get("use_muon") for p in group["params"]
        }
        self.refresh()

    def refresh(self) -> int:
        """Make per-layer state view the stacked storage again; return how many were re-pointed."""
        init_adamw_state(self.optimizer)
        fixed = 0
        for name, (_, members) in self._stacked.items():
            keys = ("momentum_buffer",) if len(self._stack_state[name]) == 1 else ("exp_avg", "exp_avg_sq", "step")
            for key, stack in zip(keys, self._stack_state[name]):
                fixed += view_rows(stack, [self.optimizer.state[p][key] for p in members])
        return fixed

    def slots(self) -> list[UpdateSlot]:
        """Current slots (re-read each step: state tensors may have been replaced)."""
        out = []
        for p in self._flat:
            if not p.requires_grad:
                continue
            s = self.optimizer.state[p]
            if "momentum_buffer" in s:
                out.append(
                    UpdateSlot(
                        p,
                        None,
                        None,
                        None,
                        self._group_of[id(p)],
                        momentum=s["momentum_buffer"],
                        shards=self._shards[id(p)],
                    )
                )
                continue
            out.append(UpdateSlot(p, s["exp_avg"], s["exp_avg_sq"], s["step"], self._group_of[id(p)]))
        for name, (stack, members) in self._stacked.items():
            if not stack.requires_grad:
                continue
            if len(self._stack_state[name]) == 1:
                shards = tuple((m, md, d + 1, i, n, f) for m, md, d, i, n, f in self._shards[id(members[0])])
                out.append(
                    UpdateSlot(
                        stack,
                        None,
                        None,
                        None,
                        self._group_of[id(members[0])],
                        members,
                        momentum=self._stack_state[name][0],
                        shards=shards,
                    )
                )
                continue
            exp_avg, exp_avg_sq, step = self._stack_state[name]
            out.append(UpdateSlot(stack, exp_avg, exp_avg_sq, step, self._group_of[id(members[0])], members))
        return out

    def hyperparams(self) -> list[dict]:
        """(beta1, beta2, eps, weight_decay) per param group, as Python floats (baked into the graph)."""
        out = []
        for group in self.optimizer.param_groups:
            if group.get("use_muon"):
                out.append(
                    {
                        "momentum": float(group["momentum"]),
                        "nesterov": bool(group["nesterov"]),
                        "ns_steps": int(group["ns_steps"]),
                        "ns_dtype": group["ns_dtype"],
                        "weight_decay": float(group["weight_decay"]),
                    }
                )
                continue
            beta1, beta2 = group["betas"]
            out.append(
                {
                    "beta1": float(beta1),
                    "beta2": float(beta2),
                    "eps": float(group["eps"]),
                    "weight_decay": float(group["weight_decay"]),
                }
            )
        return out

    def set_lr(self, lr: float) -> None:
        """Keep `param_groups[i]["lr"]` what the graph used, as the eager optimizer would hold it."""
        for group in self.optimizer.param_groups:
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)
            else:
                group["lr"] = lr


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    *,
    lr: torch.Tensor,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    apply: torch.Tensor | None = None,
) -> None:
    """One AdamW update in place (decoupled weight decay, bias-corrected moments).

    Same arithmetic as `torch.optim.adamw`'s single-tensor path; `step` (and so the bias
    corrections) may be a `[n_layers]` vector for a stacked `[n_layers, ...]` parameter.
    `apply` (a 0-dim bool tensor) gates the update on the device: where it is False, parameter,
    moments and step keep their values (a skipped step, with no host sync).
    """
    if apply is None:
        step.add_(1)
    else:
        step.add_(apply.to(step.dtype))
    new_param = param * (1 - lr * weight_decay) if weight_decay != 0 else param
    new_avg = exp_avg.lerp(grad, 1 - beta1)
    new_avg_sq = exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - torch.pow(beta1, step)
    bias_correction2 = 1 - torch.pow(beta2, step)
    if step.dim() == 1:  # stacked: one bias correction per layer, broadcast over the row
        shape = (-1,) + (1,) * (param.dim() - 1)
        bias_correction1 = bias_correction1.view(shape)
        bias_correction2 = bias_correction2.view(shape)
    step_size = lr / bias_correction1
    denom = (new_avg_sq.sqrt() / bias_correction2.sqrt()).add_(eps)
    new_param = new_param - step_size * (new_avg / denom)
    if apply is not None:
        new_param = torch.where(apply, new_param, param)
        new_avg = torch.where(apply, new_avg, exp_avg)
        new_avg_sq = torch.where(apply, new_avg_sq, exp_avg_sq)
    param.copy_(new_param)
    exp_avg.copy_(new_avg)
    exp_avg_sq.copy_(new_avg_sq)


def muon_shards(p: torch.Tensor) -> tuple:
    """`(mesh, mesh_dim, tensor_dim, index, size, full)` per mesh axis over which parameter `p`
    is sharded (empty: whole on this rank); `full` is the dim's global length. Each sharded dim
    must be sharded by one mesh axis (no _StridedShard). Uneven splits are allowed: DTensor's
    `Shard` gives ranks chunks of ceil(full / size) rows, the last ones fewer or none (Kimi K2's
    `wq_a`, 1536 rows, over 1024 FSDP ranks: 768 ranks hold 2 rows, 256 hold none)."""
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(p, DTensor):
        return ()
    mesh, out, dims = p.device_mesh, [], set()
    for mesh_dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            continue
        size = mesh.size(mesh_dim)
        if type(placement) is not Shard or placement.dim in dims:
            raise ConfigError(
                f"optimizer.name: graph-mode Muon gathers matrices sharded once per dim; a parameter "
                f"of shape {tuple(p.shape)} has placements {p.placements}; allowed: optimizer.name = "
                '"adamw", or compile.mode = "eager"'
            )
        dims.add(placement.dim)
        out.append((mesh, mesh_dim, placement.dim, shard_rank(mesh, mesh_dim), size, p.shape[placement.dim]))
    return tuple(out)


def muon_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    momentum_buffer: torch.Tensor,
    *,
    lr: torch.Tensor,
    momentum: float,
    nesterov: bool,
    ns_steps: int,
    ns_dtype: str,
    weight_decay: float,
    apply: torch.Tensor | None = None,
    shards: tuple = (),
) -> None:
    """One Muon update in place on local tensors (the arithmetic of `trainer.optim.muon.Muon`).

    `shards` (`muon_shards`) says how the local tensors are cut from the whole one; Newton-Schulz
    needs whole matrices (the last two dims), so (`orthogonalize_sharded`):
    - a shard of a leading dim (stacked layers, experts) needs nothing: whole matrices, each
      orthogonalised on the rank that holds it;
    - the matrix dim sharded over the largest mesh axis is redistributed by an all-to-all from
      "rows of every matrix" to "whole matrices, ceil(B / D) of the B on each of the D ranks",
      orthogonalised there and sent back by the inverse all-to-all;
    - a second sharded matrix dim (TP rowwise beside FSDP) is all-gathered first and cut back last.
    `apply` gates the update on the device, as in `adamw_update_`.
    """
    from trainer.optim.muon import NS_DTYPES

    new_buf = momentum_buffer.lerp(grad, 1 - momentum)
    u = grad.lerp(new_buf, momentum) if nesterov else new_buf
    o = orthogonalize_sharded(u, shards, steps=ns_steps, dtype=NS_DTYPES[ns_dtype])
    new_param = param * (1 - lr * weight_decay) if weight_decay != 0 else param
    new_param = new_param - lr * o
    if apply is not None:
        new_param = torch.where(apply, new_param, param)
        new_buf = torch.where(apply, new_buf, momentum_buffer)
    param.copy_(new_param)
    momentum_buffer.copy_(new_buf)


def orthogonalize_sharded(u: torch.Tensor, shards: tuple, *, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Muon's scaled Newton-Schulz of the whole tensor that `u` is this rank's shard of, returned
    as this rank's shard (see `muon_update_`). Every rank must call it with the same `shards`
    layout (the collectives are matched by order)."""
    from trainer.optim.muon import newton_schulz5, update_scale

    matrix_dims = [s for s in shards if s[2] >= u.ndim - 2]  # shards of leading dims need nothing
    if not matrix_dims:
        return newton_schulz5(u, steps=steps, dtype=dtype).to(u.dtype) * update_scale(u.shape)
    # The dim over the most ranks is spread by all-to-all; by position, not identity (Dynamo
    # rebuilds tuples, so `is` does not hold inside the captured step).
    at = max(range(len(matrix_dims)), key=lambda i: matrix_dims[i][4])
    spread, gathered = matrix_dims[at], matrix_dims[:at] + matrix_dims[at + 1 :]
    for mesh, mesh_dim, dim, _, size, full in gathered:
        chunk = -(-full // size)
        u = funcol.all_gather_tensor(_pad_dim(u, dim, chunk), dim, (mesh, mesh_dim)).narrow(dim, 0, full)
    o = _orthogonalize_spread(u, spread, steps=steps, dtype=dtype)
    for _, _, dim, index, size, full in gathered:
        chunk = -(-full // size)
        start = min(index * chunk, full)
        o = o.narrow(dim, start, min(full, start + chunk) - start)
    return o


def _orthogonalize_spread(u: torch.Tensor, shard: tuple, *, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """Newton-Schulz of matrices whose dim `shard[2]` (one of the last two) is split over a mesh
    axis of D ranks, by two all-to-alls of equal splits (what XLA's all-to-all takes):

        [B, rows/D (padded to c), n]  --all-to-all-->  [ceil(B/D), D*c -> rows, n]  (whole matrices)

    Each rank sends and receives ceil(B/D) x rows x n x (D-1)/D elements per direction, against
    B x rows x n x (D-1)/D for all-gathering the whole stack, and holds ceil(B/D) whole matrices
    instead of B. Padding (rows to D*c, B to D*ceil(B/D)) is zeros, which Newton-Schulz maps to
    zeros (the norm's eps), and is cut off before the result is used.
    """
    from trainer.optim.muon import newton_schulz5, update_scale

    mesh, mesh_dim, dim, _, size, full = shard
    group = (mesh, mesh_dim)
    transposed = dim == u.ndim - 1  # NS(x^T) = NS(x)^T exactly: newton_schulz5 orients by shape
    x = u.mT if transposed else u
    lead, local_rows, cols = x.shape[:-2], x.shape[-2], x.shape[-1]
    chunk = -(-full // size)
    count = math.prod(lead)
    x = _pad_dim(x.reshape(count, local_rows, cols), 1, chunk)
    per_rank = -(-count // size)
    x = _pad_dim(x, 0, per_rank * size)  # rank j gets matrices [j * per_rank, (j + 1) * per_rank)
    splits = [per_rank] * size  # equal; given explicitly (Dynamo traced None as one split per group)
    x = funcol.all_to_all_single(x.contiguous(), splits, splits, group)
    whole = x.reshape(size, per_rank, chunk, cols).transpose(0, 1).reshape(per_rank, size * chunk, cols)
    whole = whole.narrow(1, 0, full)
    o = newton_schulz5(whole, steps=steps, dtype=dtype).to(u.dtype) * update_scale((full, cols))
    o = _pad_dim(o, 1, size * chunk).reshape(per_rank, size, chunk, cols).transpose(0, 1)
    o = funcol.all_to_all_single(o.reshape(size * per_rank, chunk, cols).contiguous(), splits, splits, group)
    o = o.narrow(0, 0, count).narrow(1, 0, local_rows).reshape(*lead, local_rows, cols)
    return o.mT if transposed else o


def _pad_dim(t: torch.Tensor, dim: int, length: int) -> torch.Tensor:
    """`t` zero-padded at the end of `dim` to `length` (unchanged when it already is)."""
    if t.shape[dim] == length:
        return t
    pad = [0, 0] * (t.ndim - 1 - dim) + [0, length - t.shape[dim]]
    return torch.nn.functional.pad(t, pad)


def clip_grads_(
    grads: list[torch.Tensor], max_norm: float, reduce_axes: list[tuple], total_axes: tuple = ()
) -> torch.Tensor:
    """Scale `grads` in place to a global L2 norm of at most `max_norm`; return the norm.

    `grads` are plain tensors (a DTensor gradient's local shard); `reduce_axes[i]` lists the
    `(mesh, mesh_dim)` pairs over which gradient i's shards are summed (empty when the whole
    gradient is on this rank); `total_axes` those over which the whole squared norm is summed
    (pipeline parallelism: the pp axis, each rank holding other parameters). `max_norm <= 0` only
    measures. Same formula as `torch.nn.utils.clip_grad_norm_`: coef = min(1, max_norm / (norm + 1e-6)).
    """
    groups: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    for g, axes in zip(grads, reduce_axes):
        groups[axes].append(g)
    totals = []
    for axes, group in groups.items():
        norms = torch.stack([torch.linalg.vector_norm(g, 2, dtype=torch.float32) for g in group])
        value = norms.pow(2).sum()
        for mesh, dim in axes:
            value = funcol.all_reduce(value, "sum", (mesh, dim))
        totals.append(value)
    total = torch.stack(totals).sum()
    for mesh, dim in total_axes:
        total = funcol.all_reduce(total, "sum", (mesh, dim))
    total = total.sqrt()
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.dtype))
    return total


def grad_reduce_axes(grad_like: torch.Tensor) -> tuple:
    """Mesh axes over which a gradient shaped like `grad_like` (a parameter) is sharded."""
    if not isinstance(grad_like, DTensor):
        return ()
    mesh = grad_like.device_mesh
    return tuple((mesh, i) for i, p in enumerate(grad_like.placements) if not p.is_replicate())


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t
