"""DeepSeek-V4 in the planner: what autograd keeps per block of models/deepseek_v4/model.py.

The decoder model (`planner.activations`) assumes one residual stream and the attention op; a
DeepSeek-V4 block has `hc_mult` = n streams, two hyper-connections, a compressor (and in CSA
blocks an indexer) and SDPA over [sink | window | compressed entries] with a boolean mask.
`v4_activation_bytes` counts, from `DeepSeekV4Args`, every tensor the eager forward (bf16
compute) leaves alive for backward, as the CPU runs it. With d = dim, n = hc_mult, I =
hc_sinkhorn_iters, h heads of width hd (padded by the sink column to hd' = hd + 8 - hd % 8),
r_q = q_lora_rank, G x r_o the grouped output projection, E experts, k routed, F their width,
m the block's pooling ratio, S the row length, N = S // m entries and K = S + N keys (the sliding
block: K = S), per token unless said:

- **the streams**: the block's input [B, S, n, d] and the stream after its attention sub-layer,
  2nd each (bf16: the collapse and the comb matmul keep them);
- **each hyper-connection** (two per block): the flattened streams' fp32 copy and their RMS-normed
  value (4nd each) + rsqrt (4), the mixing logits (4 (2 + n) n), the pre sigmoid, pre + eps and
  the post sigmoid (4n each), the comb softmax and + eps (4n^2 each), the Sinkhorn-Knopp steps
  (2I - 1 divisions, each keeping its denominator, 4n, and all but the last their result, 4n^2),
  and the bf16 post and comb the stream update reads (2n + 2n^2);
- **attention**: its RMSNorm (fp32 copy, rsqrt, normed and weighted bf16: 8d + 4), q_norm's
  (8 r_q + 4), wq_b's output and the weightless per-head RMS (2h hd + 4h hd + 6h), kv_norm's
  (6hd + 4; its output is rotated, nothing else keeps it), the output rotated back (2h hd), the
  grouped projection's output (2 G r_o) and wo_b's (2d); per position the rotation's negated sine
  (2 x rope_head_dim). A CSA / HCA block's `compressed_sink_attention` (blocked by the window w,
  the sequence padded to whole windows; n = S // m entries): per query the rotated q (2h hd), its
  block's keys (blocks j - 1 and j: 4hd), the fp32 probabilities over [sink | 2w keys | n
  entries] (4h (1 + 2w + n)), their bf16 copies the value matmuls read (2h (2w + n)) and the
  entries' mask (n); per row the [kv | entries] keys (2 (S + n) hd); per position the window's
  mask (2w). A sliding block's op (SDPA on the CPU): the sink-padded q and the output (2h hd'
  each), the log-sum-exp (4h), per row the per-head k and v (2 x 2h (S + 1) hd') and the window
  mask (2 (S + 1) per position);
- **the compressor**: CSA (two overlapping windows of width hd): the concatenated kv slots (4hd),
  the fp32 softmax over 2m slots (8hd) and its bf16 copy (4hd); HCA (one window): wkv's output
  (2hd), the softmax (4hd) and its copy (2hd); both, per entry, the entry's RMSNorm (6hd + 4,
  i.e. / m per token). The frozen lightning indexer keeps nothing: its choice is a top-k, which
  carries no gradient, so autograd frees its nodes in the forward. Trained on its KL loss
  (`indexer_loss_weight` > 0, `indexer_loss_bytes`) it keeps, per token, its compressor's (16 d_I),
  its fp32 query heads (4 H_I d_I), the fp32 per-head scores after the ReLU and scaled (8 H_I n),
  its fp32 head weights (4 H_I) and the loss's masks, log-softmax and target (10 n + 1); per entry
  the compressor's norm and the fp32 keys (10 d_I + 4). The debug flavor's measured saved bytes
  match it to the byte at 64 and 128 tokens;
- **the MoE**: its RMSNorm (8d + 4); the router's fp32 logits and sqrt(softplus) scores (8E), the
  k gathered scores (4k), their + eps sum (4) and bf16 weights (2k), and the selected experts
  (8k: a hash block's table lookup, a learned block's top-k indices); a learned block's
  sequence-wise balance loss computes the scores again (8E) and keeps a per-token sum (4);
  a hash block also keeps the flattened token ids (8, a copy when they are not contiguous). The
  routed experts as the decoder model's MoE with the clamped SwiGLU: token copies in and out
  (4kd), gate and up outputs, both clamps, silu and the product (12kF), the sort and unsort
  indices (16k); the clamped shared expert (12F); the routed + shared sum (2d).

Outside the blocks: the last block's output streams (2nd), `hc_head` (8nd + 4 + 12n, as a
hyper-connection without comb), the final norm (6d + 4) and the head's input (2d), the int64
labels (8); `loss` the fp32 log-probs (4 vocab). Not counted: per block constants (the
hyper-connections' fp32 copies of `fn`, a few [E] vectors: the weights' part of the planner
counts bf16 copies, not these fp32 ones; 4 x (2 + n) n x nd bytes per hyper-connection, 1.5 MiB
at Flash, under 0.2 % of a block at 4k tokens).

Full AC keeps each block's input streams (2nd); full_save_attention adds the sliding blocks'
SDPA output and log-sum-exp (the compressed blocks' attention has no attention op to save).
Selective AC (the matmul, grouped-matmul and attention outputs) is counted from the same policy
(below; by hand, not in the tests; none and full are, tests/unit/test_planner_deepseek_v4.py).

**The attention's form.** Before issue 54's fix the CSA / HCA blocks called SDPA with a boolean
mask of [S, 1 + S + n] per row; on the CPU ATen's flash kernel kept no scores, but torch-tpu
lowers a masked SDPA in its math form, and the compiled scanned Flash program kept the fp32
probabilities [B, h, S, 1 + S + n] and their gradient (15.0 GiB per CSA block and 12.1 per HCA
block at 3 sequences), 39 GiB more at its peak than this model counted
(docs/results/deepseek_v4_flash_7layers_scan_buffers_2026-12-07_b9ea89b.txt). The blocked form
scores 1 + 2w + n keys a query (Flash at 4,096 tokens: 1,281 in a CSA block, 289 in an HCA
block, instead of 5,121 and 4,129), the same tensors on every device. A kernel (the sink splash
over the window merged with the entries' part by their log-sum-exps) would keep no probabilities.
Selective AC counted from the policy (the scores' and value products' bmm outputs among the
matmuls): 1.8 % and 2.9 % under the measured bytes at 2 x 64 and 2 x 128 tokens (by hand).
"""

