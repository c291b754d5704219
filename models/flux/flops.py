"""Training FLOPs per sample of the FLUX transformer, from its shape.

Counted as FlopCounterMode and the PaLM/TorchTitan convention count them: 2 FLOPs per
multiply-add of every matmul (biases, norms, activations, RoPE and the modulation
arithmetic are not counted), and training = 3x forward (backward: one matmul for the input
gradient and one for the weight gradient per forward matmul).

Forward, per sample with L image and S text tokens, T = S + L:
- linears that act on tokens: 2 x weight elements x the tokens through them (`img_in`, the
  image stream of the double blocks and `final_layer.linear`: L; `txt_in` and the text
  stream: S; single blocks: T);
- linears that act once per sample on the conditioning vector (timestep / guidance /
  pooled-text embedders, every adaLN modulation): 2 x weight elements;
- attention (double and single blocks alike, joint over all T tokens, not causal):
  2 T^2 hidden for q k^T and 2 T^2 hidden for the probabilities times v.

The 3x convention slightly overcounts what a training step runs: the first linears of the
model (`img_in`, `txt_in`, the embedders' `in_layer`) get no input gradient, because the
inputs need none. `tests/unit/test_flux_model.py` checks both against FlopCounterMode.
"""

from __future__ import annotations

from models.flux.args import TIME_EMBED_DIM, FluxArgs


def forward_flops_per_sample(args: FluxArgs, img_tokens: int, txt_tokens: int) -> float:
    """Forward matmul + attention FLOPs of one sample (see the module docstring)."""
    h, m, L, S = args.hidden_size, args.mlp_hidden_dim, img_tokens, txt_tokens
    T = S + L
    stream = 4 * h * h + 2 * h * m  # q, k, v, out-projection, MLP in and out (weights)
    tokens = (
        args.in_channels * h * L
        + args.context_in_dim * h * S
        + args.depth * stream * (L + S)
        + args.depth_single_blocks * (4 * h * h + 2 * h * m) * T
        + h * args.out_channels * L
    )
    embedders = (TIME_EMBED_DIM * h + h * h) * (2 if args.guidance_embed else 1) + args.vec_in_dim * h + h * h
    modulation = args.depth * 2 * 6 * h * h + args.depth_single_blocks * 3 * h * h + 2 * h * h
    attention = (args.depth + args.depth_single_blocks) * 4 * T * T * h
    return float(2 * (tokens + embedders + modulation) + attention)


def first_layer_flops_per_sample(args: FluxArgs, img_tokens: int, txt_tokens: int) -> float:
    """Forward FLOPs of the linears whose input needs no gradient (`img_in`, `txt_in`, the
    embedders' `in_layer`): the input-gradient matmul that `3 x forward` assumes for them
    does not run in training."""
    h = args.hidden_size
    per_sample = TIME_EMBED_DIM * h * (2 if args.guidance_embed else 1) + args.vec_in_dim * h
    return float(2 * (args.in_channels * h * img_tokens + args.context_in_dim * h * txt_tokens + per_sample))


def flops_per_sample(args: FluxArgs, img_tokens: int, txt_tokens: int) -> float:
    """Training FLOPs of one sample: 3 x `forward_flops_per_sample`."""
    return 3.0 * forward_flops_per_sample(args, img_tokens, txt_tokens)
