"""The planner's context-parallel terms for Qwen 3.5's Gated DeltaNet blocks (planner/activations.py
`cp_delta_rule_bytes`, `DeltaRuleShape`; docs/planner.md, "Context parallelism: linear attention").

Under cp, parallelisms/context_parallel_linear.py runs the delta rule on the rank's two chunks as a
batch of 2b with values `[v | 0]` (dv + dk columns) from the state `[0 | I]`, all-gathers every
chunk's `[F | Pi]` and folds them in sequence order. Before this, the planner counted a linear block
at cp > 1 as the full-attention block under cp (gathered k/v, which a linear block never gathers)
and nothing of the wrapper.

- The formula equals, to the byte, what the wrapper keeps for backward beyond the op alone on the
  same tokens, measured with the planner's own recorder (`saved_bytes`) on the CPU: the op served
  with the TPU kernel's autograd (titan_kernels/tpu/register.py: it keeps its prepared inputs), the
  cp all-gather replaced by a local concatenation of the same shape (its backward, a
  reduce-scatter, keeps nothing either). cp 1, 2, 4, rank 0 (the heaviest: its fold runs through
  every chunk) and the last rank, GQA heads and dk != dv, so each term's shape is pinned.
- The hybrid stack's activation bytes (Qwen 3.5 debug, cp 2): three linear blocks as the stand-in
  at cp = 1 on the rank's tokens plus the wrapper's bytes, one full-attention block as before; by
  hand from the shapes. The old figure (every block a full-attention block under cp) fails it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import planner.activations as P
from models.qwen3_5.args import FLAVORS
from parallelisms import context_parallel_linear as cpl
from parallelisms.context_parallel import CPGroup
from tests.support.delta_kernel import kernel as _kernel


def _kept(fn, inputs) -> int:
    """Bytes `fn(*inputs)` keeps for backward (the inputs, held as parameters, excluded)."""
    holder = nn.Module()
    for i, t in enumerate(inputs):
        holder.register_parameter(f"x{i}", nn.Parameter(t))
    params = list(holder.parameters())
    return P.saved_bytes(holder, lambda: fn(*params, qk_l2norm=True)[0].float().sum())


@pytest.mark.parametrize("cp, rank", [(1, 0), (2, 0), (2, 1), (4, 0), (4, 3)])
def test_cp_delta_rule_bytes_are_what_the_wrapper_keeps(cp, rank, monkeypatch):
    b, s_local, hk, hv, dk, dv = 2, 128, 1, 3, 32, 48  # GQA 1 -> 3 heads, dk != dv
    # the all-gather of the [F | Pi] of the 2 cp chunks: here the rank's own two, cp times
    monkeypatch.setattr(cpl, "gather_sequence", lambda x, dim, group: torch.cat([x] * group.size, dim=dim))
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(b, s_local, hk, dk, generator=gen).bfloat16(),
        torch.randn(b, s_local, hk, dk, generator=gen).bfloat16(),
        torch.randn(b, s_local, hv, dv, generator=gen).bfloat16(),
        -torch.rand(b, s_local, hv, generator=gen),
        torch.rand(b, s_local, hv, generator=gen).bfloat16(),
    ]
    alone = _kept(_kernel, inputs)
    wrapped = _kept(cpl.cp_gated_delta_rule(CPGroup(None, cp, rank), _kernel), inputs)
    shape = P.DeltaRuleShape(layers=1, v_heads=hv, k_dim=dk, v_dim=dv)
    predicted = P.cp_delta_rule_bytes(shape, local_batch_size=b, seq_len=s_local * cp, cp=cp)
    # Rank 0's fold runs up to its late chunk, the sequence's last (2 cp - 2 steps with a state that
    # needs a gradient, each keeping its state); the last rank's late chunk is chunk cp: cp - 1 fewer.
    state = 4 * b * hv * dk * dv
    fewer = (cp - 1) * state if rank == cp - 1 and cp > 1 else 0
    assert wrapped - alone == predicted.saved - fewer
    # the terms, by hand (T = b s_local tokens, fp32): [v | 0]'s dk columns, [0 | I], the fp32 output
    # at dv + dk, the two start states, the fold's live steps
    t = b * s_local
    by_hand = (
        4 * t * hv * dk + 4 * 2 * b * hv * dk * (dv + dk) + 4 * t * hv * (dv + dk) + 4 * 2 * b * hv * dk * dv
    ) + (2 * cp - 2) * state
    gathered = 4 * 2 * cp * b * hv * dk * (dv + dk)  # every chunk's [F | Pi], kept by the fold's views
    assert predicted.saved == by_hand + (gathered if cp > 1 else 0)
    assert predicted.gathered == gathered


def test_qwen3_5_debug_at_cp_2_counts_the_linear_blocks_as_the_code_runs_them():
    """Qwen 3.5 debug (3 Gated DeltaNet blocks, 1 full attention), 8 x 512 tokens at cp 2, AC none."""
    args = FLAVORS["debugmodel"]
    shape, delta = args.shape(), P.DeltaRuleShape.of(args)
    assert delta == P.DeltaRuleShape(layers=3, v_heads=4, k_dim=64, v_dim=64, k_heads=2, conv_kernel=4, rotary_dim=16)
    b, s, cp = 8, 512, 2
    kw = dict(local_batch_size=b, tp=1, ac_mode="none", loss_parallel=False)
    new = P.activation_bytes(shape, seq_len=s, cp=cp, delta=delta, **kw)
    old = P.activation_bytes(shape, seq_len=s, cp=cp, **kw)  # every block a full-attention block under cp
    # a linear block at cp = 1 on T tokens (its own count, tests/unit/test_planner_delta_block.py)
    all_linear = dataclasses.replace(delta, layers=args.n_layers)
    stand_in = P.activation_bytes(shape, seq_len=s // cp, delta=all_linear, **kw).per_block
    full_extra = 2 * 2 * args.dim * (b * s // cp)  # Qwen 3.5's fp32 norms, in the full block too
    h, kv, hd = args.n_heads, args.n_kv_heads, args.head_dim  # and its output gate, q / k norms, RoPE rows
    full_extra += (4 * h * hd + 2 * (h + kv) * hd) * (b * s // cp) + 2 * 4 * delta.rotary_dim * (s // cp)
    t, h, dk, dv = b * s // cp, 4, 64, 64
    wrapper = (
        4 * t * h * dk  # [v | 0]: dk more value columns, fp32
        + 4 * 2 * b * h * dk * (dv + dk)  # [0 | I], contiguous for the kernel
        + 4 * t * h * (dv + dk)  # the fp32 output [o^0 | Phi^T q]
        + 4 * 2 * b * h * dk * dv  # the two start states
        + (2 * cp - 2) * 4 * b * h * dk * dv  # the fold's live steps' states S_j
        + 4 * 2 * cp * b * h * dk * (dv + dk)  # the gathered [F | Pi] they keep a view of
    )
    assert wrapper == 14 * 2**20  # 14 MiB per linear block on rank 0
    assert new.blocks == 3 * (stand_in + wrapper) + old.per_block + full_extra
    assert new.per_block == stand_in + wrapper  # the larger kind
    assert new.outside == old.outside and new.loss == old.loss
    assert old.blocks == 4 * old.per_block  # the old figure (every block a full-attention one) ...
    assert new.blocks - old.blocks == 3 * (stand_in + wrapper - old.per_block) + full_extra  # ... misses this
    # The block backward's cp transient: the [F | Pi] gradient of 2 cp chunks (4 MiB) and the
    # kernel backward's chunk-start states at dk more columns (2 b chunks of 128 tokens, 2 kernel
    # chunks each), against the full-attention block's gathered k/v gradients (2 MiB).
    gathered = 4 * 2 * cp * b * h * dk * (dv + dk)
    assert new.cp_backward == gathered + 4 * 2 * b * h * 2 * dk * dk
    assert new.cp_backward > P.cp_gathered_kv_bytes(shape, local_batch_size=b, seq_len=s, tp=1, cp=cp)
    # cp = 1: no wrapper, no cp transient
    one = P.activation_bytes(shape, seq_len=s, cp=1, delta=delta, **kw)
    own = P.activation_bytes(shape, seq_len=s, delta=all_linear, **kw).per_block
    full_one = (
        P.activation_bytes(shape, seq_len=s, **kw).per_block + 2 * full_extra
    )  # cp = 1: twice the tokens and positions
    assert one.blocks == 3 * own + full_one and one.cp_backward is None
    # AC full keeps the block inputs only; the wrapper's bytes are in the recompute (per_block_none)
    full = P.activation_bytes(shape, seq_len=s, cp=cp, delta=delta, **{**kw, "ac_mode": "full"})
    assert full.blocks == 4 * P.activation_bytes(shape, seq_len=s, cp=cp, **{**kw, "ac_mode": "full"}).per_block
    assert full.per_block_none == new.per_block_none