from __future__ import annotations

from models.errors import ConfigError
from parallelisms.activation_checkpoint import check_ac_mode
from planner.activations import ActivationBytes


def is_deepseek_v4(args: object) -> bool:
    """True for a DeepSeek-V4 model (hyper-connected streams, compressed attention)."""
    return hasattr(args, "hc_mult") and hasattr(args, "csa_ratio") and hasattr(args, "layer_kinds")


def _padded(args) -> int:
    """The per-head width SDPA sees: head_dim plus the sink's column and zeros to a multiple of 8."""
    return args.head_dim + 8 - args.head_dim % 8


def hyper_connection_per_token(args) -> int:
    """Bytes one hyper-connection keeps per token (the streams themselves excluded)."""
    n, d, it = args.hc_mult, args.dim, args.hc_sinkhorn_iters
    norm = 8 * n * d + 4  # fp32 copy of the flattened streams, rsqrt, normed fp32 (fn's input)
    mixing = 4 * (2 + n) * n + 3 * 4 * n  # the logits; pre sigmoid, pre + eps, post sigmoid
    sinkhorn = 2 * 4 * n * n + (2 * it - 2) * 4 * n * n + (2 * it - 1) * 4 * n  # softmax, + eps, divisions
    return norm + mixing + sinkhorn + 2 * n + 2 * n * n  # + the bf16 post and comb of the update


