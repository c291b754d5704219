"""Multi-token prediction (MTP), shared by the families that have it: DeepSeek-V3 / Kimi K2
(section 2.2 of the V3 report) and Qwen 3.5 (the hub checkpoints' `mtp.*`, which the serving
engines run and transformers does not load).

One MTP module k maps the hidden state of the depth before, h^{k-1}, and the shared embedding of
the token k places ahead, Emb(t[i + k]), to h^k:

    x   = proj(cat[norm_e(Emb(t[i + k])), norm_h(h^{k-1})])      (2 dim -> dim, no bias; embedding first)
    h^k = blocks(x)                                               (the family's decoder block(s))
    out = norm(h^k)                                               (what the shared output head projects)

and the shared head predicts t[i + k + 1] from `out`. The families differ only in the norm kind
(DeepSeek: RMSNorm `w x / rms(x)`; Qwen 3.5: zero-centred `(1 + w) x / rms(x)`), the parameter
names (their checkpoints': `enorm`, `hnorm`, `eh_proj` / `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `fc`), the block, and what depth 1 reads as h^0 (DeepSeek: the last main
block's output before the final norm; Qwen 3.5, as its serving code runs the released weights:
the main model's final-normed hidden state). `MTPModule` is parameterised by those; `mtp_forward`
runs the depths; `check_mtp_args` is the `[model]` keys' check.

The modules sit outside the model's block stacks, each with its own `BlockStack` (so an MoE
block's aux loss and expert load reach the trainer as a main block's, and layer scan, FSDP's block
wrapping and activation checkpointing never take it for a main block).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from models.common.init import trunc_normal_
from models.common.stack import BlockStack


@dataclass(frozen=True)
class MTPNames:
    """The attribute (and so state-dict) names of a module's two input norms and its projection."""

    embedding_norm: str
    hidden_norm: str
    projection: str


DEEPSEEK_NAMES = MTPNames(embedding_norm="enorm", hidden_norm="hnorm", projection="eh_proj")
"""DeepSeek-V3's names (TorchTitan's; the HF checkpoint's layer n_layers + k - 1 has the same)."""
QWEN_NAMES = MTPNames(embedding_norm="pre_fc_norm_embedding", hidden_norm="pre_fc_norm_hidden", projection="fc")
"""Qwen 3.5's names (the hub checkpoints' `mtp.*`)."""


class MTPModule(nn.Module):
    """One MTP module without the shared embedding and head (see the module docstring).

    `forward(h_prev, emb_next, *block_args) -> (h, normed)`: `h_prev` h^{k-1} and `emb_next`
    Emb(t[i + k]), both [batch, seq, dim]; `block_args` what the blocks take after h (RoPE
    tables, segment ids). `norm()` builds one norm of `dim` (the family's kind)."""

    def __init__(self, *, dim: int, blocks: Iterable[nn.Module], norm: Callable[[], nn.Module], names: MTPNames):
        super().__init__()
        self._names = names
        # Registered in the checkpoints' order: the two input norms, the projection, the blocks, the norm.
        setattr(self, names.embedding_norm, norm())
        setattr(self, names.hidden_norm, norm())
        setattr(self, names.projection, nn.Linear(2 * dim, dim, bias=False))
        self.layers = BlockStack(blocks)
        self.norm = norm()

    def forward(
        self, h_prev: torch.Tensor, emb_next: torch.Tensor, *block_args: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = self._names
        x = torch.cat([getattr(self, n.embedding_norm)(emb_next), getattr(self, n.hidden_norm)(h_prev)], dim=-1)
        h = self.layers(getattr(self, n.projection)(x), *block_args)
        return h, self.norm(h)

    def init_weights(self) -> None:
        """The three norms: their own init (DeepSeek's ones, Qwen 3.5's zeros); the projection:
        truncated normal, std 0.02; each block as a main block of its depth (`block.init_weights`)."""
        n = self._names
        for name in (n.embedding_norm, n.hidden_norm, "norm"):
            getattr(self, name).init_weights()
        trunc_normal_(getattr(self, n.projection).weight, std=0.02)
        for block in self.layers.values():
            block.init_weights()


def shifted_embedding(emb: torch.Tensor, k: int) -> torch.Tensor:
    """`emb` [batch, seq, dim] shifted left by k: position i holds Emb(t[i + k]); the last k
    positions, which have no token k ahead, get zeros (their predictions have no target)."""
    return torch.cat([emb[:, k:], emb.new_zeros(emb.shape[0], k, emb.shape[2])], dim=1)


def mtp_forward(
    modules: Sequence[MTPModule], emb: torch.Tensor, h0: torch.Tensor, block_args: tuple[torch.Tensor, ...]
) -> list[torch.Tensor]:
    """The normed outputs of depths 1..D ([batch, seq, dim] each): depth k runs `modules[k - 1]`
    on h^{k-1} (depth 1: `h0`, the family's choice) and the embedding shifted by k, keeping the
    sequence length (causal attention keeps the zero-embedded tail from every earlier position).
    Positions and segment ids in `block_args` are those of position i."""
    out, h = [], h0
    for k, module in enumerate(modules, start=1):
        h, normed = module(h, shifted_embedding(emb, k), *block_args)
        out.append(normed)
    return out


def add_mtp_aux_loss(total: torch.Tensor | None, modules: Iterable[MTPModule]) -> torch.Tensor | None:
    """`total` plus the MTP modules' blocks' aux loss of the last forward (those that ran one)."""
    for module in modules:
        aux = module.layers.pop_aux_loss()
        if aux is not None:
            total = aux if total is None else total + aux
    return total


def check_mtp_args(depth: int, weight: float, *, max_depth: int | None, example: str) -> None:
    """ValueError (one line, `allowed:`) for a bad `mtp_depth` (>= 0, at most `max_depth` when
    given) or `mtp_loss_weight` (finite, >= 0). `example`: the family's published values."""
    if depth < 0 or (max_depth is not None and depth > max_depth):
        most = {None: "a number of MTP modules >= 1", 1: "1 MTP module"}.get(max_depth, f"1 .. {max_depth} MTP modules")
        raise ValueError(
            f"mtp_depth: must be >= 0{'' if max_depth is None else f' and <= {max_depth}'}, got {depth}; "
            f"allowed: 0 (no multi-token prediction) or {most} ({example})"
        )
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(
            f"mtp_loss_weight: must be a finite number >= 0, got {weight}; allowed: >= 0 (DeepSeek-V3: 0.3, then 0.1)"
        )
