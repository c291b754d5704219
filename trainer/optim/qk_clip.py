"""MuonClip's QK clip (Kimi K2, 2025): cap each attention head's pre-softmax logits at tau.

After an optimizer step, a head h whose largest logit S_h = max q.k / sqrt(d) of the step (over
the whole global batch) exceeded `tau` gets the factor gamma_h = tau / S_h (< 1) applied to its
logits through the weights, so the same inputs would now reach at most tau:

- standard multi-head attention (n_heads == n_kv_heads): W_q and W_k rows of head h each scaled
  by sqrt(gamma_h) (the paper's rule: the logit is bilinear in q and k);
- grouped-query attention (a k head shared by several q heads): W_q rows of head h scaled by
  gamma_h, the shared W_k untouched. Our choice, the GQA analogue of the paper's rule for MLA's
  shared rotary key (below): each head's logits scale by exactly its own gamma_h, where scaling
  the shared k by the group's minimum would also shrink the logits of heads that were below tau;
- MLA (DeepSeek-V3, `models.deepseek_v3.model.MLA`): the head-specific parts q_C, k_C (the
  "nope" dims of W_q -- W_q_b with the low-rank query -- and of the key half of W_kv_b) each by
  sqrt(gamma_h), the head's rotary q_R rows by gamma_h, the rotary key k_R (shared by all heads,
  from W_kv_a) untouched: `mla_qk_clip_`. MLA's logit is softmax_scale * q.k (YaRN's mscale
  included), which the module tracks as it is.

gamma_h = tau / S_h if S_h > tau else 1: heads under tau are multiplied by exactly 1. Every data-parallel
rank saw a different part of the batch and holds (a shard of) the same weights; with tensor
parallelism a rank runs (and tracks) only its own heads, a contiguous block of them (the plans
shard W_q / W_k / W_q_b / W_kv_b colwise, Shard(0) on the `tp` axis). So each rank writes its
local maxima at its heads' offset into a [n_heads] row of -inf and one all-reduce (MAX) over
all ranks gives every rank every head's global max; the scale is built for the full weight and
each rank multiplies its own shard's rows (no gather of weights). The scale runs every step with
no host sync.

Not supported (ConfigError where the job is built): q/k-norm models (Qwen 3: the logits are set
by the norms' weights, which scaling W_q/W_k does not change), context parallelism (a rank's
logits see only its own keys), graph mode (the captured step does not run the tracking's side
effect nor this clip).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from models.errors import ConfigError
from parallelisms.device_order import shard_rank


def clip_factors(max_logit: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma_h = tau / S_h where S_h > tau, else 1 (fp32). Not `min(1, tau / S_h)`: a head whose
    largest logit is negative (or -inf, no pair seen) would get a negative (or -0) factor."""
    s = max_logit.float()
    return torch.where(s > tau, tau / s, torch.ones_like(s))


def gqa_qk_clip_(wq: torch.Tensor, wk: torch.Tensor, max_logit: torch.Tensor, tau: float) -> None:
    """Clip standard / grouped-query attention in place. wq [n_heads*d, dim], wk [n_kv*d, dim]
    (nn.Linear weights, plain or DTensor), max_logit [n_heads]."""
    n_heads = max_logit.numel()
    n_kv = wk.shape[0] * n_heads // wq.shape[0]
    gamma = clip_factors(max_logit, tau)
    if n_kv == n_heads:
        _scale_head_rows_(wq, gamma.sqrt())
        _scale_head_rows_(wk, gamma.sqrt())
    else:
        _scale_head_rows_(wq, gamma)


def mla_qk_clip_(
    weights: dict[str, torch.Tensor],
    max_logit: torch.Tensor,
    tau: float,
    *,
    n_heads: int,
    qk_nope_head_dim: int,
    qk_rope_head_dim: int,
    v_head_dim: int,
) -> None:
    """Clip one MLA layer in place, DeepSeek-V3's weight layout:
    `weights["wq"]` [n_heads * (nope + rope), q_in] (W_q, or W_q_b after the q LoRA), each head's
    rows nope first then rope; `weights["wkv_b"]` [n_heads * (nope + v), kv_lora], each head's rows
    k_nope then v. The shared rotary key (in W_kv_a) is not touched."""
    gamma = clip_factors(max_logit, tau)
    wq, wkv_b = weights["wq"], weights["wkv_b"]
    q_rows = torch.cat(
        [gamma.sqrt()[:, None].expand(n_heads, qk_nope_head_dim), gamma[:, None].expand(n_heads, qk_rope_head_dim)],
        dim=1,
    ).reshape(-1)
    kv_rows = torch.cat(
        [gamma.sqrt()[:, None].expand(n_heads, qk_nope_head_dim), torch.ones(n_heads, v_head_dim, device=gamma.device)],
        dim=1,
    ).reshape(-1)
    _scale_rows_(wq, q_rows)
    _scale_rows_(wkv_b, kv_rows)


def _scale_head_rows_(w: torch.Tensor, per_head: torch.Tensor) -> None:
    rows_per_head = w.shape[0] // per_head.numel()
    _scale_rows_(w, per_head.repeat_interleave(rows_per_head))