def attention_bytes(args, kind: str, *, rows: int, seq_len: int) -> int:
    """Bytes one attention sub-layer of `kind` keeps for `rows` rows of `seq_len` tokens (AC none),
    its RMSNorm and compressor included."""
    d, h, hd = args.dim, args.n_heads, args.head_dim
    tokens = rows * seq_len
    per_token = 8 * d + 4 + 8 * args.q_lora_rank + 4  # attention_norm, q_norm
    per_token += 2 * h * hd + 4 * h * hd + 6 * h  # wq_b's output, the per-head RMS of q
    per_token += 6 * hd + 4  # kv_norm
    per_token += 2 * h * hd + 2 * args.o_groups * args.o_lora_rank + 2 * d  # rotated back, wo_a, wo_b
    total = per_token * tokens + 2 * args.rope_head_dim * seq_len
    if kind == "s":  # the op's SDPA: sink-padded q, output, log-sum-exp; per-head k / v; the window mask
        hp, keys = _padded(args), seq_len + 1
        total += (2 * h * hp + 2 * h * hp + 4 * h) * tokens + 2 * 2 * h * keys * hp * rows + 2 * seq_len * keys
        return total
    m = args.csa_ratio if kind == "c" else args.hca_ratio
    total += compressed_attention_bytes(args, rows=rows, seq_len=seq_len, entries=seq_len // m)
    if kind == "c" and getattr(args, "trains_indexer", False):
        total += indexer_loss_bytes(args, rows=rows, seq_len=seq_len)
    pool = 16 * hd if kind == "c" else 8 * hd
    return total + pool * (seq_len // m * m) * rows + (6 * hd + 4) * (seq_len // m) * rows


def compressed_attention_bytes(args, *, rows: int, seq_len: int, entries: int) -> int:
    """What `compressed_sink_attention` keeps for `rows` rows (models/deepseek_v4/model.py): per
    query (the sequence padded to whole windows of w), the rotated q (2h hd), its block's keys
    (blocks j - 1 and j: 2 x 2w hd / w), the float32 probabilities over [sink | 2w keys | n entries]
    (4h (1 + 2w + n)) and their bf16 copies the value matmuls read (2h (2w + n)), the entries' mask
    (n, bool); per row the [kv | entries] keys (2 (S + n) hd); per position the window's mask (2w)."""
    h, hd, w, n = args.n_heads, args.head_dim, args.sliding_window, entries
    padded = -(-seq_len // w) * w
    per_query = 2 * h * hd + 4 * hd + 4 * h * (1 + 2 * w + n) + 2 * h * (2 * w + n) + n
    return per_query * padded * rows + 2 * (seq_len + n) * hd * rows + 2 * w * padded


def indexer_loss_bytes(args, *, rows: int, seq_len: int) -> int:
    """What a CSA block's indexer keeps for its KL loss (`indexer_loss_weight` > 0; module
    docstring): per token 16 d_I + 4 H_I d_I + 8 H_I n + 4 H_I + 10 n + 1, per entry 10 d_I + 4,
    with n = S // m entries a row."""
    hi, di, n = args.index_n_heads, args.index_head_dim, seq_len // args.csa_ratio
    per_token = 16 * di + 4 * hi * di + 8 * hi * n + 4 * hi + 10 * n + 1
    return per_token * rows * seq_len + (10 * di + 4) * n * rows


def moe_per_token(args, *, hash_routed: bool) -> int:
    """Bytes one MoE sub-layer keeps per token (AC none), its RMSNorm included."""
    d, e, k, f = args.dim, args.num_experts, args.num_experts_per_tok, args.moe_hidden_dim
    router = 8 * e + 4 * k + 4 + 2 * k + 8 * k  # logits fp32, scores; gathered, sum, bf16 weights; experts
    router += 8 if hash_routed else 8 * e + 4  # token ids; or the balance loss's scores and sum
    routed = 4 * k * d + 12 * k * f + 16 * k
    return 8 * d + 4 + router + routed + 12 * f + 2 * d


def block_bytes(args, layer: int, *, rows: int, seq_len: int) -> int:
    """Bytes block `layer` keeps without AC for `rows` x `seq_len` tokens."""
    n, d = args.hc_mult, args.dim
    tokens = rows * seq_len
    kind = args.layer_kinds()[layer]
    streams = 2 * 2 * n * d  # the input and the mid-block streams
    per_token = (
        streams + 2 * hyper_connection_per_token(args) + moe_per_token(args, hash_routed=layer < args.num_hash_layers)
    )
    return per_token * tokens + attention_bytes(args, kind, rows=rows, seq_len=seq_len)


def _selective_per_token(args, kind: str, seq_len: int) -> int:
    """Per token, the outputs selective AC's policy saves: matmuls (the hyper-connections' mixing
    logits and comb products, the projections, the compressor's, the compressed blocks' scores and
    their products with the values), grouped matmuls, SDPA (the sliding blocks')."""
    n, d, h, hd = args.hc_mult, args.dim, args.n_heads, args.head_dim
    k, f = args.num_experts_per_tok, args.moe_hidden_dim
    hc = 2 * (4 * (2 + n) * n + 2 * n * d)  # mixing logits (fp32) and the comb product (bf16), twice
    attention = 2 * args.q_lora_rank + 2 * h * hd + 2 * hd  # wq_a, wq_b, wkv
    attention += 2 * args.o_groups * args.o_lora_rank + 2 * d  # wo_a, wo_b
    if kind == "s":
        attention += 2 * h * _padded(args) + 4 * h  # SDPA's output and log-sum-exp
    else:  # the scores over 2 windows and the entries, the two value products (bf16)
        entries = seq_len // (args.csa_ratio if kind == "c" else args.hca_ratio)
        attention += 2 * h * (2 * args.sliding_window + entries) + 2 * 2 * h * hd
    if kind == "c":
        attention += 2 * 2 * 2 * hd  # the compressor's wkv and wgate at 2 hd
        if getattr(args, "trains_indexer", False):  # its compressor's, wq_b's, weights_proj's, the fp32 scores
            hi, di = args.index_n_heads, args.index_head_dim
            attention += 2 * 2 * 2 * di + 2 * hi * di + 2 * hi + 4 * hi * (seq_len // args.csa_ratio)
    elif kind == "h":
        attention += 2 * 2 * hd
    moe = 2 * args.num_experts + k * (4 * f + 2 * d) + 4 * f + 2 * d  # router, grouped, shared
    return hc + attention + moe


def v4_activation_bytes(
    args, *, local_batch_size: int, seq_len: int, tp: int, ac_mode: str, cp: int = 1
) -> ActivationBytes:
    """Saved-for-backward bytes per device for one micro-batch of DeepSeek-V4 (module docstring).

    `per_block` / `per_block_none` are the largest block's, `blocks` the sum over the stack."""
    check_ac_mode(ac_mode)
    if tp != 1:  # the family has a TP plan (since 2026-12-07); these terms are tp = 1's
        raise ConfigError(
            f"parallelism.tensor_parallel_degree: {tp}: the planner models DeepSeek-V4's blocks at tp = 1 only "
            "(use expert_parallel_degree and data-parallel degrees); allowed: 1"
        )
    # The callers never get here otherwise: the rules refuse CP for this family (no document-mask plan).
    assert cp == 1, f"DeepSeek-V4's activation terms are modelled at cp = 1 (got cp {cp})"
    b, s, n, d = local_batch_size, seq_len, args.hc_mult, args.dim
    tokens = b * s
    kinds = args.layer_kinds()
    none = [block_bytes(args, i, rows=b, seq_len=s) for i in range(args.n_layers)]
    block_input = 2 * n * d * tokens
    if ac_mode == "none":
        kept = none
    elif ac_mode == "full":
        kept = [block_input] * args.n_layers
    elif ac_mode == "full_save_attention":
        # the attention op's output and log-sum-exp: the sliding blocks' (the compressed blocks'
        # attention is matmuls and a softmax, no attention op the mode saves)
        sdpa = (2 * args.n_heads * _padded(args) + 4 * args.n_heads) * tokens
        kept = [block_input + (sdpa if kind == "s" else 0) for kind in kinds]
    else:
        kept = [block_input + _selective_per_token(args, kind, s) * tokens for kind in kinds]
    # layer scan (planner.shard.scan_layout; flash: 3 blocks unrolled, then CSA + HCA per step):
    # under full AC a step's backward recomputes its blocks at once, so the transient holds what
    # the period's blocks keep together, the largest such sum (not period x the largest block)
    from planner.shard import scan_layout

    layout = scan_layout(args)
    period, period_none = 1, 0
    if layout is not None and layout[1] > 1:
        k, period = layout
        period_none = max(sum(none[i : i + period]) for i in range(k, args.n_layers, period))
    head = 8 * n * d + 4 + 12 * n  # hc_head: the streams' fp32 copy and normed value, rsqrt, its weights
    outside = (2 * n * d + head + 6 * d + 4 + 2 * d + 8) * tokens
    return ActivationBytes(
        per_block=max(kept),
        blocks=sum(kept),
        outside=outside,
        loss=4 * tokens * args.vocab_size,
        per_block_none=max(none),
        logits_transient=8 * tokens * args.vocab_size,
        period=period,
        period_none=period_none,
    )
