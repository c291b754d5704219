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
- MLA (DeepSeek-V3): the head-specific parts q_C, k_C (the "nope" dims of W_q and of the key half
  of W_kv_b) each by sqrt(gamma_h), the head's rotary q_R rows by gamma_h, the rotary key k_R
  (shared by all heads) untouched: `mla_qk_clip_`, a function over the named weights, not
  wired to a model yet (no MLA family in this tree).

gamma_h = min(1, tau / S_h), so heads below tau are multiplied by exactly 1. The max logits are
all-reduced (MAX) over all ranks: every data-parallel rank saw a different part of the batch
and holds (a shard of) the same weights. The scale runs every step with no host sync.

Not supported (ConfigError where the job is built): tensor parallelism (each rank sees only
its heads; the head index map is not written), q/k-norm models (Qwen 3: the logits are set by
the norms' weights, which scaling W_q/W_k does not change), graph mode (the captured step does
not run the tracking's side effect nor this clip).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.errors import ConfigError


def clip_factors(max_logit: torch.Tensor, tau: float) -> torch.Tensor:
    """gamma_h = min(1, tau / S_h) per head (fp32)."""
    return torch.clamp(tau / max_logit.float(), max=1.0)


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


def mla_qk_clip_(weights: dict[str, torch.Tensor], max_logit: torch.Tensor, tau: float, *, n_heads: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int) -> None:
    """Clip one MLA layer in place, DeepSeek-V3's weight layout:
    `weights["wq"]` [n_heads * (nope + rope), q_in] (W_q, or W_q_b after the q LoRA), each head's
    rows nope first then rope; `weights["wkv_b"]` [n_heads * (nope + v), kv_lora], each head's rows
    k_nope then v. The shared rotary key (in W_kv_a) is not touched."""
    gamma = clip_factors(max_logit, tau)
    wq, wkv_b = weights["wq"], weights["wkv_b"]
    q_rows = torch.cat([gamma.sqrt()[:, None].expand(n_heads, qk_nope_head_dim),
                        gamma[:, None].expand(n_heads, qk_rope_head_dim)], dim=1).reshape(-1)
    kv_rows = torch.cat([gamma.sqrt()[:, None].expand(n_heads, qk_nope_head_dim),
                         torch.ones(n_heads, v_head_dim, device=gamma.device)], dim=1).reshape(-1)
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


class QKClip:
    """The MuonClip hook of one model: turns on max-logit tracking in its attention modules,
    and after each optimizer step clips the heads over `tau` and resets the tracking."""

    def __init__(self, model: nn.Module, tau: float):
        from models.common.attention import Attention

        self.tau = float(tau)
        self.modules = [m for m in model.modules() if isinstance(m, Attention)]
        if not self.modules:
            raise ConfigError("optimizer.qk_clip_tau: the model has no standard attention modules to clip; "
                              "allowed: 0 for this model")
        if any(m.q_norm is not None for m in self.modules):
            raise ConfigError("optimizer.qk_clip_tau: the model normalises q and k per head (qk_norm), so "
                              "scaling W_q/W_k does not change its logits; allowed: 0 for this model")
        for m in self.modules:
            w = m.wq._parameters["weight"]
            if isinstance(w, DTensor) and any(name == "tp" and w.device_mesh.size(i) > 1
                                              for i, name in enumerate(w.device_mesh.mesh_dim_names or ())):
                raise ConfigError("optimizer.qk_clip_tau: QK clip with tensor parallelism is not implemented "
                                  "(each rank tracks only its own heads); allowed: 0, or "
                                  "parallelism.tensor_parallel_degree = 1")
            m.track_max_logit = True

    def reset(self) -> None:
        for m in self.modules:
            m.max_logit = None

    @torch.no_grad()
    def apply(self) -> None:
        """Clip every head whose tracked max logit exceeded tau; then reset the tracking."""
        tracked = [m for m in self.modules if m.max_logit is not None]
        if not tracked:
            return
        maxes = torch.stack([m.max_logit for m in tracked])  # [layers, heads]
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        for m, row in zip(tracked, maxes):
            # `_parameters`: SimpleFSDP computes `linear.weight` (the gathered weight) through a
            # property; the stored parameter (the shard the optimizer updates) stays there.
            gqa_qk_clip_(m.wq._parameters["weight"], m.wk._parameters["weight"], row, self.tau)
        self.reset()
