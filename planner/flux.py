"""FLUX in the planner: tokens per sample, FLOPs per sample and activation bytes per sample.

A FLUX sample is one sequence of `txt_tokens` T5 tokens and `img_tokens` packed latent tokens
((latent side / 2)^2: 4096 at 1024 px), run through `depth` double-stream and
`depth_single_blocks` single-stream blocks. The planner treats it as a sequence of
`txt + img` tokens (`seq_len` in the reports), takes its training FLOPs from the model's own
counter (`models.flux.flops.flops_per_sample`, checked against FlopCounterMode in
tests/unit/test_flux_model.py) and its saved activations from `flux_activation_bytes` below.

`flux_activation_bytes` counts what autograd keeps per token in this code base's FLUX blocks
(models/flux/model.py) with bf16 compute (SimpleFSDP's bf16 parameters, bf16 residual stream),
SDPA that keeps its output and fp32 logsumexp (no T^2 term), the FLUX tensor-parallel plan
(heads and MLP width split by tp, the [txt; img] stream replicated: no sequence parallelism).
With d = hidden, D = d / tp (local q/k/v width), H = heads / tp, F = mlp_hidden / tp, per token:

- double block, no AC: 16d + 22D + 12H + 4F + 8 bytes. The block input (2d), the two
  LayerNorms' outputs (2 x 2d, kept by the (1 + scale) multiply) with bf16 mean/rstd (2 x 4),
  the two modulated inputs of the projections (2 x 2d), the attention out-projection and MLP
  outputs (kept by the gate multiplies, 2 x 2d) and the residual between them (2d);
  q and k each: QK-RMSNorm's fp32 copy + rsqrt + bf16 output (6D + 4H) and the rotated bf16
  value SDPA keeps (2D; RoPE's fp32 products keep nothing: the table needs no gradient);
  v (2D); SDPA's output (2D) + logsumexp (4H), and its per-stream slices copied for the
  out-projections (2D); MLP: the w1 output (GELU input) and the GELU output (4F). Each token
  is in one stream, so the count per token is that of one stream.
- single block, no AC: 8d + 20D + 12H + 4F + 4 (one LayerNorm, one modulated input shared by
  q/k/v and the MLP, the attention output read in place, one gated output).
- full AC: the block input (2d) per token; selective AC (matmul and attention outputs kept,
  `parallelisms.activation_checkpoint.sac_policy`): 6d + 8D + 4H + 2F per token, plus the
  modulation matmuls' outputs per sample (2 x 6d x 2 bytes double, 3d x 2 bytes single).
- outside the blocks: the bf16 inputs of img_in / txt_in, RoPE table (fp32, head_dim per
  token), final layer (LayerNorm in/out, modulated input: 6d + 8 per image token), and the loss's
  fp32 prediction and target (8 x out_channels per image token).

tests/unit/test_flux_planner.py checks the block formulas against `planner.activations.saved_bytes`
of a real bf16 FLUX forward on the CPU.
"""

from __future__ import annotations

from models.errors import ConfigError
from parallelisms.activation_checkpoint import check_ac_mode
from planner.activations import ActivationBytes


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_bytes_per_token(args, *, tp: int, ac_mode: str, single: bool) -> int:
    """Bytes one double (`single=False`) or single block keeps per token under `ac_mode`
    (per-token terms only; `block_bytes` adds the per-sample ones)."""
    check_ac_mode(ac_mode)
    d = args.hidden_size
    heads = args.num_heads // tp
    width = heads * (d // args.num_heads)
    ffn = _cdiv(args.mlp_hidden_dim, tp)
    if ac_mode == "full":
        return 2 * d
    if ac_mode == "full_save_attention":  # and the attention output (bf16) + log-sum-exp (fp32)
        return 2 * d + 2 * width + 4 * heads
    if ac_mode == "selective":
        return 6 * d + 8 * width + 4 * heads + 2 * ffn
    common = 12 * heads + 4 * ffn
    return common + (8 * d + 20 * width + 4 if single else 16 * d + 22 * width + 8)


def block_bytes(args, *, tokens: int, samples: int, tp: int, ac_mode: str, single: bool) -> int:
    """Bytes one block keeps for a micro-batch of `samples` samples, `tokens` tokens in all."""
    per_sample = 0
    if ac_mode == "selective":  # the adaLN modulation matmuls' bf16 outputs
        per_sample = 2 * 3 * args.hidden_size if single else 2 * 2 * 6 * args.hidden_size
    return block_bytes_per_token(args, tp=tp, ac_mode=ac_mode, single=single) * tokens + per_sample * samples


def flux_activation_bytes(
    args, *, img_tokens: int, txt_tokens: int, local_batch_size: int, tp: int, ac_mode: str
) -> ActivationBytes:
    """Saved-for-backward bytes per device of one FLUX micro-batch (see the module docstring).

    `per_block` is the larger block kind's bytes (double blocks hold more); `blocks` sums both
    stacks. `loss` is the fp32 prediction and target the MSE keeps; `logits_transient` its
    backward's fp32 gradient (the analogue of the LM's log-softmax transient).
    """
    b = local_batch_size
    tokens = b * (img_tokens + txt_tokens)
    kw = dict(tokens=tokens, samples=b, tp=tp)
    double = block_bytes(args, ac_mode=ac_mode, single=False, **kw)
    single = block_bytes(args, ac_mode=ac_mode, single=True, **kw)
    double_none = block_bytes(args, ac_mode="none", single=False, **kw)
    d, hd = args.hidden_size, args.hidden_size // args.num_heads
    outside = (
        2 * args.in_channels * b * img_tokens
        + 2 * args.context_in_dim * b * txt_tokens
        + 4 * hd * tokens
        + (6 * d + 8) * b * img_tokens
    )
    loss = 8 * args.out_channels * b * img_tokens
    return ActivationBytes(
        per_block=double,
        blocks=args.depth * double + args.depth_single_blocks * single,
        outside=outside,
        loss=loss,
        per_block_none=double_none,
        logits_transient=loss,
    )


def flux_flops_per_token(args, *, img_tokens: int, txt_tokens: int) -> float:
    """Training FLOPs per token of a sample (the model's count per sample / its tokens)."""
    from models.flux.flops import flops_per_sample

    return flops_per_sample(args, img_tokens, txt_tokens) / (img_tokens + txt_tokens)


def flux_tokens(flow_cfg) -> tuple[int, int]:
    """(image tokens, text tokens) of a recipe's `[flow]` section; ConfigError if it does not say."""
    if not flow_cfg.latent_size or not flow_cfg.text_seq_len:
        raise ConfigError(
            "flow.latent_size / flow.text_seq_len: the planner needs the sample's shape; set both "
            "(e.g. latent_size = 128, text_seq_len = 512 for 1024 px FLUX.1-dev); allowed: both set to positive integers"
        )
    side = flow_cfg.latent_size
    if side % 2:
        raise ConfigError(f"flow.latent_size: {side}; allowed: an even latent side (2x2 packing)")
    return (side // 2) ** 2, flow_cfg.text_seq_len