@torch.no_grad()
def _scale_rows_(w: torch.Tensor, per_row: torch.Tensor) -> None:
    """w[i, :] *= per_row[i]; a DTensor's local shard takes its own rows (no communication)."""
    scale = per_row.to(torch.float32)[:, None].expand(w.shape).to(w.dtype)
    if isinstance(w, DTensor):
        local = distribute_tensor(scale.contiguous(), w.device_mesh, w.placements, src_data_rank=None).to_local()
        w.to_local().mul_(local)
    else:
        w.mul_(scale)


def _tp_coordinate(w: torch.Tensor) -> tuple[int, int]:
    """(rank, size) of `w`'s `tp` mesh axis: (0, 1) for a plain tensor or a mesh without TP.
    The heads of a colwise weight are split in contiguous blocks over that axis."""
    if not isinstance(w, DTensor):
        return 0, 1
    mesh = w.device_mesh
    names = mesh.mesh_dim_names or ()
    if "tp" not in names or mesh.size(names.index("tp")) == 1:
        return 0, 1
    axis = names.index("tp")
    assert isinstance(w.placements[axis], Shard) and w.placements[axis].dim == 0, (
        f"QK clip: a head projection must be colwise (Shard(0)) on tp, got {w.placements}"
    )
    return shard_rank(mesh, "tp"), mesh.size(axis)


class _Head:
    """One attention module as QK clip sees it: its head weights (the stored parameters) and how
    to apply the rule to them."""

    def __init__(self, module: nn.Module):
        from models.common.attention import Attention

        self.module = module
        self.mla = not isinstance(module, Attention)
        # `_parameters`: SimpleFSDP computes `linear.weight` (the gathered weight) through a
        # property; the stored parameter (the shard the optimizer updates) stays there.
        if isinstance(module, Attention):
            self.wq = module.wq._parameters["weight"]
            self.wk = module.wk._parameters["weight"]
            self.n_heads = self.wq.shape[0] // module.head_dim
        else:  # MLA
            self.wq = (module.wq_b if module.q_lora_rank > 0 else module.wq)._parameters["weight"]
            self.wk = module.wkv_b._parameters["weight"]
            self.n_heads = self.wq.shape[0] // module.qk_head_dim
        self.tp_rank, self.tp_size = _tp_coordinate(self.wq)
        assert self.n_heads % self.tp_size == 0, (self.n_heads, self.tp_size)

    def global_row(self) -> torch.Tensor:
        """This rank's tracked maxima [local heads] at their place in a [n_heads] row of -inf."""
        local = self.module.max_logit
        n_local = self.n_heads // self.tp_size
        assert local.numel() == n_local, (local.shape, self.n_heads, self.tp_size)
        row = torch.full((self.n_heads,), float("-inf"), dtype=torch.float32, device=local.device)
        row[self.tp_rank * n_local : (self.tp_rank + 1) * n_local] = local.float()
        return row

    def clip(self, max_logit: torch.Tensor, tau: float) -> None:
        m = self.module
        if self.mla:
            mla_qk_clip_(
                {"wq": self.wq, "wkv_b": self.wk},
                max_logit,
                tau,
                n_heads=self.n_heads,
                qk_nope_head_dim=m.qk_nope_head_dim,
                qk_rope_head_dim=m.qk_rope_head_dim,
                v_head_dim=m.v_head_dim,
            )
        else:
            gqa_qk_clip_(self.wq, self.wk, max_logit, tau)


class QKClip:
    """The MuonClip hook of one model: turns on max-logit tracking in its attention modules
    (`Attention`: Llama 3, Qwen 3 without qk-norm; `MLA`: DeepSeek-V3 / Kimi K2), and after each
    optimizer step clips the heads over `tau` and resets the tracking."""

    def __init__(self, model: nn.Module, tau: float):
        from models.common.attention import Attention
        from models.deepseek_v3.model import MLA

        self.tau = float(tau)
        self.modules = [m for m in model.modules() if isinstance(m, (Attention, MLA))]
        if not self.modules:
            raise ConfigError(
                "optimizer.qk_clip_tau: the model has no attention modules QK clip knows "
                "(standard multi-head / grouped-query attention, MLA); allowed: 0 for this model"
            )
        if any(isinstance(m, Attention) and m.q_norm is not None for m in self.modules):
            raise ConfigError(
                "optimizer.qk_clip_tau: the model normalises q and k per head (qk_norm), so "
                "scaling W_q/W_k does not change its logits; allowed: 0 for this model"
            )
        self.heads = [_Head(m) for m in self.modules]
        for m in self.modules:
            m.track_max_logit = True

    def reset(self) -> None:
        for m in self.modules:
            m.max_logit = None

    @torch.no_grad()
    def apply(self) -> None:
        """Clip every head whose tracked max logit exceeded tau; then reset the tracking."""
        tracked = [h for h in self.heads if h.module.max_logit is not None]
        if not tracked:
            return
        rows = [h.global_row() for h in tracked]
        maxes = torch.cat(rows)  # [sum of n_heads]: each module's heads, global index
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        for h, row in zip(tracked, maxes.split([r.numel() for r in rows])):
            h.clip(row, self.tau)
        self.reset()
