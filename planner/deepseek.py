"""DeepSeek-V3 / Kimi K2 in the planner: MLA and DeepSeek MoE activation bytes, per stack.

`ModelShape` describes a GQA decoder; MLA does not fit it (its keys and values come from one
low-rank latent, its q.k and value widths differ), and the model has two block stacks of
different kinds (`dense_layers`, then `moe_layers`). `mla_activation_bytes` counts what autograd
keeps per token in models/deepseek_v3/model.py (bf16 compute, fp32 RMSNorm internals) with the
attention op as TPU splash serves it (titan_kernels/tpu/register.py: no seq^2 term, q/k and v at
their own widths, unpadded) from the model's own arguments (`DeepSeekV3Args`). Training shapes,
no KV cache. With d = dim, h = heads, qk = qk_nope + qk_rope, r_q = q_lora_rank,
r_kv = kv_lora_rank, v = v_head_dim, per token:

- both kinds, no AC: the two block RMSNorms (fp32 copy, fp32 rsqrt, bf16 normalized: 6d + 4
  each) and their weighted outputs, the in-projections' inputs (2 x 2d); MLA: the q LoRA
  output through q_norm (8 r_q + 4: the norm's 6 r_q + 4 and its weighted output, wq_b's input;
  0 without a q LoRA), the kv latent through kv_norm (8 r_kv + 4, wkv_b's input), q and the
  expanded k ([k_nope | shared k_rope] per head; 2 x 2h qk) and v that the op keeps with its
  output (2 x 2hv) and fp32 log-sum-exp (4h), and the output copied to [seq, heads x v] for wo
  (2hv). RoPE keeps nothing (its fp32 tables need no gradient). (The SDPA reference, which CPU
  runs take, pads v to qk inside the op for ATen's one-width kernels: 2 x 2h (qk - v) more.)
- dense block, no AC: the SwiGLU's w1 out, silu, w3 out and product: 8 x hidden_dim.
- MoE block, no AC: the routed part as Qwen 3's (`planner.activations`: token copies in and out
  4kd, grouped SwiGLU 8kF, indices and scores), the shared experts' SwiGLU (8 x shared width)
  and DeepSeek's router: the sigmoid scores kept by the router and by the sequence-wise balance
  loss (2 x 4E). The group-limited selection keeps nothing (only its indices, which carry no
  gradient, are used). Per block and sequence, not per token, the balance loss keeps a few
  [E]-sized fp32 tensors (4E x batch + ~100 bytes: not modelled).
- full AC: the block input (2d); selective AC: the outputs of every matmul and of the attention
  (wq_a 2 r_q, wq_b 2h(qk), wkv_a 2(r_kv + rope), wkv_b 2h(nope + v), attention 2hv + 4h, wo 2d;
  dense: w1, w3, w2 = 4 hidden + 2d; MoE: router logits 2E, grouped gate/up/down k(4F + 2d),
  shared w1, w3, w2 = 4 F_shared + 2d) plus the block input.

Multi-token prediction (`mtp_depth` D > 0): each MTP module keeps, per token, one MoE block
without AC (activation checkpointing acts on the block stacks only), its `enorm` and `hnorm`
and the concatenated input of `eh_proj` (2 x 2d), its head norm and the head's input (2d) and
its int64 targets, all counted `outside` the stacks; each depth's logits add to `loss` (the
losses of all depths are kept for one backward). Their parameters are in the args' counts
(`num_params`, `num_active_params`) and their FLOPs in trainer/tasks/lm.py `flops_per_unit`.

The MoE blocks are planned at tp = 1 and cp = 1 (the decoder planner's MoE rule; MLA under CP
has no TPU path here), with expert parallelism's dispatch buffers in the block backward
(`planner.memory.ep_dispatch_bytes`). tests/unit/test_planner_deepseek.py checks these formulas
against `planner.activations.measure_saved_bytes` of a real forward of the debug flavor.
"""

from __future__ import annotations

from models.errors import ConfigError
from parallelisms.activation_checkpoint import check_ac_mode
from planner.activations import ActivationBytes


def is_mla(args: object) -> bool:
    """True for a DeepSeek-V3-style model (MLA attention, dense then MoE stacks)."""
    return hasattr(args, "kv_lora_rank") and hasattr(args, "n_dense_layers")


