"""The planner's own count for Qwen 3.5's Gated DeltaNet blocks (planner/activations.py
`_linear_mixer`, docs/planner.md "Linear attention (Qwen 3.5)"), against what eager autograd keeps.

Before, every linear-attention block was counted as a full-attention block (a stand-in). Now the
mixer (models/qwen3_5/model.py `GatedDeltaNet`) has its own terms: the short convolution's input and
output, the beta / g gates, the delta-rule kernel's prepared inputs (the TPU kernel's autograd
keeps them: titan_kernels/tpu/register.py through `gated_delta.call_prepared`), the gated RMSNorm
and out_proj's input. Measured with the planner's own recorder (`saved_bytes`) on the CPU, the op
served with the kernel's autograd as tests/unit/test_planner_cp_linear.py serves it, bf16 weights as
SimpleFSDP's mixed precision gives the block. Equal to the byte, up to the constants by hand.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import planner.activations as P
from models.common import ops
from models.qwen3_5.args import FLAVORS
from models.qwen3_5.model import GatedDeltaNet, Qwen3_5Transformer
from tests.support.delta_kernel import kernel as _kernel


@pytest.fixture
def kernel_op():
    previous = ops.register("gated_delta_rule", _kernel)
    yield
    ops.register("gated_delta_rule", previous)


def _kept(module: nn.Module, x: torch.Tensor, *args) -> int:
    """Bytes `module(x, *args)` keeps for backward; x is held as a parameter (excluded, as the planner
    counts a block's input with the block before it)."""
    holder = nn.Module()
    holder.inner = module
    holder.register_parameter("x", nn.Parameter(x))

    def run():
        out = module(holder.x, *args)
        return (out[0] if isinstance(out, tuple) else out).float().sum()  # the MoE layer: (out, aux)

    return P.saved_bytes(holder, run)


@pytest.mark.parametrize(
    "b, s, hk, hv, dk, dv, taps",
    [(2, 128, 2, 4, 16, 24, 4), (2, 128, 4, 4, 16, 24, 4), (3, 64, 1, 3, 32, 16, 3)],
    ids=["gqa", "no-gqa", "dk>dv-3-taps"],
)
def test_linear_mixer_is_what_the_gated_deltanet_keeps(kernel_op, b, s, hk, hv, dk, dv, taps):
    d = 64
    torch.manual_seed(0)
    mixer = GatedDeltaNet(
        dim=d,
        num_k_heads=hk,
        num_v_heads=hv,
        head_k_dim=dk,
        head_v_dim=dv,
        conv_kernel=taps,
        norm_eps=1e-6,
        chunk_size=64,
    ).bfloat16()
    measured = _kept(mixer, torch.randn(b, s, d).bfloat16(), None, None)
    delta = P.DeltaRuleShape(layers=1, v_heads=hv, k_dim=dk, v_dim=dv, k_heads=hk, conv_kernel=taps)
    m = P._linear_mixer(FLAVORS["debugmodel"].shape(), delta)
    # by hand, per token: conv in + out (bf16), beta (bf16 + fp32), g (3 x fp32), q / k before and after
    # the l2 norm + rsqrt (fp32), v (fp32), reset (int32), the gated norm (16 h dv + 4 h) + out_proj's input (2 h dv)
    conv = 2 * hk * dk + hv * dv
    per_token = 4 * conv + 6 * hv + 12 * hv + 2 * (8 * hv * dk + 4 * hv) + 4 * hv * dv + 4 + 18 * hv * dv + 4 * hv
    per_row = 2 * conv * (taps - 1) + 4 * hv * dk * dv  # conv1d's padded rows, the zero initial state
    assert (m.none, m.none_per_row) == (per_token, per_row)
    # constants: -exp(A_log) (exp and neg, fp32 [h]) and the loss scalar the recorder holds
    assert measured == per_token * b * s + per_row * b + 2 * 4 * hv + 4


def test_qwen3_5_debug_linear_block_at_cp_1(kernel_op):
    """A whole Gated DeltaNet block of Qwen 3.5 debug (zero-centred norms, SwiGLU MLP), AC none,
    against `activation_bytes` of an all-linear stack of its shape."""
    args = FLAVORS["debugmodel"]
    model = Qwen3_5Transformer(args).bfloat16()
    b, s = 2, 128
    block = model.layers["0"]
    assert args.layer_types()[0] == "linear_attention"
    cos, sin = model.rope_cos[:s].bfloat16(), model.rope_sin[:s].bfloat16()
    measured = _kept(block, torch.randn(b, s, args.dim).bfloat16(), cos, sin)
    shape, delta = args.shape(), P.DeltaRuleShape.of(args)
    assert delta == P.DeltaRuleShape(layers=3, v_heads=4, k_dim=64, v_dim=64, k_heads=2, conv_kernel=4, rotary_dim=16)
    kw = dict(local_batch_size=b, seq_len=s, tp=1, ac_mode="none", loss_parallel=False)
    all_linear = P.activation_bytes(shape, delta=P.DeltaRuleShape(args.n_layers, 4, 64, 64, 2, 4), **kw)
    # constants: -exp(A_log) (2 x fp32 [h]), each zero-centred norm's 1 + weight (fp32 [dim]), the loss
    assert measured == all_linear.per_block + 2 * 4 * 4 + 2 * 4 * args.dim + 4
    assert all_linear.blocks == args.n_layers * all_linear.per_block
    # the stand-in (a full-attention block) the planner used before: 38 % low on this block
    stand_in = P.activation_bytes(shape, **kw).per_block
    assert stand_in < 0.62 * measured


def test_hybrid_stack_sums_its_kinds():
    """Qwen 3.5 debug at cp 1, 8 x 512: 3 linear blocks of their own, 1 full-attention block (the
    decoder model's count plus the fp32 zero-centred norms, the output gate, the q / k norms' fp32
    values and the partial RoPE rows); outside and loss unchanged; AC full keeps the block inputs
    only, selective the linear blocks' projections and the full block's gate half of wq."""
    args = FLAVORS["debugmodel"]
    shape, delta = args.shape(), P.DeltaRuleShape.of(args)
    b, s, d = 8, 512, args.dim
    kw = dict(local_batch_size=b, seq_len=s, tp=1, loss_parallel=False)
    old = P.activation_bytes(shape, ac_mode="none", **kw)
    new = P.activation_bytes(shape, ac_mode="none", delta=delta, **kw)
    linear = P.activation_bytes(shape, ac_mode="none", delta=dataclass_all_linear(args, delta), **kw).per_block
    h, kv, hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
    gated = (4 * h * hd + 2 * (h + kv) * hd) * b * s + 2 * 4 * 16 * s
    full_block = old.per_block + 2 * 2 * d * b * s + gated
    assert new.blocks == 3 * linear + full_block
    assert new.per_block == max(linear, full_block)
    assert (new.outside, new.loss) == (old.outside, old.loss)
    full = P.activation_bytes(shape, ac_mode="full", delta=delta, **kw)
    assert full.blocks == 4 * 2 * d * b * s
    sel = P.activation_bytes(shape, ac_mode="selective", delta=delta, **kw)
    old_sel = P.activation_bytes(shape, ac_mode="selective", **kw)
    conv = 2 * 2 * 64 + 4 * 64
    linear_sel = 2 * d * b * s + (2 * conv + 2 * 4 * 64 + 4 * 4 + 2 * d + 4 * shape.ffn_hidden + 2 * d) * b * s
    assert sel.blocks == 3 * linear_sel + old_sel.per_block + 2 * h * hd * b * s


def test_the_gated_full_attention_block_is_what_eager_keeps():
    """Qwen 3.5's full-attention block (debug flavor, bf16, AC none) against the planner's (`_hybrid`):
    the decoder model's attention plus the output gate (its bf16 sigmoid and the product wo reads),
    the zero-centred q / k norms' fp32 values and the partial RoPE's fp32 cos / sin rows. Equal to
    the byte up to the constants by hand: the two block norms' and the q / k norms' 1 + weight
    (fp32 [dim] and [head_dim], two each), the bf16 RoPE rows passed in and the loss. Before these terms the
    planner was 1,856 B per token short on this block (10.6 %)."""
    args = FLAVORS["debugmodel"]
    model = Qwen3_5Transformer(args).bfloat16()
    b, s = 2, 128
    block = model.layers["3"]
    assert args.layer_types()[3] == "full_attention"
    cos, sin = model.rope_cos[:s].clone(), model.rope_sin[:s].clone()  # bf16 [s, rotary_dim], held by the views
    measured = _kept(block, torch.randn(b, s, args.dim).bfloat16(), cos, sin)
    kw = dict(local_batch_size=b, seq_len=s, tp=1, ac_mode="none", loss_parallel=False)
    delta = P.DeltaRuleShape.of(args)
    linear = P.activation_bytes(args.shape(), delta=dataclass_all_linear(args, delta), **kw).per_block
    planned = P.activation_bytes(args.shape(), delta=delta, **kw).blocks - delta.layers * linear
    constants = 2 * 4 * args.dim + 2 * 4 * args.head_dim + 2 * 2 * s * delta.rotary_dim + 4  # + the loss
    assert measured == planned + constants, (measured / (b * s), planned / (b * s))


def test_the_shared_expert_is_what_eager_keeps():
    """Qwen 3.5's MoE block with its gated shared expert against without one (bf16, AC none, the
    MoE debug flavor's widths): what eager keeps more is the planner's `_shared_expert` term to the
    byte (8 F_s + 2 d + 2: the SwiGLU's four tensors, the shared output the gate scales, the gate's
    sigmoid; 2,562 B per token here), which the planner counted nowhere before."""
    from models.common.moe import MoE

    args = FLAVORS["debugmodel_moe"]
    b, s = 2, 128
    x = torch.randn(b, s, args.dim).bfloat16()
    kept = {}
    for shared in (0, args.shared_expert_hidden_dim):
        torch.manual_seed(0)
        moe = MoE(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            top_k=args.num_experts_per_tok,
            norm_topk_prob=True,
            shared_hidden_dim=shared,
            shared_gate=bool(shared),
        ).bfloat16()
        kept[shared] = _kept(moe, x)
    more = kept[args.shared_expert_hidden_dim] - kept[0]
    shape = args.shape()
    assert P._shared_expert(shape)[0] == 8 * 256 + 2 * 256 + 2
    assert more == P._shared_expert(shape)[0] * b * s, more / (b * s)
    no_shared = dataclasses.replace(shape, shared_hidden=0, shared_gate=False)
    assert P._moe_none_per_token(shape) - P._moe_none_per_token(no_shared) == 2562


def dataclass_all_linear(args, delta: P.DeltaRuleShape) -> P.DeltaRuleShape:
    import dataclasses

    return dataclasses.replace(delta, layers=args.n_layers)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_qwen3_5_debug_whole_model_in_eager(kernel_op, flavor):
    """The whole debug model (3 DeltaNet blocks, 1 full attention, the loss's fp32 log-probs; dense and
    MoE), bf16, 2 x 256 tokens, AC none: the planner 0.50 % (dense) and 0.33 % (MoE) below eager
    (2026-12-07; 2.2 % before the full-attention block's gate, q / k norms and RoPE rows and the
    shared expert were counted, 27.9 % with every block a full-attention one). What is left is the
    final zero-centred norm's fp32 value and constants: all below, none above."""
    from trainer.step import lm_loss

    args = FLAVORS[flavor]
    torch.manual_seed(0)
    model = Qwen3_5Transformer(args).bfloat16()
    b, s = 2, 256
    tokens = torch.randint(0, args.vocab_size, (b, s + 1))
    measured = P.measure_saved_bytes(model, tokens[:, :-1], tokens[:, 1:], loss_fn=lm_loss)
    kw = dict(local_batch_size=b, seq_len=s, tp=1, ac_mode="none", loss_parallel=False)
    planned = P.activation_bytes(args.shape(), delta=P.DeltaRuleShape.of(args), **kw).total
    stand_in = P.activation_bytes(args.shape(), **kw).total
    # the final zero-centred norm's fp32 value (2 dim per token, not bf16) and constants
    assert measured - (2 * args.dim + 32) * b * s <= planned < measured, (planned, measured)
    assert stand_in < 0.75 * measured


def test_the_hybrid_stack_is_probed_with_one_period_of_its_blocks():
    """`recommend` shards a one-block probe times n_layers; Qwen 3.5's first block is a DeltaNet
    block, so that probe missed the full-attention blocks' parameters and `estimate.py --recommend`
    stopped on "one-block probe and full model disagree". The probe is now one period of the
    stack (3 DeltaNet + 1 full-attention block), each times n_layers / 4: the whole model's counts."""
    import dataclasses

    import models
    import planner

    family = models.get_model_family("qwen3_5")
    fields = ("root_numel", "blocks_numel", "block_gathered_numel", "blocks_gathered_numel", "muon_numel")
    for args, world, ep in (
        (dataclasses.replace(family.flavors["debugmodel"], n_layers=12), 8, 1),
        (family.flavors["35B-A3B"], 256, 8),
    ):
        with planner.fake_process_group(world):
            dims = planner.make_parallel_dims(
                dp_replicate=1, dp_shard=-1, tp=1, ep=ep, world_size=world, shape=args.shape(), seq_len=4096
            )
            whole = planner.shard_model(family, args, dims)
            probed = planner.shard_model(family, args, dims, probe=True)
        assert probed.probed and not whole.probed
        assert [getattr(probed, f) for f in fields] == [getattr(whole, f) for f in fields], args.n_layers
    # n_layers not a multiple of the period: sharded whole
    odd = dataclasses.replace(family.flavors["debugmodel"], n_layers=6)
    with planner.fake_process_group(8):
        dims = planner.make_parallel_dims(
            dp_replicate=1, dp_shard=-1, tp=1, ep=1, world_size=8, shape=odd.shape(), seq_len=512
        )
        assert not planner.shard_model(family, odd, dims, probe=True).probed
