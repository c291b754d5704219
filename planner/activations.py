"""Activations, analytically: the bytes each block keeps for backward, and their measurement.

`activation_bytes` counts the tensors each block keeps for backward in the eager path of this
code base (bf16 compute, SDPA/flash attention so no seq^2 term, fp32 RMSNorm internals, fp32
log-probs for the loss) under each activation checkpointing mode, from the model's declared
sizes (`args.shape()`, `models.contract.ModelShape`). The formulas are in docs/planner.md;
they match the bytes measured by `measure_saved_bytes` (a real CPU forward) to within a few
bytes (tests/unit/test_planner.py).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from models.contract import ModelShape
from parallelisms.activation_checkpoint import check_ac_mode
from planner.shard import local_tensor


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one device keeps from forward to backward for one micro-batch (analytic)."""

    per_block: int
    """Saved by one block under the AC mode."""
    blocks: int
    """All blocks."""
    outside: int
    """Outside the blocks: final norm, LM-head input, token ids/labels (+ TP/AC extras)."""
    loss: int
    """The fp32 log-probabilities cross entropy keeps ([tokens, vocab or vocab/tp])."""
    per_block_none: int
    """What one block would keep without AC (recomputed during its backward under AC)."""
    logits_transient: int
    """The log-softmax backward's fp32 gradient in and out, [tokens, vocab] each (on top of `loss`)."""
    cp_backward: int | None = None
    """With cp > 1, the gradient buffers of the cp collectives one block's backward holds before
    their reduce-scatter (planner/memory.py, the block transient); None: the decoder model's, the
    gathered k/v's (`cp_gathered_kv_bytes`). A hybrid stack's (`DeltaRuleShape`): the larger of a
    full-attention block's and a Gated DeltaNet block's (`cp_delta_rule_bytes`)."""
    loss_passes: int = 1
    """The loss's passes over the head: 1 + the multi-token-prediction depth (the fused loss keeps
    one fp32 log-sum-exp per token and pass)."""
    period: int = 1
    """A hybrid stack's period (Qwen 3.5: three Gated DeltaNet blocks, then one full-attention
    block: 4), with which layer scan runs it, one period per step (models/common/stack.py
    `scan_period`); 1: identical blocks."""
    period_none: int = 0
    """What one period's blocks keep without AC: under full AC a periodic scan's backward
    recomputes the whole period at once (0 when `period` is 1)."""

    @property
    def total(self) -> int:
        return self.blocks + self.outside + self.loss


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _moe_none_per_token(s: ModelShape) -> int:
    """Bytes per token one MoE block keeps without AC (tp = 1).

    Routed token copies in (gathered, bf16) and out (re-ordered, bf16): 4kd; grouped SwiGLU:
    gate, up, silu(gate), product: 8kF (2 x `expert_act_tensors` x kF: 14kF for gpt-oss's clamped
    SwiGLU); router: two fp32 softmax outputs and the fp32 logits
    of the z-loss (12E), top-k indices + values + bf16 scores + sort indices (30k), sums (8).
    Shared experts (`shared_hidden` F_s): their SwiGLU's four tensors (8 F_s) and, gated, the
    gate's sigmoid and the shared output it scales (2 + 2d; `_shared_expert`).
    """
    k, e = s.top_k, s.num_experts
    routed = 4 * k * s.dim + 2 * s.expert_act_tensors * k * s.moe_hidden + 12 * e + 30 * k + 8
    return routed + _shared_expert(s)[0]


def _shared_expert(s: ModelShape) -> tuple[int, int]:
    """(without AC, selective AC) bytes per token of the MoE block's shared experts: w1 / w3 outputs,
    silu and the product (8 F_s) without AC, the w1 / w3 / w2 outputs (4 F_s + 2d) under selective;
    gated (Qwen 3.5): the gate's bf16 sigmoid (2) and, without AC, the shared output the gate
    scales (2d). Measured (planner recorder, Qwen 3.5's MoE debug block, bf16): 2,562 B per token
    with F_s = 256, d = 256, against 0 without a shared expert (tests/unit/test_planner_delta_block.py)."""
    f = s.shared_hidden
    if not f:
        return 0, 0
    gate, scaled = (2, 2 * s.dim) if s.shared_gate else (0, 0)
    return 8 * f + scaled + gate, 4 * f + 2 * s.dim + gate