def mla_attention_per_token(args) -> int:
    """Bytes one MLA layer keeps per token without AC (tp = 1), the block norms excluded."""
    h = args.n_heads
    q_lora = 8 * args.q_lora_rank + 4 if args.q_lora_rank else 0
    kv_latent = 8 * args.kv_lora_rank + 4
    # q, k at qk; v and the output at v (bf16, unpadded: splash takes both widths) + log-sum-exp (fp32)
    attention = 2 * 2 * h * args.qk_head_dim + 2 * 2 * h * args.v_head_dim + 4 * h
    return q_lora + kv_latent + attention + 2 * h * args.v_head_dim


def moe_per_token(args) -> int:
    """Bytes one DeepSeek MoE layer keeps per token without AC (routed + shared experts, router)."""
    k, e = args.num_experts_per_tok, args.num_experts
    # Token copies in and out, grouped SwiGLU, and the k-wide bookkeeping: top-k indices, fp32
    # gathered scores (kept by the renormalising division), bf16 weights, sort and unsort indices.
    routed = 4 * k * args.dim + 8 * k * args.moe_hidden_dim + 30 * k + 8
    shared = 8 * args.num_shared_experts * args.moe_hidden_dim
    # The sigmoid scores, kept by the router and by the sequence-wise balance loss. The
    # group-limited selection keeps nothing: only its indices are used, which carry no gradient,
    # so autograd frees its nodes (and their saved indices and mask) during the forward.
    router = 8 * e
    return routed + shared + router


def _selective_per_token(args, *, moe: bool) -> int:
    h, d = args.n_heads, args.dim
    saved = 2 * args.q_lora_rank + 2 * h * args.qk_head_dim
    saved += 2 * (args.kv_lora_rank + args.qk_rope_head_dim) + 2 * h * (args.qk_nope_head_dim + args.v_head_dim)
    saved += 2 * h * args.v_head_dim + 4 * h + 2 * d  # attention out (v's width) + lse, wo
    if moe:
        shared = args.num_shared_experts * args.moe_hidden_dim
        saved += 2 * args.num_experts + args.num_experts_per_tok * (4 * args.moe_hidden_dim + 2 * d)
        saved += (4 * shared + 2 * d) if shared else 0
    else:
        saved += 4 * args.hidden_dim + 2 * d
    return saved


def mla_activation_bytes(
    args, *, local_batch_size: int, seq_len: int, tp: int, ac_mode: str, cp: int = 1
) -> ActivationBytes:
    """Saved-for-backward bytes per device for one micro-batch of a DeepSeek-V3-style model.

    `per_block` and `per_block_none` are the larger (MoE) block's; `blocks` sums both stacks."""
    check_ac_mode(ac_mode)
    if tp != 1:
        raise ConfigError(
            f"parallelism.tensor_parallel_degree: {tp}: the planner models DeepSeek-V3's MoE "
            "blocks at tp = 1 only (use expert_parallel_degree); allowed: 1"
        )
    if cp != 1:
        raise ConfigError(
            f"parallelism.context_parallel_degree: {cp}: the planner has no MLA model under "
            "context parallelism; allowed: 1"
        )
    d = args.dim
    tokens = local_batch_size * seq_len
    norm = 6 * d + 4
    common = 2 * norm + 2 * 2 * d + mla_attention_per_token(args)
    none_dense = (common + 8 * args.hidden_dim) * tokens
    none_moe = (common + moe_per_token(args)) * tokens
    block_input = 2 * d * tokens
    if ac_mode == "none":
        dense, moe = none_dense, none_moe
    elif ac_mode == "full":
        dense = moe = block_input
    elif ac_mode == "full_save_attention":  # and splash's output (bf16, at v) + log-sum-exp (fp32)
        dense = moe = block_input + (2 * args.n_heads * args.v_head_dim + 4 * args.n_heads) * tokens
    else:
        dense = block_input + _selective_per_token(args, moe=False) * tokens
        moe = block_input + _selective_per_token(args, moe=True) * tokens
    n_dense = args.n_dense_layers
    n_moe = args.n_layers - n_dense
    outside = norm * tokens + 2 * d * tokens + 8 * tokens  # final norm, LM-head input, labels
    mtp = getattr(args, "mtp_depth", 0)
    # Per MTP depth: its MoE block (no AC), enorm + hnorm, eh_proj's input, head norm + head input, targets.
    outside += mtp * (none_moe + (3 * norm + 2 * 2 * d + 2 * d + 8) * tokens)
    return ActivationBytes(
        per_block=max(dense, moe),
        blocks=n_dense * dense + n_moe * moe,
        outside=outside,
        loss=4 * tokens * args.vocab_size * (1 + mtp),
        loss_passes=1 + mtp,
        per_block_none=max(none_dense, none_moe),
        logits_transient=8 * tokens * args.vocab_size,
    )
