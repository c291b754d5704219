"""Totals: per-device memory and step time of one plan on one target.

`estimate` adds fp32 master parameters, fp32 gradients, optimizer state (AdamW: 2 x fp32; Muon:
1 x fp32 on its matrices, with its update's whole matrices as a transient), and the larger
the backward's peak (saved activations, the bf16 weights it keeps, and the larger of two
transient peaks: loss/LM head backward, one block's backward plus the scan's flipped copies
where the backend makes them; or, where larger, the embedding backward's fp32 tables after the
layers, `embedding_backward_bytes`) and, for an undonated optimizer update (torch-tpu's compile
backend), the new parameter and moment buffers: the program's outputs, which XLA allocates
beside its temporaries (scripts/estimate_xla.py measured it so); it compares the sum with HBM minus a
headroom margin. The step plan says which terms apply (`StepPlan.fused_loss`, `scan_flips`,
`undonated_update`). The step time is the model's FLOPs at an assumed MFU (docs/planner.md,
"Step time").
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from models.contract import ModelShape
from parallelisms.activation_checkpoint import AC_MODES
from planner.activations import ActivationBytes, activation_bytes, cp_gathered_kv_bytes
from planner.low_precision import (
    block_gather_ratio,
    experts_transient_bytes,
    quantize_transient_bytes,
    quantized_linear_shapes,
)
from planner.shard import ShardStats
from planner.targets import Target

if TYPE_CHECKING:
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.quantize import QuantizePlan

RECOMPUTE_FACTOR = {"none": 1.0, "selective": 1.0, "full": 4.0 / 3.0, "full_save_attention": 4.0 / 3.0}
"""Hardware FLOPs / model FLOPs: full AC repeats the forward (2 of the 6 FLOPs per param per
token); selective AC recomputes only pointwise ops, norms and all-gathers (no matmuls).
full_save_attention repeats the forward but its attention kernels: 4/3 is its upper bound."""

MUON_BYTES_PER_WHOLE_ELEMENT = 12
"""Muon's update per element of the whole matrices a rank holds (`trainer.graph.optim`): the
received update and the result in fp32 (4 + 4) and Newton-Schulz's input and next iterate in
bf16 (2 + 2); the [m, m] Gram products (m <= n) are not counted. A model, not measured."""

RECOMPUTE_RANK = {"none": 0, "selective": 1, "full": 2, "full_save_attention": 3}
"""How much each AC mode recomputes, least first: `recommend`'s preference and search order.
full_save_attention recomputes less than full but holds more, so it comes after it: a recipe
picks it for speed; the search, which looks for the least recompute that fits, never needs it
(where full does not fit, neither does it)."""

assert set(RECOMPUTE_FACTOR) == set(RECOMPUTE_RANK) == set(AC_MODES), "an AC mode the planner does not model"

EMBEDDING_BACKWARD_BYTES_PER_ELEMENT = 8
"""The token embedding's backward per element of its gathered table (`ShardStats.embedding_gathered_numel`):
torch's `embedding_dense_backward` scatter-adds the rows' gradients into a zero [vocab, dim] table in
fp32 (its decomposition upcasts bf16), and the bf16 gradient it returns is cast back to fp32 for the
fp32 reduce-scatter: two fp32 tables (4 + 4 bytes), whole on every device of the dp group before the
reduce-scatter shards them. Read from the buffer assignment of the 8B's deviceless v6e compile
(docs/results/offload_buffers_8b_4layers_2026-12-07_b9ea89b.txt: `scatter_fusion` and
`convert_convert_fusion`, 2 x 2004 MiB f32[128256, 4096], the step's live peak at 4 layers)."""


def embedding_backward_bytes(stats: ShardStats) -> int:
    """The embedding backward's transient (bytes): `EMBEDDING_BACKWARD_BYTES_PER_ELEMENT` per element of
    the gathered table; 0 on a rank without the embedding (an eager pipeline's stage past the first)
    or a model without one (FLUX)."""
    if not stats.embedding_numel:
        return 0
    return EMBEDDING_BACKWARD_BYTES_PER_ELEMENT * stats.embedding_gathered_numel


@dataclass
class Estimate:
    """Per-device memory (bytes) and throughput estimate of one plan on one target."""

    model: str
    target: Target
    n_layers: int
    dp_replicate: int
    dp_shard: int
    tp: int
    ep: int
    ac_mode: str
    local_batch_size: int
    seq_len: int
    grad_accum: int
    loss_parallel: bool
    params: int
    grads: int
    optimizer: int
    saved_weights: int
    activations: ActivationBytes
    transient_loss: int
    transient_block: int
    headroom: float
    assumed_mfu: float
    flops_per_token: float
    recompute_factor: float
    fsdp_min_tokens: int | None
    probed: bool = False
    scan_flips: int = 0
    """Flipped copies the backward scan reads (the stacked saved activations and the stacked
    parameter shards; `StepPlan.scan_flips`), live during the backward scan."""
    update: int = 0
    """New parameter and AdamW moment buffers an undonated update writes (`StepPlan.undonated_update`)."""
    fused_loss: bool = False
    cp: int = 1
    """Context-parallel degree: each of the `cp` ranks of a data-parallel group holds `seq_len / cp`
    tokens of its rows (parallelisms/context_parallel.py)."""
    optimizer_name: str = "adamw"
    """`[optimizer] name`: AdamW keeps two fp32 moments per parameter; Muon one on its matrices."""
    muon_update: int = 0
    """Muon's update transient (bytes): the whole matrices a rank holds for Newton-Schulz."""
    quantize_recipe: str = "none"
    """`[quantize] recipe`."""
    quantize_transient: int = 0
    """The low-precision copies and scales of the largest quantized linear's backward, part of
    `transient_block` (planner/low_precision.py)."""
    fsdp_gather_ratio: float = 1.0
    """A block's FSDP all-gather bytes over bf16's (`[quantize] fsdp_float8_all_gather`: float8
    weights halve theirs; planner/low_precision.py `block_gather_ratio`); `fsdp_min_tokens` is
    scaled by it (the tokens that hide a gather grow with its bytes)."""
    pp: int = 1
    """Pipeline-parallel degree: the memory is the heaviest pp rank's (`pipeline.rank`)."""
    pipeline: PipelineCost | None = None  # noqa: F821  (planner/pipeline.py imports this module: no import back)
    """With pp > 1: the stages, the bubble and the p2p traffic (planner/pipeline.py)."""
    offloaded: int = 0
    """Bytes of the saved block inputs (`activations.blocks`, the scanned stack's) kept in pinned host
    memory (`[activation_checkpoint] offload = "block_inputs"` on a TPU target): host bytes per device."""
    offload_kept: int = 0
    """Of `offloaded`, what the device still holds in the backward loop: one row of the stack (one
    scan step's saved inputs, `activations.per_block`), the one the backward trip reads, fetched
    from the host by the trip before (the 8B's buffer assignment: one async dynamic-slice per trip;
    no other device copy of the stack). Counted in the device total."""
    embedding_backward: int = 0
    """The token embedding backward's transient (`embedding_backward_bytes`): after the block loops,
    with the saved activations, the kept weights and the other transients freed; the backward's
    peak where it exceeds the loop's (`backward_peak`)."""
    notes: list[str] = field(default_factory=list)

    # -- memory
    @property
    def transient(self) -> int:
        # Muon's update runs after the backward, with the activations freed.
        return max(self.transient_loss, self.transient_block + self.scan_flips, self.muon_update)

    @property
    def loop_peak(self) -> int:
        """Above the static state: what the backward holds at its peak inside the layers (the kept
        weights, the saved activations on the device, the larger transient)."""
        return self.saved_weights + self.activations.total - self.offloaded + self.offload_kept + self.transient

    @property
    def backward_peak(self) -> int:
        """Above the static state: what the backward holds at its peak, in the layers or, after them,
        in the embedding backward (`embedding_backward`; where host offload has emptied the layers'
        loop, the embedding backward can be the step's peak: the 8B's compile at 4 layers)."""
        return max(self.loop_peak, self.embedding_backward)

    @property
    def host_bytes(self) -> int:
        """Pinned host memory per device: the offloaded block inputs (0 without offload)."""
        return self.offloaded

    @property
    def total(self) -> int:
        # The update's new buffers are added, not overlapped with the backward: the step is one
        # program whose outputs XLA allocates beside its temporaries (the compiler's own total,
        # arguments + outputs + temporaries, agrees within 5 % on the scanned pod recipes).
        return self.params + self.grads + self.optimizer + self.backward_peak + self.update

    @property
    def usable(self) -> int:
        return int(self.target.hbm_bytes * (1.0 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def spare(self) -> int:
        return self.usable - self.total

    # -- throughput
    @property
    def tokens_per_device_step(self) -> float:
        """Tokens per optimizer step per device (the TP, CP and pp ranks share their dp rank's tokens:
        a pp rank runs its layers over all of them)."""
        return self.local_batch_size * self.seq_len * self.grad_accum / (self.tp * self.cp * self.pp)

    @property
    def compute_s(self) -> float:
        """The step's compute at the assumed MFU (with pp > 1 the heaviest rank's share)."""
        flops = self.tokens_per_device_step * self.flops_per_token * self.recompute_factor
        t = flops / (self.target.peak_flops * self.assumed_mfu)
        return t * self.pipeline.imbalance if self.pipeline is not None else t

    @property
    def step_time_s(self) -> float:
        """`compute_s`; with pp > 1 inflated by the bubble, plus the exposed p2p transfers:
        compute / (1 - bubble) + exposed (planner/pipeline.py)."""
        if self.pipeline is None:
            return self.compute_s
        busy = self.compute_s / (1.0 - self.pipeline.bubble)
        return busy + self.pipeline.p2p_exposed_s(self.compute_s)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_device_step / self.step_time_s

    @property
    def mfu(self) -> float:
        return self.assumed_mfu / self.recompute_factor

    @property
    def global_batch_tokens(self) -> int:
        return self.local_batch_size * self.seq_len * self.grad_accum * self.dp_replicate * self.dp_shard

    @property
    def fsdp_bound(self) -> bool:
        """True when a micro-batch is too small to hide FSDP's all-gathers (see GENERATIONS). With
        pp > 1 the micro-batch is the pipeline's (`local_batch / m` sequences): each pipeline
        micro-batch's pass through the stage gathers the stage's weights again (the iterations of
        graph mode's pipeline each gather theirs; before 2026-12-07 the whole local batch was read,
        which favoured pipeline plans)."""
        if self.fsdp_min_tokens is None or self.dp_shard * self.cp == 1:
            return False  # (SimpleFSDP shards over dp_shard x cp)
        return self.micro_batch_tokens < self.fsdp_min_tokens

    @property
    def micro_batch_tokens(self) -> int:
        """Tokens per device in one forward pass of the blocks: the accumulation micro-batch, or with
        pp > 1 one pipeline micro-batch of it, at `seq / cp`."""
        sequences = self.pipeline.micro_batch if self.pipeline is not None else self.local_batch_size
        return sequences * self.seq_len // self.cp


def ep_dispatch_bytes(
    shape: ModelShape,
    *,
    tokens: int,
    ep: int,
    capacity_factor: float = 0.0,
    local_batch_size: int = 1,
    seq_len: int = 1,
) -> int:
    """One MoE layer's dispatch buffers in its backward (beside the block's activations).

    - Dropless (`capacity_factor` 0): the static dispatch (parallelisms/expert_parallel.py
      `dispatch_combine_static`, the one a TPU and every traced step use) receives up to `ep x
      tokens x top_k` rows (all its peers' copies could come here). 0 without EP (the experts run
      on the local token copies, counted in the block's activations). Rows of the buffer: the
      received tokens and the experts' output (bf16, `dim` each), the SwiGLU's gate, up and
      product (bf16, `moe_hidden` each); the backward holds their gradients too (x2).
    - Capacity (models/common/moe.py): the `[E, batch x capacity]` buffer, `E x local_batch_size
      x capacity` rows (`capacity = min(seq, ceil(factor x seq x k / E))` per sequence), whatever
      the EP degree: about `factor x tokens x top_k`. Its forward rows are the block's own expert
      rows (`capacity_saved_delta`, in the activations), so this term is the backward's
      gradients in flight only: `capacity_backward_bytes`.
    """
    rows = expert_rows(
        shape, tokens=tokens, ep=ep, capacity_factor=capacity_factor, local_batch_size=local_batch_size, seq_len=seq_len
    )
    if capacity_factor > 0:
        return capacity_backward_bytes(shape, rows=rows)
    return 2 * rows * (2 * shape.dim + 3 * shape.moe_hidden) * 2


def capacity_saved_delta(shape: ModelShape, *, rows: int, tokens: int) -> int:
    """What one MoE block keeps for backward under the capacity dispatch, minus what the activation
    models (`planner.activations`, `planner.deepseek`) count for its routed copies.

    Those models count the dropless layout: per routed copy (`tokens x top_k` of them) its input
    and output rows (bf16, `2 dim` each) and the SwiGLU's gate, silu, up and product (bf16,
    `8 moe_hidden`). The capacity layout (`MoE._capacity_experts`) keeps the experts' input rows
    and SwiGLU intermediates per buffer row (`rows`, unused slots included, about `factor x tokens
    x top_k`) and each copy's gathered output (for the router-weight product), not per copy:
    `(rows - tokens x top_k) x (2 dim + 8 moe_hidden)` bytes more (less when the capacity is
    below one copy per row). Before 2026-12-06 the planner counted the copies' rows and the
    buffer's rows both (`ep_dispatch_bytes` held the forward rows again, and their gradients
    twice): 7.81 GiB for Qwen3-30B-A3B's 8 x 4096 tokens where the compiled program's MoE
    buffers take about 3 (docs/recipe_check.md). `8 moe_hidden` is the SwiGLU's; an expert
    activation that keeps more (`ModelShape.expert_act_tensors`) counts `2 x` that."""
    copies = tokens * shape.top_k
    return (rows - copies) * (2 * shape.dim + 2 * shape.expert_act_tensors * shape.moe_hidden)


def capacity_backward_bytes(shape: ModelShape, *, rows: int) -> int:
    """The capacity dispatch's gradients in flight in one MoE block's backward, bf16 per buffer row:
    the input rows' gradient (`2 dim`, before and after its all-to-all the same size) and the gate's
    and up's (`2 moe_hidden` each) while the product's has been consumed (the gradient of the
    experts' output precedes them and is freed by then)."""
    return rows * (2 * shape.dim + 4 * shape.moe_hidden)


def uneven_vocab_bytes(shape: ModelShape, *, head: int, fsdp: int) -> int:
    """A vocabulary that the FSDP degree does not divide (Qwen 3's 151,936 over 256, Llama 3's
    128,256 or DeepSeek-V3's 129,280 over 512): its head gradient is reduced unevenly, and the
    compiled programs hold a whole padded fp32 copy of it beside the bf16 and fp32 ones of the
    LM head backward: 4 bytes per element of the gathered head (`head`). Found from the pod
    compiles of 2026-12-06 (qwen3_8b / qwen3_32b_v6e: 10.6 / 18.2 GiB compiled, 8.0 / 15.0
    planned without it; tests/unit/test_planner_capacity.py); 0 when the vocabulary divides."""
    if fsdp <= 1 or shape.vocab_size % fsdp == 0:
        return 0
    return 4 * head


def expert_rows(
    shape: ModelShape,
    *,
    tokens: int,
    ep: int,
    capacity_factor: float = 0.0,
    local_batch_size: int = 1,
    seq_len: int = 1,
) -> int:
    """Rows one MoE layer's local experts compute on a device (`ep_dispatch_bytes`' buffer rows;
    0 without MoE, or dropless without EP, where the experts run on the block's own tokens)."""
    if not shape.is_moe:
        return 0
    if capacity_factor > 0:
        capacity = min(seq_len, math.ceil(capacity_factor * seq_len * shape.top_k / shape.num_experts))
        return shape.num_experts * local_batch_size * capacity
    if ep <= 1:
        return 0
    return ep * tokens * shape.top_k


def estimate(
    *,
    model: str,
    target: Target,
    shape: ModelShape,
    stats: ShardStats,
    parallel_dims: ParallelDims,
    local_batch_size: int,
    seq_len: int,
    ac_mode: str,
    loss_parallel: bool,
    flops_per_token: float,
    grad_accum: int = 1,
    headroom: float = 0.1,
    assumed_mfu: float = 0.4,
    activations: ActivationBytes | None = None,
    fused_loss: bool = False,
    scan_flips: bool = False,
    undonated_update: bool = False,
    optimizer: str = "adamw",
    stacked: bool = False,
    moe_capacity_factor: float = 0.0,
    quantize: QuantizePlan | None = None,
    moe_layers: float | None = None,
    scan_layout: tuple[int, int] | None = None,
    offload: str = "none",
) -> Estimate:
    """Combine the real shard sizes with the activation model (see the module docstring).

    `activations`: the model's own activation bytes (FLUX: `planner.flux.flux_activation_bytes`);
    None: the decoder-LM model `activation_bytes`. `fused_loss`, `scan_flips`,
    `undonated_update`: the step plan's (trainer/step/plan.py `StepPlan`). `optimizer`: "adamw", or
    "muon": one fp32 moment on the Muon matrices (`stats.muon_numel`) and the update's whole
    matrices (`stats.muon_whole_numel`, or `muon_whole_stacked_numel` when `stacked`, the
    layer scan's) at MUON_BYTES_PER_WHOLE_ELEMENT. `moe_capacity_factor`: `[moe] capacity_factor`
    (the dispatch buffers of `ep_dispatch_bytes`, the blocks' expert rows of `capacity_saved_delta`;
    `moe_layers`: how many blocks are MoE, default all; a pipeline rank's: its MoE blocks times its
    micro-batches in flight, planner/pipeline.py). `quantize`: the `[quantize]` plan (the
    low-precision copies of `planner.low_precision`, in the block backward). `scan_layout`: with
    `stacked`, (k, p) of a stack scanned after an unrolled prefix (`planner.shard.scan_layout`,
    DeepSeek-V4); None: the activations' `period`, no prefix. `offload`: the step plan's
    `scan_offload`; "block_inputs" on a TPU target with the layer scan and full AC moves the scanned
    blocks' saved inputs to host memory (`Estimate.offloaded`), of which the device keeps the row
    the backward trip reads (`Estimate.offload_kept`); elsewhere (CUDA: the pass leaves the graph
    alone) nothing moves."""
    loss_parallel = loss_parallel and parallel_dims.tp > 1
    memory, block, muon = _memory_terms(
        activations,
        shape,
        stats,
        parallel_dims=parallel_dims,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        ac_mode=ac_mode,
        loss_parallel=loss_parallel,
        fused_loss=fused_loss,
        scan_flips=scan_flips,
        undonated_update=undonated_update,
        optimizer=optimizer,
        stacked=stacked,
        moe_capacity_factor=moe_capacity_factor,
        quantize=quantize,
        moe_layers=moe_layers,
        scan_layout=scan_layout,
        offload=offload == "block_inputs" and stacked and ac_mode == "full" and target.device_type == "tpu",
    )
    est = Estimate(
        model=model,
        target=target,
        n_layers=shape.n_layers,
        **_degrees(parallel_dims),
        ac_mode=ac_mode,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        grad_accum=grad_accum,
        loss_parallel=loss_parallel,
        headroom=headroom,
        assumed_mfu=assumed_mfu,
        flops_per_token=flops_per_token,
        probed=stats.probed,
        **memory,
        **_throughput_terms(target, shape, stats, ac_mode=ac_mode, quantize=quantize),
    )
    est.notes.extend(_estimate_notes(est, shape, block, quantize, muon=muon, stacked=stacked))
    return est


def _degrees(parallel_dims: ParallelDims) -> dict[str, int]:
    """The plan's parallel degrees, as `Estimate` names them."""
    return dict(
        dp_replicate=parallel_dims.dp_replicate,
        dp_shard=parallel_dims.dp_shard,
        tp=parallel_dims.tp,
        ep=parallel_dims.ep,
        cp=parallel_dims.cp,
    )


def _memory_terms(
    activations: ActivationBytes | None,
    shape: ModelShape,
    stats: ShardStats,
    *,
    parallel_dims: ParallelDims,
    local_batch_size: int,
    seq_len: int,
    ac_mode: str,
    loss_parallel: bool,
    fused_loss: bool,
    scan_flips: bool,
    undonated_update: bool,
    optimizer: str,
    stacked: bool,
    moe_capacity_factor: float,
    quantize: QuantizePlan | None,
    moe_layers: float | None,
    scan_layout: tuple[int, int] | None = None,
    offload: bool = False,
) -> tuple[dict, BlockTransient, int]:
    """`estimate`'s memory fields of `Estimate` (state, saved activations and weights, transients,
    scan flips, the undonated update, the host offload), the block transient's terms and Muon's
    local matrix elements. `offload`: the scanned blocks' saved inputs go to host memory."""
    tokens = local_batch_size * seq_len // parallel_dims.cp  # this device's tokens (CP splits the sequence)
    acts = _saved_activations(
        activations,
        shape,
        parallel_dims=parallel_dims,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        ac_mode=ac_mode,
        loss_parallel=loss_parallel,
        fused_loss=fused_loss,
        moe_capacity_factor=moe_capacity_factor,
        moe_layers=moe_layers,
    )
    period = acts.period if stacked else 1
    prefix = 0
    if stacked and scan_layout is not None and scan_layout[0] + 2 * scan_layout[1] <= shape.n_layers:
        # a stack scanned after an unrolled prefix (models/common/stack.py `scan_layout`: DeepSeek-V4's
        # hash-routed blocks); the period's blocks counted alike (the activation model's per block)
        prefix, period = scan_layout
        if period != acts.period:
            acts = dataclasses.replace(acts, period=period, period_none=period * acts.per_block_none)
    # the prefix runs outside the scan body, its blocks checkpointed as the unscanned step's
    # (trainer/graph/step.py `_enable_scans`): each keeps `per_block`
    unrolled = prefix * acts.per_block
    if period > 1 and ac_mode in ("full", "full_save_attention"):
        # a hybrid stack scanned one period per step (models/common/stack.py `scan_period`): the scan
        # saves each period's input, and its backward recomputes the period's blocks at once
        acts = dataclasses.replace(
            acts,
            blocks=(shape.n_layers - prefix) // period * acts.per_block + unrolled,
            per_block_none=acts.period_none,
        )
    local = stats.param_numel
    muon, moments, muon_update = _optimizer_bytes(stats, optimizer=optimizer, stacked=stacked)
    block = _block_transient(
        acts,
        shape,
        stats,
        parallel_dims=parallel_dims,
        local_batch_size=local_batch_size,
        seq_len=seq_len,
        ac_mode=ac_mode,
        tokens=tokens,
        moe_capacity_factor=moe_capacity_factor,
        quantize=quantize,
        period=period,
    )
    memory = dict(
        params=4 * local,
        grads=4 * local,
        optimizer=moments,
        saved_weights=2 * _kept_gathered_numel(stats, ac_mode),
        activations=acts,
        transient_loss=_loss_transient(
            acts, shape, stats, parallel_dims=parallel_dims, tokens=tokens, fused_loss=fused_loss
        ),
        transient_block=block.total,
        fused_loss=fused_loss,
        # torch's scan autograd flips every stacked input of the backward scan: the saved block
        # inputs and the fp32 parameter shards (measured on a captured 70B step: exact); not the
        # unrolled prefix's (its share of the blocks' parameters taken as its share of the blocks)
        scan_flips=acts.blocks - unrolled + 4 * stats.blocks_numel * (shape.n_layers - prefix) // shape.n_layers
        if scan_flips
        else 0,
        update=4 * local + moments if undonated_update else 0,
        # the scanned stack's saved block inputs (a pipeline rank's: all its in-flight iterations'),
        # not the unrolled prefix's (`offload_block_inputs_pass` rewrites scans only)
        offloaded=acts.blocks - unrolled if offload else 0,
        offload_kept=min(acts.per_block, acts.blocks - unrolled) if offload else 0,
        embedding_backward=embedding_backward_bytes(stats),
        optimizer_name=optimizer,
        muon_update=muon_update,
        quantize_recipe=block.recipe,
        quantize_transient=block.lowp,
    )
    return memory, block, muon


def _throughput_terms(
    target: Target, shape: ModelShape, stats: ShardStats, *, ac_mode: str, quantize: QuantizePlan | None
) -> dict:
    """`estimate`'s throughput fields of `Estimate`: the recompute factor of the AC mode, and the
    tokens that hide FSDP's all-gathers on the generation, scaled by MoE sparsity and the gathers'
    bytes (`fsdp_gather_ratio`)."""
    sparsity = shape.num_experts / shape.top_k if shape.is_moe else 1
    gather_ratio = (
        block_gather_ratio(stats.linear_shapes, stats.block_gathered_numel, quantize) if quantize is not None else 1.0
    )
    gen = target.generation
    return dict(
        recompute_factor=RECOMPUTE_FACTOR[ac_mode],
        fsdp_min_tokens=int(gen.fsdp_min_tokens * sparsity * gather_ratio) if gen.fsdp_min_tokens else None,
        fsdp_gather_ratio=gather_ratio,
    )


def _moe_layer_rows(parallel_dims, local_batch_size: int, seq_len: int, capacity_factor: float) -> dict:
    """`expert_rows` / `ep_dispatch_bytes` keywords of one MoE layer on this device: its tokens are
    the rank's share of the sequence, split by CP and, under TP, the rank's sequence shard the
    layer runs on (models/qwen3/plan.py)."""
    shard = parallel_dims.cp * parallel_dims.tp
    return dict(
        tokens=local_batch_size * seq_len // shard,
        ep=parallel_dims.ep,
        capacity_factor=capacity_factor,
        local_batch_size=local_batch_size,
        seq_len=seq_len // shard,
    )


def _saved_activations(
    activations: ActivationBytes | None,
    shape: ModelShape,
    *,
    parallel_dims: ParallelDims,
    local_batch_size: int,
    seq_len: int,
    ac_mode: str,
    loss_parallel: bool,
    fused_loss: bool,
    moe_capacity_factor: float,
    moe_layers: float | None,
) -> ActivationBytes:
    """`estimate`'s activation bytes: the model's own or the decoder-LM model's, with the
    capacity dispatch's buffer rows in place of per-copy rows, and the fused loss's one fp32
    log-sum-exp per token in place of the log-probs."""
    tp, cp = parallel_dims.tp, parallel_dims.cp
    acts = (
        activations
        if activations is not None
        else activation_bytes(
            shape,
            local_batch_size=local_batch_size,
            seq_len=seq_len,
            tp=tp,
            ac_mode=ac_mode,
            loss_parallel=loss_parallel,
            cp=cp,
        )
    )
    tokens = local_batch_size * seq_len // cp  # this device's tokens (CP splits the sequence)
    if shape.is_moe and moe_capacity_factor > 0:
        # the capacity layout keeps buffer rows, not per-copy rows (`capacity_saved_delta`)
        moe_rows = _moe_layer_rows(parallel_dims, local_batch_size, seq_len, moe_capacity_factor)
        moe_tokens = moe_rows["tokens"]
        rows = expert_rows(shape, **moe_rows)
        delta = capacity_saved_delta(shape, rows=rows, tokens=moe_tokens)
        # what the AC mode keeps per block: all of it (none), the matmul outputs (selective: gate, up
        # and down, `4 moe_hidden + 2 dim` per row instead of per copy), the block input only (full)
        kept_delta = {
            "none": delta,
            "selective": (rows - moe_tokens * shape.top_k) * (4 * shape.moe_hidden + 2 * shape.dim),
            "full": 0,
            "full_save_attention": 0,  # the block keeps its input and attention's outputs, no expert rows
        }[ac_mode]
        acts = dataclasses.replace(
            acts,
            per_block_none=acts.per_block_none + delta,
            per_block=acts.per_block + kept_delta,
            blocks=acts.blocks + round(kept_delta * (shape.n_layers if moe_layers is None else moe_layers)),
        )
    if fused_loss:
        # ops.linear_cross_entropy keeps one fp32 log-sum-exp per token instead of [tokens, vocab]
        # log-probs, and never forms the whole logits (tiles of them in the kernel's VMEM); one per
        # pass over the head (multi-token prediction: 1 + its depth)
        acts = dataclasses.replace(acts, loss=4 * tokens * acts.loss_passes, logits_transient=0)
    return acts


def _optimizer_bytes(stats: ShardStats, *, optimizer: str, stacked: bool) -> tuple[int, int, int]:
    """(Muon's local matrix elements, the optimizer moments' bytes, Muon's update transient):
    AdamW two fp32 moments per local element, Muon one on its matrices."""
    local = stats.param_numel
    muon = stats.muon_numel if optimizer == "muon" else 0
    moments = 8 * local - 4 * muon
    muon_update = 0
    if muon:
        muon_update = MUON_BYTES_PER_WHOLE_ELEMENT * (
            stats.muon_whole_stacked_numel if stacked else stats.muon_whole_numel
        )
    return muon, moments, muon_update


def _kept_gathered_numel(stats: ShardStats, ac_mode: str) -> int:
    """Weights the backward needs in bf16 (elements): SimpleFSDP gathers (or casts) a weight where
    it is used and the matmul keeps that copy, unless AC recomputes the block. The LM head and
    the final norm sit outside the checkpointed blocks, so their copies are always kept."""
    kept = stats.root_kept_gathered_numel
    if ac_mode == "none":
        kept += stats.blocks_gathered_numel
    return kept


def _loss_transient(
    acts: ActivationBytes,
    shape: ModelShape,
    stats: ShardStats,
    *,
    parallel_dims: ParallelDims,
    tokens: int,
    fused_loss: bool,
) -> int:
    """The loss and LM head backward's transient peak (bytes), in two phases: the log-softmax
    backward (fp32 logits gradient in and out, log-probs still kept), then the LM head backward
    (bf16 logits gradient + weight gradient; log-probs freed); plus an uneven vocabulary's
    fp32 head copy (`uneven_vocab_bytes`)."""
    head = stats.lm_head_gathered_numel
    transient_loss = max(acts.logits_transient, 6 * head + acts.logits_transient // 4 - acts.loss)
    if fused_loss:  # the kernel's backward: the head's weight gradient (bf16 + fp32) and dh [tokens, dim]
        transient_loss = 6 * head + 2 * tokens * shape.dim
    transient_loss += uneven_vocab_bytes(shape, head=head, fsdp=parallel_dims.dp_shard * parallel_dims.cp)
    return transient_loss


@dataclass(frozen=True)
class BlockTransient:
    """One block backward's transient peak (bytes, `Estimate.transient_block`) and the terms the
    notes name."""

    total: int
    dispatch: int
    """The MoE dispatch buffers (`ep_dispatch_bytes`)."""
    gathered_kv_grads: int
    """CP: the gradients of the gathered k/v (`cp_gathered_kv_bytes`)."""
    lowp: int
    """The low-precision copies and scales of the largest quantized linear's backward."""
    recipe: str
    """`[quantize] recipe` ("none" without a plan)."""
    capacity_factor: float
    """`[moe] capacity_factor` (0: the dropless dispatch)."""


def _block_transient(
    acts: ActivationBytes,
    shape: ModelShape,
    stats: ShardStats,
    *,
    parallel_dims: ParallelDims,
    local_batch_size: int,
    seq_len: int,
    ac_mode: str,
    tokens: int,
    moe_capacity_factor: float,
    quantize: QuantizePlan | None,
    period: int = 1,
) -> BlockTransient:
    """One block backward's transient peak. Under AC the recompute re-gathers the whole block's
    bf16 weights and re-creates its activations; in every mode one weight gradient at a time
    exists unsharded (bf16 + fp32 copy for the reduce-scatter, each parameter's gradient is
    reduced as soon as autograd produces it), plus the gradients of the two all-gathered
    projection inputs, the MoE dispatch buffers, CP's gathered k/v gradients and the
    low-precision operand copies."""
    tp, cp = parallel_dims.tp, parallel_dims.cp
    recompute = {
        "none": 0,
        "full": acts.per_block_none,
        "full_save_attention": acts.per_block_none,  # an upper bound: the attention output is not re-created
        "selective": max(0, acts.per_block_none - acts.per_block),
    }[ac_mode]
    # a periodic scan's backward recomputes, so re-gathers, one period's blocks at once
    gathered = stats.blocks_gathered_numel * period // stats.n_layers if period > 1 else stats.block_gathered_numel
    regather = 2 * gathered if ac_mode != "none" else 0
    t_proj = tokens
    # CP: the attention backward produces the gradients of the gathered k/v (bf16, the whole
    # sequence) before their reduce-scatter; the gathered k/v themselves are in `recompute` (AC)
    # or kept (no AC). Splash's working set (one block_q x block_kv tile of scores per step) is
    # in VMEM, not HBM, and no [s/cp, s] mask exists on TPU.
    # (A hybrid stack's model says which of its kinds holds more: `ActivationBytes.cp_backward`.)
    gathered_kv_grads = (
        acts.cp_backward
        if acts.cp_backward is not None
        else cp_gathered_kv_bytes(shape, local_batch_size=local_batch_size, seq_len=seq_len, tp=tp, cp=cp)
    )
    moe_rows = _moe_layer_rows(parallel_dims, local_batch_size, seq_len, moe_capacity_factor)
    dispatch = ep_dispatch_bytes(shape, **moe_rows)
    recipe = quantize.recipe if quantize is not None else "none"
    lowp = quantize_transient_bytes(
        quantized_linear_shapes(stats.linear_shapes, quantize) if quantize is not None else [],
        tokens=t_proj,
        recipe=recipe,
        float8_weights=quantize is not None and quantize.fsdp_float8_all_gather,
    )
    if quantize is not None and shape.is_moe:
        rows = expert_rows(shape, **moe_rows) or moe_rows["tokens"] * shape.top_k  # dropless, no EP: its own tokens
        lowp = max(lowp, experts_transient_bytes(shape, quantize, rows=rows, ep=parallel_dims.ep))
    total = (
        lowp
        + regather
        + recompute
        + 6 * stats.largest_block_param_gathered
        + 2 * (2 * shape.dim * t_proj)
        + dispatch
        + gathered_kv_grads
    )
    return BlockTransient(
        total=total,
        dispatch=dispatch,
        gathered_kv_grads=gathered_kv_grads,
        lowp=lowp,
        recipe=recipe,
        capacity_factor=moe_capacity_factor,
    )


def _estimate_notes(
    est: Estimate, shape: ModelShape, block: BlockTransient, quantize: QuantizePlan | None, *, muon: int, stacked: bool
) -> list[str]:
    """The notes `estimate` attaches: the quantize recipe's copies, Muon's update, a TP degree
    beyond a host, the MoE dispatch buffers, CP's gathered k/v, exposed FSDP traffic."""
    tokens = est.local_batch_size * est.seq_len // est.cp  # this device's tokens (CP splits the sequence)
    moe_capacity_factor = block.capacity_factor
    gen = est.target.generation
    notes: list[str] = []
    if block.recipe != "none":
        notes.append(
            f"[quantize] {block.recipe}: the largest quantized linear's backward holds {block.lowp / 2**30:.2f} GiB of "
            "low-precision operand copies and scales beside the "
            + ("float8-gathered weight" if quantize.fsdp_float8_all_gather else "bf16 gathered weight")
            + " (in the block backward); nothing more is saved for backward"
        )
    if muon:
        notes.append(
            f"Muon: one fp32 moment on {muon / 1e6:.1f} M local matrix elements (AdamW: two); its "
            f"update holds {est.muon_update / 2**30:.2f} GiB of whole matrices (the largest "
            f"{'stack' if stacked else 'matrix set'} after the all-to-all)"
        )
    if est.offloaded:
        notes.append(
            f"host offload (block_inputs): {est.offloaded / 2**30:.2f} GiB of saved block inputs per device "
            f"in pinned host memory, {est.offloaded * gen.devices_per_host / 2**30:.2f} GiB per host "
            f"({gen.devices_per_host} devices; the planner does not know the host's RAM: not checked); the "
            f"device keeps the row the backward reads ({est.offload_kept / 2**30:.2f} GiB)"
            + (
                f"; the embedding backward ({est.embedding_backward / 2**30:.2f} GiB of fp32 tables) is the step's peak"
                if est.embedding_backward > est.loop_peak
                else ""
            )
            + "; the offload compiles' totals (their heap's extent) ran 0.6-1.6 GiB above their live peak, which this models "
            "(docs/planner.md, 'Host offload against the compiles')"
        )
    if est.tp > gen.devices_per_host:
        notes.append(
            f"tp {est.tp} spans more than one host ({gen.devices_per_host} devices per host): "
            "TP collectives would leave the host's fastest links"
        )
    if shape.is_moe and moe_capacity_factor > 0:
        notes.append(
            f"MoE capacity factor {moe_capacity_factor:g}: the capacity dispatch's buffers "
            f"({block.dispatch / 2**30:.2f} GiB) are in the block backward"
        )
    elif est.ep > 1:
        notes.append(
            f"expert parallelism: the static dispatch's worst-case buffers ({block.dispatch / 2**30:.2f} GiB) "
            "are in the block backward"
        )
    if est.cp > 1 and est.activations.cp_backward is not None:  # a hybrid stack (Qwen 3.5)
        notes.append(
            f"context parallelism {est.cp}: {tokens} tokens per device and micro-batch; the full-attention "
            "layers all-gather k/v of the whole sequence, the linear-attention layers every chunk's delta-rule "
            f"state map [F | Pi] (the larger block backward's gradients: {block.gathered_kv_grads / 2**30:.2f} GiB)"
        )
    elif est.cp > 1:
        notes.append(
            f"context parallelism {est.cp}: {tokens} tokens per device and micro-batch; each layer "
            f"all-gathers k/v of the whole sequence ({block.gathered_kv_grads / 2**30:.2f} GiB, splash "
            "attention; the gradients reduce-scattered back)"
        )
    if est.fsdp_bound:
        notes.append(
            f"{tokens} tokens per micro-batch is below the ~{est.fsdp_min_tokens} "
            f"that hide FSDP's all-gathers on {gen.name}: expect exposed communication"
        )
    return notes