def cp_gathered_kv_bytes(shape: ModelShape, *, local_batch_size: int, seq_len: int, tp: int, cp: int) -> int:
    """One layer's all-gathered keys and values under context parallelism: [b, kv/tp, s, d] x 2,
    bf16, the whole sequence (parallelisms/context_parallel.py gathers kv heads only; splash
    reads them in its MQA form, unrepeated). 0 without CP."""
    if cp <= 1:
        return 0
    return 2 * 2 * local_batch_size * (shape.n_kv_heads // tp) * seq_len * shape.head_dim


@dataclass(frozen=True)
class DeltaRuleShape:
    """The Gated DeltaNet (linear-attention) blocks of a hybrid stack (Qwen 3.5): how many, and the
    widths context parallelism's delta-rule wrapper sizes its tensors from. The rest of the stack
    is full attention (`ModelShape`'s heads)."""

    layers: int
    """Gated DeltaNet blocks (the others are full attention)."""
    v_heads: int
    """Value heads (each with its own [k_dim, v_dim] state; q/k heads are repeated to them)."""
    k_dim: int
    v_dim: int
    k_heads: int | None = None
    """q/k heads (None: as many as the value heads)."""
    conv_kernel: int = 4
    """Taps of the short causal convolution over the q/k/v channels."""
    rotary_dim: int = 0
    """The full-attention blocks' partial RoPE width (each keeps fp32 cos / sin rows of it per position)."""

    @classmethod
    def of(cls, args) -> DeltaRuleShape | None:
        """From a model's args: Qwen 3.5's `layer_types()` and `linear_*` widths; None for a
        model without linear-attention blocks."""
        if not hasattr(args, "linear_num_value_heads") or not hasattr(args, "layer_types"):
            return None
        layers = sum(kind == "linear_attention" for kind in args.layer_types())
        if not layers:
            return None
        return cls(
            layers,
            args.linear_num_value_heads,
            args.linear_key_head_dim,
            args.linear_value_head_dim,
            k_heads=args.linear_num_key_heads,
            conv_kernel=args.linear_conv_kernel_dim,
            rotary_dim=args.rotary_dim,
        )


@dataclass(frozen=True)
class CPDeltaRuleBytes:
    """What context parallelism's delta rule (parallelisms/context_parallel_linear.py
    `cp_gated_delta_rule`) adds to one Gated DeltaNet block on one device, over the op at cp = 1."""

    saved: int
    """Kept for backward without AC (`cp_delta_rule_bytes`)."""
    saved_selective: int
    """Kept under selective AC: the outputs of the fold's matmuls and of the output correction."""
    gathered: int
    """The all-gathered `[F | Pi]` of every chunk (fp32), one per layer and rank; its gradient is
    the same size in the backward, before its reduce-scatter."""
    backward: int
    """The block backward's cp transient: the gathered `[F | Pi]`'s gradient, plus the kernel
    backward's chunk-start states at the `k_dim` extra value columns."""


DELTA_KERNEL_CHUNK = 64
"""Tokens per chunk of the TPU delta-rule kernel (titan_kernels/tpu/delta_rule.py `CHUNK`): its
backward writes one [k_dim, width] state per chunk."""


def cp_delta_rule_bytes(delta: DeltaRuleShape, *, local_batch_size: int, seq_len: int, cp: int) -> CPDeltaRuleBytes:
    """One Gated DeltaNet block's extra bytes under context parallelism, on cp rank 0 (the heaviest:
    its late chunk is the sequence's last, so its fold runs through every chunk), over what the op
    keeps at cp = 1. b = `local_batch_size`, T = b s / cp tokens, h value heads, widths dk, dv,
    all fp32 (4 bytes). The wrapper runs the op on the rank's two chunks as a batch of 2b with
    values `[v | 0]` from the state `[0 | I]`, so the op keeps (without AC):

    - its value input at dv + dk columns: `4 T h dk` more than at dv;
    - the state `[0 | I]` made contiguous for the kernel, `4 (2b) h dk (dv + dk)` (in place of
      the zero state at cp = 1, `4 b h dk dv`, which the fold's first step keeps instead);
    - its fp32 output `[o^0 | Phi^T q]`, `4 T h (dv + dk)`, kept whole for the correction's
      backward (the correction reads the `Phi^T q` slice of it; at cp = 1 the bf16 output is
      consumed by the gated norm, which keeps its own fp32 copy, so nothing of it is kept);
    - the rank's two start states (the correction's other operand), `4 (2b) h dk dv`;
    - the fold `S_{j+1} = Pi_j S_j + F_j` over the 2 cp gathered chunks: a step whose state needs a
      gradient keeps `S_j`, `4 b h dk dv`, and a view of the gathered `[F | Pi]`, which keeps all of
      it, `4 (2 cp) b h dk (dv + dk)` (`gathered`); rank 0's steps j = 1 .. 2 cp - 2 (step 0 starts
      from the zero state, which needs no gradient, and keeps only `S_0`; the last step's result
      is not used). At cp = 1 the wrapper's fold has no such step.

    Exact against the bytes `measure_saved_bytes`' recorder finds for the wrapper over the op
    with the TPU kernel's autograd (it keeps its prepared inputs), tests/unit/test_planner_cp_linear.py.
    Not counted: the convolution's halo rows (2 x b x (kernel - 1) rows of the conv channels,
    bf16: a few KiB). The gathered `[F | Pi]`'s gradient is a transient of the block backward
    (`backward`)."""
    b, h, dk, dv = local_batch_size, delta.v_heads, delta.k_dim, delta.v_dim
    t = b * seq_len // cp
    width = dv + dk
    gathered = 4 * 2 * cp * b * h * dk * width
    fold = (2 * cp - 2) * 4 * b * h * dk * dv + (gathered if cp > 1 else 0)
    saved = 4 * t * h * dk + 4 * 2 * b * h * dk * width + 4 * t * h * width + 4 * 2 * b * h * dk * dv + fold
    # selective AC keeps matmul outputs: the fold's states (one per step of rank 0's 2 cp - 1) and the
    # correction [T, h, dv]; the op's own inputs and output are recomputed with the block.
    selective = (2 * cp - 1) * 4 * b * h * dk * dv + 4 * t * h * dv
    chunk_states = 4 * 2 * b * h * _cdiv(seq_len // (2 * cp), DELTA_KERNEL_CHUNK) * dk * dk
    return CPDeltaRuleBytes(saved=saved, saved_selective=selective, gathered=gathered, backward=gathered + chunk_states)


def activation_bytes(
    shape: ModelShape,
    *,
    local_batch_size: int,
    seq_len: int,
    tp: int,
    ac_mode: str,
    loss_parallel: bool,
    cp: int = 1,
    delta: DeltaRuleShape | None = None,
    mtp_depth: int = 0,
) -> ActivationBytes:
    """Saved-for-backward bytes per device, bf16 compute, one micro-batch (see docs/planner.md).

    T = local_batch_size * seq_len / cp tokens per micro-batch and device (context parallelism
    splits the sequence); with TP the residual stream and the norms hold T/tp tokens (sequence
    parallel) and the projections T with heads/hidden split by tp.

    With cp > 1 the attention is the TPU one (splash over all-gathered k/v, no dense mask): a
    block keeps q, the output and the log-sum-exp of its own T tokens, and the gathered k/v of
    the whole sequence (`cp_gathered_kv_bytes`) instead of its T tokens' repeated k/v.

    `delta`: a hybrid stack's Gated DeltaNet blocks (Qwen 3.5), counted with their own mixer
    (`_linear_mixer`: what the block keeps around the delta-rule kernel) in place of the
    attention; with cp > 1 they gather no k/v and each adds what the cp delta rule keeps
    (`cp_delta_rule_bytes`). `per_block` / `per_block_none` are then the larger kind's, `blocks`
    the sum over both kinds. `mtp_depth` (with `delta`: Qwen 3.5's multi-token prediction, one
    module) adds the module to `outside` and its logits to `loss` (`_hybrid`).
    """
    check_ac_mode(ac_mode)
    assert seq_len % cp == 0, f"seq_len {seq_len} does not split over cp {cp}"
    b = local_batch_size
    t_full = b * seq_len // cp
    t_seq = t_full // tp  # sequence-parallel tokens (seq_len divides by tp: checked by ParallelDims)
    gathered_kv = cp_gathered_kv_bytes(shape, local_batch_size=b, seq_len=seq_len, tp=tp, cp=cp)
    attention = _attention_mixer(shape, tp=tp, cp=cp)
    none = _block_none(shape, attention, t_full=t_full, t_seq=t_seq, rows=b, tp=tp) + gathered_kv
    per_block = _block_kept(shape, attention, ac_mode, none=none, t_full=t_full, t_seq=t_seq, tp=tp)
    outside, loss, logits_transient = _outside_and_loss(
        shape, t_full=t_full, t_seq=t_seq, tp=tp, ac_mode=ac_mode, loss_parallel=loss_parallel
    )
    full = ActivationBytes(
        per_block=per_block,
        blocks=per_block * shape.n_layers,
        outside=outside,
        loss=loss,
        per_block_none=none,
        logits_transient=logits_transient,
    )
    if delta is None or not delta.layers:
        assert not mtp_depth, "the decoder model counts no MTP module (DeepSeek-V3's: planner/deepseek.py)"
        return full
    return _hybrid(
        shape, delta, full, local_batch_size=b, seq_len=seq_len, tp=tp, ac_mode=ac_mode, cp=cp, mtp_depth=mtp_depth
    )


@dataclass(frozen=True)
class _Mixer:
    """A block's token mixer (attention or Gated DeltaNet), the bytes it keeps beyond its input
    (the norm's output, counted with the block): per token, and per sequence row."""

    none: int
    """Per token, without AC."""
    selective: int
    """Per token, under selective AC (the outputs of its matmuls and of the kernels selective AC saves)."""
    save_attention: int
    """Per token, under full_save_attention (the attention kernel's output and log-sum-exp)."""
    none_per_row: int = 0
    """Per sequence row (the batch dimension), without AC."""


def _attention_mixer(s: ModelShape, *, tp: int, cp: int) -> _Mixer:
    """The decoder model's attention (q, k, v projections, SDPA or splash, per-head q/k norms)."""
    hd = s.head_dim
    heads, kv_heads = s.n_heads // tp, s.n_kv_heads // tp
    none = 8 * heads * hd + 4 * heads  # q, repeated k, repeated v, SDPA out (bf16), logsumexp (fp32)
    if cp > 1:  # q, out, logsumexp per local token; k/v are the gathered ones (`cp_gathered_kv_bytes`)
        none = 4 * heads * hd + 4 * heads
    if s.qk_norm:  # per-head RMSNorm on q and k: fp32 copy, rsqrt, bf16 normalized
        none += 6 * heads * hd + 4 * heads + 6 * kv_heads * hd + 4 * kv_heads
    selective = 2 * heads * hd + 4 * kv_heads * hd + 2 * s.dim  # wq, wk, wv, wo (partial sums, full seq)
    selective += 2 * heads * hd + 4 * heads  # SDPA out + logsumexp
    return _Mixer(none=none, selective=selective, save_attention=2 * heads * hd + 4 * heads)


def _block_none(s: ModelShape, mixer: _Mixer, *, t_full: int, t_seq: int, rows: int, tp: int) -> int:
    """One block without AC: the two norms, the inputs of the mixer's and FFN's in-projections (the
    full sequence: TP all-gathers it; without TP it is the norm's output), the mixer, the FFN/MoE."""
    d = s.dim
    norm = 6 * d + 4  # RMSNorm: fp32 copy of its input, fp32 rsqrt, bf16 normalized value
    none = 2 * norm * t_seq + 2 * d * t_full + mixer.none * t_full + mixer.none_per_row * rows
    if s.is_moe:
        # Under TP the MoE layer runs on the rank's sequence shard (models/qwen3/plan.py): its input is
        # the norm's output, not gathered, and its tensors are of T / tp tokens (t_seq = t_full at tp 1).
        return none + 2 * d * t_seq + _moe_none_per_token(s) * t_seq
    return none + 2 * d * t_full + 8 * _cdiv(s.ffn_hidden, tp) * t_full  # FFN input; w1 out, silu, w3 out, product


def _block_kept(s: ModelShape, mixer: _Mixer, ac_mode: str, *, none: int, t_full: int, t_seq: int, tp: int) -> int:
    """What one block keeps under `ac_mode` (`none`: its bytes without AC)."""
    block_input = 2 * s.dim * t_seq
    if ac_mode == "none":
        return none
    if ac_mode == "full":
        return block_input
    if ac_mode == "full_save_attention":  # and the attention kernel's output (bf16) + log-sum-exp (fp32)
        return block_input + mixer.save_attention * t_full
    # selective: outputs of matmuls, attention and TP reduce-scatters
    saved, moe = mixer.selective, 0
    if s.is_moe:  # router logits, grouped gate/up/down outputs, the shared experts' (the sequence shard's)
        moe = 2 * s.num_experts + s.top_k * (4 * s.moe_hidden + 2 * s.dim) + _shared_expert(s)[1]
    else:
        saved += 4 * _cdiv(s.ffn_hidden, tp) + 2 * s.dim  # w1, w3, w2
    # With cp > 1 the k/v all-gather is recomputed (selective AC recomputes collectives), so
    # the gathered k/v are a transient of the block's backward, not kept. Under TP the out-projections'
    # reduce-scatter outputs are kept: attention's and the FFN's (an MoE layer, on the sequence shard
    # already, has none).
    scattered = (1 if s.is_moe else 2) * 2 * s.dim * t_seq if tp > 1 else 0
    return block_input + saved * t_full + moe * t_seq + scattered


def _outside_and_loss(
    s: ModelShape, *, t_full: int, t_seq: int, tp: int, ac_mode: str, loss_parallel: bool
) -> tuple[int, int, int]:
    """Outside the blocks (final norm, LM-head input, labels, TP's extras), the loss's fp32
    log-probs, and the log-softmax backward's transient (`ActivationBytes` fields)."""
    d = s.dim
    outside = (6 * d + 4) * t_seq + 2 * d * t_full + 8 * t_full  # final norm, LM-head input, labels
    if tp > 1:
        outside += 8 * t_full  # vocab-sharded embedding keeps its masked token ids
        if ac_mode != "none":
            outside += 2 * d * t_seq  # measured: the embedding's waited reduce-scatter output stays referenced
    vocab = _cdiv(s.vocab_size, tp) if (loss_parallel and tp > 1) else s.vocab_size
    return outside, 4 * t_full * vocab, 8 * t_full * vocab


def _linear_mixer(s: ModelShape, delta: DeltaRuleShape) -> _Mixer:
    """Qwen 3.5's Gated DeltaNet mixer (models/qwen3_5/model.py `GatedDeltaNet`) with the delta rule
    served by the TPU kernel, whose autograd keeps its prepared inputs (titan_kernels/tpu/register.py,
    `gated_delta.call_prepared`). h value heads, hk key heads, widths dk, dv, C = 2 hk dk + h dv conv
    channels, K conv taps; tp = 1 (the family has no TP plan). Per token, without AC:

    - the short convolution: its input (in_proj_qkv's output) and its output before the SiLU,
      `2 C` each, bf16 (the output has K - 1 more rows per sequence row: conv1d's padding);
    - beta: the sigmoid's output (bf16) and its fp32 copy for the kernel, `6 h`; g: softplus's
      input and output and the kernel's contiguous copy, `12 h` (fp32);
    - the kernel's prepared inputs (fp32, GQA repeated): q and k before and after the l2 norm with
      its rsqrt, `2 (8 h dk + 4 h)`, and v, `4 h dv`; its `reset` (int32), 4; per row its zero
      initial state, `4 h dk dv`;
    - the gated RMSNorm over the kernel's output: the fp32 copy, the rsqrt, the bf16 normalized
      value and its product with the weight, the fp32 gate and its SiLU, `16 h dv + 4 h`, and
      out_proj's bf16 input, `2 h dv`.

    Selective AC keeps the four in-projections' and out_proj's outputs (the delta rule's kernel is
    not one selective AC saves); full_save_attention keeps nothing of it (no attention kernel).
    Exact against the recorder, tests/unit/test_planner_delta_block.py."""
    h, hk, dk, dv = delta.v_heads, delta.k_heads or delta.v_heads, delta.k_dim, delta.v_dim
    conv = 2 * hk * dk + h * dv
    none = 4 * conv + 16 * h * dk + 22 * h * dv + 30 * h + 4
    selective = 2 * conv + 2 * h * dv + 2 * h + 2 * h + 2 * s.dim
    per_row = 2 * conv * (delta.conv_kernel - 1) + 4 * h * dk * dv
    return _Mixer(none=none, selective=selective, save_attention=0, none_per_row=per_row)


def _hybrid(
    shape: ModelShape,
    delta: DeltaRuleShape,
    full: ActivationBytes,
    *,
    local_batch_size: int,
    seq_len: int,
    tp: int,
    ac_mode: str,
    cp: int,
    mtp_depth: int = 0,
) -> ActivationBytes:
    """`activation_bytes` of a hybrid stack: the full-attention blocks as the decoder model counts
    them (`full`) plus Qwen 3.5's output gate, q / k norms and partial RoPE, the Gated DeltaNet blocks
    with their own mixer (`_linear_mixer`) on this rank's tokens (no k/v gathered) plus, with
    cp > 1, `cp_delta_rule_bytes`; both kinds with Qwen 3.5's fp32 zero-centred norms.

    Multi-token prediction (`mtp_depth` 1, models/common/mtp.py): per depth and token, `outside`
    adds the module's full-attention block as a main one without AC (activation checkpointing
    acts on the main stack only), its three zero-centred norms (8 dim + 4 each: the fp32 copy,
    rsqrt and fp32 normalized value), `fc`'s concatenated bf16 input (4 dim), the head's input
    (2 dim) and the shifted int64 targets (8); `loss` adds that depth's fp32 log-probs. Against
    eager (the dense debug flavor, bf16, AC none; tests/unit/test_qwen3_5_mtp.py): 39,748 B per
    token planned, 41,623 kept (-4.5 %: the block's output gate and partial RoPE, as above)."""
    assert tp == 1, "the Gated DeltaNet blocks have no tensor-parallel plan"
    b = local_batch_size
    t = b * seq_len // cp
    # Qwen 3.5's zero-centred RMSNorms keep their normalized value in fp32 (`x / rms(x)` times
    # `1 + weight`): 2 dim bytes per token more than the decoder model's bf16 one, each of a
    # block's two norms, in either kind of block (without AC; the norms are recomputed under AC).
    zero_centred = 2 * 2 * shape.dim * t
    # Qwen 3.5's full-attention block beyond the decoder model's (`GatedAttention`): the output
    # gate's bf16 sigmoid and the attention output it scales (4 h hd), the zero-centred q / k norms'
    # fp32 normalized values (2 bytes per element more than a bf16 one), and the partial RoPE's fp32
    # cos / sin rows per position; selective AC keeps wq's gate half as a matmul output (2 h hd).
    h, kv, hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
    gated = (4 * h * hd + 2 * (h + kv) * hd) * t + 2 * 4 * delta.rotary_dim * (seq_len // cp)
    own_full = {"none": zero_centred + gated, "selective": 2 * h * hd * t}.get(ac_mode, 0)
    full = dataclasses.replace(
        full, per_block=full.per_block + own_full, per_block_none=full.per_block_none + zero_centred + gated
    )
    mixer = _linear_mixer(shape, delta)
    own_none = _block_none(shape, mixer, t_full=t, t_seq=t, rows=b, tp=tp) + zero_centred
    own = _block_kept(shape, mixer, ac_mode, none=own_none, t_full=t, t_seq=t, tp=tp)
    extra = cp_delta_rule_bytes(delta, local_batch_size=b, seq_len=seq_len, cp=cp) if cp > 1 else None
    kept = {"none": extra.saved, "selective": extra.saved_selective}.get(ac_mode, 0) if extra else 0
    linear_block, linear_none = own + kept, own_none + (extra.saved if extra else 0)
    n_full = shape.n_layers - delta.layers
    gathered_kv = cp_gathered_kv_bytes(shape, local_batch_size=b, seq_len=seq_len, tp=tp, cp=cp)
    d = shape.dim
    mtp_block = full.per_block_none  # a full-attention block without AC, zero-centred norms included
    mtp_outside = mtp_depth * (mtp_block + (3 * (8 * d + 4) + 4 * d + 2 * d + 8) * t)
    # layer scan runs the stack one period per step: with the full-attention blocks evenly spaced
    # (`full_attention_interval`), the period is n_layers / n_full
    period = shape.n_layers // n_full if n_full and shape.n_layers % n_full == 0 else 1
    return dataclasses.replace(
        full,
        loss_passes=1 + mtp_depth,
        period=period,
        period_none=(period - 1) * linear_none + full.per_block_none if period > 1 else 0,
        outside=full.outside + mtp_outside,
        loss=full.loss * (1 + mtp_depth),
        per_block=max(full.per_block, linear_block) if n_full else linear_block,
        blocks=n_full * full.per_block + delta.layers * linear_block,
        per_block_none=max(full.per_block_none, linear_none) if n_full else linear_none,
        cp_backward=max(gathered_kv if n_full else 0, extra.backward) if extra else None,
    )


def measure_saved_bytes(
    model: nn.Module,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    loss_parallel: bool = False,
) -> int:
    """Bytes of the tensors a real forward + loss leaves alive for backward (CPU, real data).

    `loss_fn(logits, labels)` is the loss whose saved tensors count: the trainer's
    (`trainer.step.lm_loss`), passed in so that this package does not depend on the trainer.
    Every tensor an op creates during the forward is recorded (a TorchDispatchMode); after
    the forward, a storage still referenced by someone other than the recorder is kept by
    autograd (saved tensors, checkpoint inputs, SAC caches). Parameters and buffers are
    excluded; the bf16 weight copies SimpleFSDP makes and the backward keeps are included.
    """
    from parallelisms.tensor_parallel import loss_parallel_context

    def run():
        logits = model(tokens)
        with loss_parallel_context(loss_parallel):
            return loss_fn(logits, labels)

    return saved_bytes(model, run)


def saved_bytes(model: nn.Module, run: Callable[[], object]) -> int:
    """Bytes of the tensors `run()` (a forward + loss of `model`) leaves alive for backward.

    Every tensor an op creates during `run` is recorded (a TorchDispatchMode); after it
    returns, a storage still referenced by someone other than the recorder is kept by autograd
    (saved tensors, checkpoint inputs, SAC caches). Parameters and buffers are excluded; the
    bf16 weight copies SimpleFSDP makes and the backward keeps are included. The value `run`
    returns (the loss) is held until the count is done, then released. The MoE layers' expert
    loads are popped first, as the train step pops them after each forward (a few floats per
    layer for the bias update, docs/moe.md; not activations).
    """
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from models.common.stack import BlockStack

    class _Recorder(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.storages: dict[int, torch.UntypedStorage] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_flatten(out)[0]:
                if isinstance(t, DTensor):
                    t = t._local_tensor
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    storage = t.untyped_storage()
                    self.storages.setdefault(storage._cdata, storage)
            return out

    owned = {local_tensor(t).untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    recorder = _Recorder()
    with recorder:
        loss = run()
    for stack in model.modules():
        if isinstance(stack, BlockStack):
            stack.pop_expert_load()
    gc.collect()
    total = 0
    for key, storage in recorder.storages.items():
        # Use count 1 = only the recorder holds it: the tensor would have been freed.
        if key not in owned and torch._C._storage_Use_Count(storage._cdata) > 1:
            total += storage.nbytes()
    del loss
    return total
