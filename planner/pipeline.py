"""Pipeline parallelism in the planner: per-stage memory, the bubble and the point-to-point traffic.

With `pp > 1` the world is `pp` stages of `world / pp` devices (parallelisms/parallel_dims.py:
`pp` outermost); the rest of the mesh (dp_replicate x dp_shard x cp x tp) runs inside a stage as
without PP, so `shard_model` on the `ParallelDims` with `pp` gives one stage-mesh rank's shards of
every parameter. From those, for each pp rank `r` (docs/planner.md, "Pipeline parallelism in the
planner"):

- **weights, gradients, optimizer state**: the blocks of its stages (`split_layers`, `stage_ids`:
  the trainer's own split and placement), the token embedding only where it holds stage 0, the
  final norm and head only where it holds the last stage (graph mode's uniform stages,
  `PipelineSpec.uniform`: every rank holds and runs the embedding, norm, head and loss);
- **activations**: one micro-batch of `local_batch / m` sequences per in-flight micro-batch
  (`in_flight`: 1F1B holds `min(m, p - r)`, GPipe and LoopedBFS all `m`, the interleaved schedules
  `min(v m, (v - 1) p + 2 (p - 1 - r) + 1)` chunks of 1/v of the rank's layers, ZBV `min(m, p)`;
  graph mode's uniform stages `T = m + p - 1`: its SPMD program runs every iteration on every
  rank, the idle ones too, and keeps their block inputs),
  the loss and the head's transients only where it holds the last stage;
- **MoE** (eager or graph-mode PP, EP inside the stage): a rank holds the experts of its own blocks
  only (`num_experts / ep` per device, as the stage mesh's plan shards them), a stage of dense blocks
  (DeepSeek-V3's first, `ShardStats.stacks`) none; the dispatch buffers and capacity rows are one
  micro-batch's, the kept rows times the rank's MoE blocks and micro-batches in flight (graph mode:
  all `T` iterations', whose dispatch runs in the bubble too, on the stage's idle input; its time is
  the bubble's, `1 / (1 - bubble)`);
- **CP** (eager PP): a micro-batch at `seq / cp` per device, with CP's gathered k/v;
- the heaviest rank is the plan's memory (`Estimate.pipeline.rank` says which);
- **time**: the compute of the heaviest rank's share (`imbalance`: its blocks, each by its own
  FLOPs where dense and MoE blocks mix (`two_kind_weights`), plus the head's
  FLOPs in block units where it holds the last stage, `head_block_units`, every rank with uniform
  stages, over the model's FLOPs / pp, which count the head once), inflated by the
  schedule's bubble (`bubble_fraction`): `t = t_compute x imbalance / (1 - bubble) + exposed p2p`;
- **p2p**: each micro-batch crosses each stage boundary forward (activations) and backward
  (their gradients): `[mb, seq / cp, dim]` bf16 per device (sequence parallel splits it by tp),
  `2 m v` transfers per accumulation micro-batch (graph mode: `2 (T - 1)` permutes); over the DCN at
  the boundaries between slices (`pp` outermost over the slices; with more stages than slices the
  others are inside a slice: `dcn_hops`), else over one ICI link (`ICI_GBYTES_PER_S_PER_LINK`). The
  pipeline's fill and drain (`2 (p - 1)` hops, each on its own link) are exposed; the steady state's
  transfers hide under the compute unless they exceed it; graph mode's permutes are all exposed
  (each pipeline iteration waits for the last one's), at the DCN rate wherever a boundary crosses
  slices (the ring runs at the pace of its DCN ranks: `PipelineCost.p2p_exposed_s`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from models.contract import ModelShape
from parallelisms.pipeline_parallel import (
    SCHEDULES,
    ZERO_BUBBLE_SCHEDULES,
    bubble_fraction,
    schedule_style,
    split_layers,
    stage_ids,
    virtual_stages,
)
from planner.activations import ActivationBytes
from planner.shard import ShardStats
from planner.targets import Target

ICI_GBYTES_PER_S_PER_LINK: dict[str, float] = {
    "v4": 25.0,
    "v5e": 50.0,
    "v5p": 100.0,
    "v6e": 100.0,
    "v7x": 100.0,
    "h100": 50.0,
    "h200": 50.0,
    "b200": 50.0,
}
"""One direction of one link, GB/s, what a stage boundary's send uses. TPUs: the published
bidirectional inter-chip bandwidth per chip over its ports, halved (v5e 400 GB/s and v6e 800 GB/s
over 4 ports; v5p and TPU7x 1,200 GB/s over 6; v4 not published, taken as half of v5p's link);
GPUs: one 400 Gb/s NIC per GPU, the stages being on different nodes (NVLink inside a node is
faster; not modelled). Assumptions, not measured."""


@dataclass(frozen=True)
class PipelineSpec:
    """A plan's pipeline: `[parallelism] pipeline_*` (trainer/step/plan.py `StepRequest`)."""

    pp: int
    schedule: str = "1F1B"
    microbatches: int = 0
    """0: the number of stages (the trainer's default)."""
    virtual: int = 0
    """Stages per rank (0: the schedule's default)."""
    first_less: int = 1
    last_less: int = 1
    uniform: bool = False
    """Graph mode's uniform stages (trainer/graph/pipeline.py): every pp rank holds and runs the
    embedding, the norm, the head and the loss (one SPMD program; one stage's are the real ones)."""

    @property
    def v(self) -> int:
        return virtual_stages(self.schedule, self.virtual) if self.schedule in SCHEDULES else 1

    @property
    def num_stages(self) -> int:
        return self.pp * self.v

    @property
    def m(self) -> int:
        return self.microbatches or self.num_stages

    @property
    def bubble(self) -> float:
        return bubble_fraction(self.schedule, self.pp, self.m, self.v)

    @property
    def iterations(self) -> int:
        """Graph mode's pipeline iterations per accumulation micro-batch, `T = m + p - 1`."""
        return self.m + self.pp - 1

    @property
    def transfers(self) -> int:
        """Stage-boundary transfers per device and accumulation micro-batch, both directions: `2 m v`
        (each micro-batch forward and its gradient backward), graph mode's `2 (T - 1)` permutes (the
        ring moves a chunk every iteration but the last, idle ones included)."""
        return 2 * (self.iterations - 1) if self.uniform else 2 * self.m * self.v

    @property
    def boundaries(self) -> int:
        """Boundaries between pp ranks a micro-batch crosses: the chain's `p - 1`, graph mode's ring
        `p` (its permute also moves the last rank's output to rank 0, an idle iteration's)."""
        return self.pp if self.uniform else self.pp - 1

    def stages(self, n_layers: int) -> list[range]:
        return split_layers(n_layers, self.num_stages, first_stage_less=self.first_less, last_stage_less=self.last_less)

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        return stage_ids(rank, self.pp, self.schedule, self.v)

    def holds_first_last(self, rank: int) -> tuple[bool, bool]:
        """(holds the embedding, holds the norm, head and loss): stage 0's and the last stage's
        ranks, or every rank with uniform stages."""
        ids = self.rank_stages(rank)
        return (True, True) if self.uniform else (0 in ids, self.num_stages - 1 in ids)

    def rank_layers(self, n_layers: int) -> list[int]:
        """Blocks each pp rank holds (all its stages)."""
        split = self.stages(n_layers)
        return [sum(len(split[s]) for s in self.rank_stages(r)) for r in range(self.pp)]

    def rank_layer_ids(self, n_layers: int, rank: int) -> list[int]:
        """The model's layer indices rank `rank` holds (all its stages), in order."""
        split = self.stages(n_layers)
        return sorted(i for s in self.rank_stages(rank) for i in split[s])

    def rank_units(
        self, n_layers: int, head_units: float | None = None, layer_weights: tuple[float, ...] | None = None
    ) -> list[float]:
        """Each rank's compute in block units: its blocks, plus the head and loss where it holds the
        last stage (every rank with uniform stages). `head_units`: the head's training FLOPs over one
        block's (`head_block_units`); None: `split_layers`' own accounting, `first_less` for the
        embedding and `last_less` for the head. The embedding is a lookup: 0 FLOPs when the head is
        priced. `layer_weights`: each layer's FLOPs over the mean block's (`two_kind_weights`: a dense
        block against an MoE block's active experts where a split mixes them); None: alike."""
        if layer_weights is None:
            layers = [float(n) for n in self.rank_layers(n_layers)]
        else:
            layers = [sum(layer_weights[i] for i in self.rank_layer_ids(n_layers, r)) for r in range(self.pp)]
        if head_units is not None:
            return [n + (head_units if self.holds_first_last(r)[1] else 0.0) for r, n in enumerate(layers)]
        last = self.num_stages - 1
        return [
            n
            + (self.first_less if 0 in self.rank_stages(r) else 0)
            + (self.last_less if last in self.rank_stages(r) else 0)
            for r, n in enumerate(layers)
        ]

    def imbalance(
        self, n_layers: int, head_units: float | None = None, layer_weights: tuple[float, ...] | None = None
    ) -> float:
        """The heaviest rank's compute over its share of the model's, `1 / pp` of it (1: balanced, no
        work repeated): the factor on `Estimate.compute_s`, which spreads the model's FLOPs (the head
        counted once) over the pp ranks. Uniform stages run the head and the loss on every rank (one
        SPMD program, `rank_units`), so the model's work is the ranks' less `pp - 1` heads: Llama 3 8B
        at pp 2 and seq 8192 (head 1.84 blocks, 32 layers) 2 x 17.84 / 33.84 = 1.054 (before
        2026-12-07, 1.000: the sum of the ranks' units was taken for the model's)."""
        units = self.rank_units(n_layers, head_units, layer_weights)
        work = sum(units) - ((self.pp - 1) * head_units if self.uniform and head_units is not None else 0.0)
        return max(units) * self.pp / work

    def in_flight(self, rank: int) -> float:
        """Micro-batches whose activations rank `rank` holds at its peak, in units of all its layers
        (module docstring)."""
        p, m, v = self.pp, self.m, self.v
        if self.uniform:
            # graph mode's one SPMD program: every rank runs all T = m + p - 1 pipeline iterations,
            # the idle ones too, and autograd keeps each iteration's block inputs
            return float(self.iterations)
        if self.schedule in ("GPipe", "LoopedBFS"):
            return float(m)
        if self.schedule == "1F1B":
            return float(min(m, p - rank))
        if schedule_style(self.schedule) == "v":
            return float(min(m, p))
        return min(v * m, (v - 1) * p + 2 * (p - 1 - rank) + 1) / v


def spec_of(request) -> PipelineSpec:
    """The pipeline of a `StepRequest` (trainer/step/plan.py)."""
    return PipelineSpec(
        pp=request.pp_degree,
        schedule=request.pp_schedule,
        microbatches=request.pp_microbatches,
        virtual=request.pp_virtual_stages,
        first_less=request.pp_first_less,
        last_less=request.pp_last_less,
        uniform=request.pp_degree > 1 and request.mode == "graph",
    )


def stage_stats(stats: ShardStats, spec: PipelineSpec, rank: int) -> ShardStats:
    """`stats` (the whole model on one stage-mesh rank) cut to what pp rank `rank` holds: its
    blocks, the embedding on stage 0, the norm and head on the last. The blocks of one stack are
    taken as alike (Qwen 3.5's attention kinds alternate: the mean block); a model of several stacks
    (DeepSeek-V3's dense blocks, then its MoE blocks: `ShardStats.stacks`) is counted per stack, so
    a stage of dense blocks holds no experts. An MoE block's experts are those of its stage mesh
    (`num_experts / ep` per device, EP inside the stage), as `shard_model` sharded them. Muon's
    matrices are scaled with the blocks (by default it excludes the embedding and head)."""
    n = stats.n_layers
    layers = spec.rank_layers(n)[rank]
    first, last = spec.holds_first_last(rank)
    head_side = stats.root_numel - stats.embedding_numel
    root = (stats.embedding_numel if first else 0) + (head_side if last else 0)
    if stats.stacks:
        ids, start, held = spec.rank_layer_ids(n, rank), 0, []
        for length, *_ in stats.stacks:
            held.append(sum(start <= i < start + length for i in ids))
            start += length
        scale_of = lambda k: sum(st[k] * c // st[0] for st, c in zip(stats.stacks, held) if st[0])  # noqa: E731
        blocks, gathered, muon_blocks = scale_of(1), scale_of(2), scale_of(3)
        muon = stats.muon_numel - sum(st[3] for st in stats.stacks) + muon_blocks
    else:
        scale = lambda x: x * layers // n  # noqa: E731
        blocks, gathered, muon = scale(stats.blocks_numel), scale(stats.blocks_gathered_numel), scale(stats.muon_numel)
    return dataclasses.replace(
        stats,
        n_layers=layers,
        root_numel=root,
        blocks_numel=blocks,
        blocks_gathered_numel=gathered,
        lm_head_gathered_numel=stats.lm_head_gathered_numel if last else 0,
        root_kept_gathered_numel=stats.root_kept_gathered_numel if last else 0,
        muon_numel=muon,
        embedding_numel=stats.embedding_numel if first else 0,
    )


def moe_layer_ids(n_layers: int, moe_layers: int | None) -> range:
    """The MoE blocks' indices: the last `moe_layers` (DeepSeek-V3's dense blocks come first;
    None: every block)."""
    return range(n_layers - (n_layers if moe_layers is None else moe_layers), n_layers)


def stage_activations(per_micro: ActivationBytes, spec: PipelineSpec, rank: int) -> ActivationBytes:
    """What rank `rank` keeps: `per_micro` (one micro-batch through its layers) times its in-flight
    micro-batches; the head's input, the loss and its transient only on the last stage. Graph mode
    (uniform stages) runs the head and the loss once, on all m chunks together (`PipelinedLoss._loss`
    on the stacked outputs), so the logits' transient is m chunks' too (the deviceless compile of
    Llama 3 8B at pp 2 x tp 2, plain loss, m 2: one f32[2, 2048, 128256] logits buffer)."""
    k = spec.in_flight(rank)
    k_head = spec.m if spec.uniform else k  # graph mode: the head and loss run once per chunk, after the loop
    last = spec.holds_first_last(rank)[1]
    return dataclasses.replace(
        per_micro,
        blocks=int(per_micro.blocks * k),
        outside=int(per_micro.outside * k_head) if last else 0,
        loss=int(per_micro.loss * k_head) if last else 0,
        logits_transient=per_micro.logits_transient * (spec.m if spec.uniform else 1) if last else 0,
    )


@dataclass(frozen=True)
class PipelineCost:
    """The pipeline terms of an `Estimate` (the heaviest pp rank's memory, the step's bubble and p2p)."""

    spec: PipelineSpec
    rank: int
    """The pp rank whose memory is the plan's (the heaviest)."""
    rank_layers: tuple[int, ...]
    rank_totals: tuple[int, ...]
    """Per-device bytes of each pp rank."""
    micro_batch: int
    """Sequences per pipeline micro-batch (`local_batch / m`)."""
    in_flight: float
    """The heaviest rank's in-flight micro-batches (in units of all its layers)."""
    imbalance: float
    p2p_bytes: int
    """Bytes one device sends (activations forward, gradients backward) per step."""
    transfer_bytes: int
    """One micro-batch's activations at one boundary, per device."""
    link: str
    """"DCN" (a stage boundary crosses slices) or "ICI"."""
    link_bytes_per_s: float
    """Per device: its share of the host's DCN bandwidth where a boundary crosses slices, else one ICI
    link's: the slowest boundary's, which every transfer of a device at it takes."""
    grad_accum: int = 1
    dcn_hops: int = 0
    """Stage boundaries a micro-batch crosses over the DCN (`dcn_hops`: of the chain's `p - 1`, graph
    mode's ring `p`); the others are ICI (more stages than slices: `pp / slices` stages a slice)."""
    ici_bytes_per_s: float = 0.0
    """One ICI link's bytes/s, what the other boundaries take (0: `link_bytes_per_s`)."""
    mixing_share: float = 0.0
    """The blocks' attention products' share of their training FLOPs (`mixing_share`): what the
    zero-bubble schedules' input-gradient pass B holds and their weight pass W does not."""

    @property
    def bubble(self) -> float:
        """`bubble_fraction` of the schedule; the zero-bubble ones with B and W at their FLOPs
        (`zero_bubble_costs`) instead of equal to the forward."""
        s = self.spec
        if s.schedule in ZERO_BUBBLE_SCHEDULES and self.mixing_share > 0:
            f, b, w = zero_bubble_costs(self.mixing_share)
            return bubble_fraction(s.schedule, s.pp, s.m, s.v, f=f, b=b, w=w)
        return s.bubble

    @property
    def transfer_s(self) -> float:
        return self.transfer_bytes / self.link_bytes_per_s

    @property
    def p2p_serial_s(self) -> float:
        return self.p2p_bytes / self.link_bytes_per_s

    def p2p_exposed_s(self, compute_s: float) -> float:
        """The fill and drain hops (2 (p - 1) per accumulation micro-batch, each on its own link:
        `dcn_hops` of them over the DCN, the rest over ICI), plus whatever of the steady state's
        transfers exceeds the compute (`compute_s`) they hide under. Graph mode's uniform stages:
        all of them, each at the slowest boundary's rate. Its pipeline iteration is the stage's
        blocks, then the permute, and the next iteration's blocks read what the permute delivered
        (trainer/graph/pipeline.py, no delayed forwarding as MaxText's
        `pipeline_delay_activation_forwarding`), so every permute is on the step's critical path with
        nothing to hide under; and with more stages than slices, where some boundaries are ICI, the
        ranks at a DCN boundary send or receive over the DCN in every iteration, and their neighbours'
        next permute waits for them (a permute pairs each rank with both neighbours), so the ring
        runs at the DCN ranks' pace: all permutes at the DCN rate, as priced."""
        if self.spec.uniform:
            return self.p2p_serial_s
        hops = 2 * (self.spec.pp - 1)
        dcn = min(2 * self.dcn_hops, hops)
        ici_s = self.transfer_bytes / (self.ici_bytes_per_s or self.link_bytes_per_s)
        fill = self.grad_accum * (dcn * self.transfer_s + (hops - dcn) * ici_s)
        return min(self.p2p_serial_s, fill + max(0.0, self.p2p_serial_s - fill - compute_s))

    @property
    def link_text(self) -> str:
        """The link the p2p line names: "ICI", "DCN", or with some boundaries inside a slice "DCN (k of
        n boundaries; ICI inside a slice)"."""
        n = self.spec.boundaries
        if self.link != "DCN" or not 0 < self.dcn_hops < n:
            return self.link
        return f"DCN ({self.dcn_hops} of {n} boundaries; ICI inside a slice)"

    @property
    def holds(self) -> str:
        """What the heaviest rank holds besides blocks."""
        first, last = self.spec.holds_first_last(self.rank)
        parts = []
        if first:
            parts.append("embedding")
        if last:
            parts.append("head + loss")
        return " and ".join(parts) or "blocks only"

    def describe(self) -> str:
        s = self.spec
        return (
            f"pipeline: pp {s.pp}, {s.schedule}, {s.m} micro-batches of {self.micro_batch} sequence(s)"
            + (f", {s.v} stages per rank" if s.v > 1 else "")
            + f"; blocks per rank {list(self.rank_layers)}; heaviest pp rank {self.rank} ({self.holds}, "
            f"{self.in_flight:g} micro-batches in flight) {self.rank_totals[self.rank] / 2**30:.2f} GiB; bubble "
            f"{self.bubble:.1%}, imbalance {self.imbalance:.3f}; p2p {self.p2p_bytes / 2**30:.2f} GiB per device and "
            f"step over {self.link_text} ({self.link_bytes_per_s / 1e9:.1f} GB/s per device), {self.p2p_serial_s:.2f} s serial"
        )


def link_of(target: Target, pp: int) -> tuple[str, float]:
    """("DCN" | "ICI", bytes/s per device) of the slowest stage boundary: the stages span the slices
    when the target has several (pp outermost over the DCN; a device's share of its host's DCN
    bandwidth), else one ICI link. `dcn_hops` counts which boundaries cross."""
    gen = target.generation
    if target.num_slices > 1 and pp > 1 and target.dcn_bytes_per_s_per_host is not None:
        return "DCN", target.dcn_bytes_per_s_per_host / gen.devices_per_host
    return "ICI", ici_bytes_per_s(target)


def ici_bytes_per_s(target: Target) -> float:
    """One ICI link's bytes/s in one direction (`ICI_GBYTES_PER_S_PER_LINK`)."""
    return ICI_GBYTES_PER_S_PER_LINK.get(target.generation.name, 50.0) * 1e9


def dcn_hops(spec: PipelineSpec, *, num_slices: int, dp_replicate: int = 1) -> int:
    """The stage boundaries one micro-batch crosses over the DCN (of `spec.boundaries`), the most over
    the HSDP replicas: the slices split the mesh's outermost axis `pp x dp_replicate` (pp outer) as
    parallelisms/parallel_dims.py `dcn_mesh_shape` does, `gcd(pp x dp_replicate, slices)` ways, the
    rest of the slices going to dp_shard (whose coordinate a permute keeps, so a boundary inside one
    part stays inside each slice); a boundary crosses where its two ranks' parts differ. pp 2 on 2
    slices: 1 (graph mode's ring: 2, every boundary); pp 4 on 2 slices: 1 of 3 (ring: 2 of 4); pp 2
    on 4 slices (each stage spans 2): 1 (ring 2)."""
    p = spec.pp
    if num_slices <= 1 or p <= 1:
        return 0
    outer = p * dp_replicate
    parts = math.gcd(outer, num_slices)
    per_part = outer // parts
    pairs = [(r, r + 1) for r in range(p - 1)] + ([(p - 1, 0)] if spec.uniform else [])
    part = lambda r, q: (r * dp_replicate + q) // per_part  # noqa: E731
    return max(sum(part(a, q) != part(b, q) for a, b in pairs) for q in range(dp_replicate))


def head_block_units(shape: ModelShape, flops_per_token: float | None) -> float | None:
    """The output head's training FLOPs per token (`6 dim vocab`, the loss's own few per logit left
    out) over one block's (the rest of `flops_per_token`, PaLM convention, over the layers): the last
    stage's extra work in block units. None without a FLOPs count. Llama 3 8B at seq 8192: 1.84
    blocks (the 128,256-row head), 70B 1.06, 405B 0.61; the 8-layer debug model of
    scripts/bench/bench_pipeline.py at seq 512: 1.03."""
    per_block = _block_flops(shape, flops_per_token)
    return 6.0 * shape.dim * shape.vocab_size / per_block if per_block else None


def _block_flops(shape: ModelShape, flops_per_token: float | None) -> float | None:
    """One block's training FLOPs per token: `flops_per_token` less the output head's `6 dim vocab`,
    over the layers; None without a FLOPs count or where nothing is left."""
    if not flops_per_token or shape.n_layers <= 0:
        return None
    per_block = (flops_per_token - 6.0 * shape.dim * shape.vocab_size) / shape.n_layers
    return per_block if per_block > 0 else None


def mixing_share(shape: ModelShape, flops_per_token: float | None, seq_len: int) -> float:
    """The attention score and value products' share of a block's training FLOPs (PaLM convention, as
    `model_flops_per_token` counts them: 12 x heads x head_dim x seq per layer and token) over the
    block's whole (`flops_per_token` less the head, over the layers, as `head_block_units`); 0
    without a FLOPs count. The 8-layer debug Llama of scripts/bench/bench_pipeline.py at seq 512:
    0.258; Llama 3 8B at seq 8192: 0.235, 70B 0.136, 405B 0.078."""
    per_block = _block_flops(shape, flops_per_token)
    if not per_block or seq_len <= 0:
        return 0.0
    return min(1.0, 12.0 * shape.n_heads * shape.head_dim * seq_len / per_block)


def zero_bubble_costs(mixing: float) -> tuple[float, float, float]:
    """(f, b, w): a micro-batch's forward, input-gradient (B) and weight-gradient (W) passes through a
    stage, as shares of its training FLOPs, for the zero-bubble schedules' `bubble_fraction`. A matmul
    with weights costs its forward once in B (the input gradient) and once in W (the weight gradient);
    the attention products have no weights, so their backward (twice their forward) is all in B:
    f = 1/3, b = (1 + a) / 3, w = (1 - a) / 3 with `a` their share (`mixing_share`), so
    f + b - 2 w = a and what W cannot fill is (p - 1) a / v per rank: 0 only without attention.
    torch's split backward (torch.distributed.pipelining `stage_backward_input` / `_weight`) splits
    exactly so."""
    a = min(max(mixing, 0.0), 1.0)
    return 1.0 / 3.0, (1.0 + a) / 3.0, (1.0 - a) / 3.0


def two_kind_weights(n_layers: int, n_dense: int, total_of) -> tuple[float, ...] | None:
    """Each layer's share (mean 1) of a total over the blocks of a model of `n_dense` dense blocks
    then MoE blocks (DeepSeek-V3's `n_dense_layers`), from the model's own count at another dense
    count: `total_of(d)` is the total with `d` dense blocks (the FLOPs of `model_flops_per_token`,
    the bytes of the activation model), so a dense block's and an MoE block's (its active experts)
    are the count's own, not a copy of its formula. None for one kind of block."""
    if not 0 < n_dense < n_layers:
        return None
    other = n_dense + 1 if n_dense + 1 < n_layers else n_dense - 1
    if other < 1:
        return None
    total = total_of(n_dense)
    delta = (total_of(other) - total) / (other - n_dense)  # a dense block's minus an MoE block's
    moe = (total - n_dense * delta) / n_layers
    mean = total / n_layers
    if mean <= 0:
        return None
    return tuple((moe + delta if i < n_dense else moe) / mean for i in range(n_layers))


def p2p_transfer_bytes(shape: ModelShape, *, micro_batch: int, seq_len: int, tp: int, cp: int) -> int:
    """One micro-batch's hidden states at a stage boundary, per device: [mb, seq / cp, dim] bf16,
    split by tp (the stage input is a sequence shard under TP)."""
    return 2 * micro_batch * (seq_len // cp) * shape.dim // tp


def pipeline_estimate(
    spec: PipelineSpec,
    *,
    target: Target,
    shape: ModelShape,
    stats: ShardStats,
    parallel_dims,
    local_batch_size: int,
    seq_len: int,
    ac_mode: str,
    loss_parallel: bool,
    grad_accum: int = 1,
    activations_of=None,
    layer_weights: tuple[float, ...] | None = None,
    activation_weights: tuple[float, ...] | None = None,
    **kwargs,
):
    """`planner.memory.estimate` of every pp rank (its stage's stats and activations, one micro-batch
    of `local_batch_size / m` sequences in `activations_of`), the heaviest returned with the batch
    restored and its `PipelineCost`. `activations_of(micro_batch)`: the model's activation bytes of
    one micro-batch through all its layers (None: the decoder-LM model); the blocks' share is scaled
    to each rank's layers (`activation_weights`: each layer's share, mean 1, where the blocks differ:
    `two_kind_weights`), and the MoE terms (`moe_layers`: the capacity rows kept per MoE block) count
    the rank's MoE blocks; a rank of dense blocks only is priced as a dense model (no dispatch
    buffers). `layer_weights`: each layer's FLOPs over the mean block's (the imbalance; None: alike).
    ValueError when m does not divide the local batch (the rule's case)."""
    from planner.activations import activation_bytes
    from planner.memory import estimate

    m = spec.m
    if local_batch_size % m:
        raise ValueError(f"pipeline_microbatches {m} does not divide the local batch {local_batch_size}")
    mb = local_batch_size // m
    tp, cp = parallel_dims.tp, parallel_dims.cp
    whole = activations_of(mb) if activations_of is not None else None
    if whole is None:
        whole = activation_bytes(
            shape,
            local_batch_size=mb,
            seq_len=seq_len,
            tp=tp,
            ac_mode=ac_mode,
            loss_parallel=loss_parallel and tp > 1,
            cp=cp,
        )
    n = shape.n_layers
    layers = spec.rank_layers(n)
    moe_ids = moe_layer_ids(n, kwargs.get("moe_layers")) if shape.is_moe else range(0)
    per_rank = []
    for rank in range(spec.pp):
        ids = spec.rank_layer_ids(n, rank)
        if activation_weights:
            own = dataclasses.replace(whole, blocks=round(whole.blocks * sum(activation_weights[i] for i in ids) / n))
        else:
            own = dataclasses.replace(whole, blocks=whole.blocks * layers[rank] // n)
        moe_held = sum(i in moe_ids for i in ids)
        # a stage of dense blocks only (DeepSeek-V3's first): no experts, no dispatch buffers
        kind = {} if moe_held or not shape.is_moe else dict(num_experts=0, top_k=0, moe_hidden=0)
        # the capacity dispatch's rows kept per MoE block (`planner.memory`), per micro-batch in flight
        rank_kwargs = {**kwargs, "moe_layers": moe_held * spec.in_flight(rank)} if shape.is_moe else kwargs
        per_rank.append(
            estimate(
                target=target,
                shape=dataclasses.replace(shape, n_layers=layers[rank], **kind),
                stats=stage_stats(stats, spec, rank),
                parallel_dims=parallel_dims,
                local_batch_size=mb,
                seq_len=seq_len,
                ac_mode=ac_mode,
                loss_parallel=loss_parallel,
                grad_accum=grad_accum,
                activations=stage_activations(own, spec, rank),
                **rank_kwargs,
            )
        )
    heaviest = max(range(spec.pp), key=lambda r: per_rank[r].total)
    link, bandwidth = link_of(target, spec.pp)
    transfer = p2p_transfer_bytes(shape, micro_batch=mb, seq_len=seq_len, tp=tp, cp=cp)
    cost = PipelineCost(
        spec=spec,
        rank=heaviest,
        rank_layers=tuple(layers),
        rank_totals=tuple(e.total for e in per_rank),
        micro_batch=mb,
        in_flight=spec.in_flight(heaviest),
        imbalance=spec.imbalance(n, head_block_units(shape, kwargs.get("flops_per_token")), layer_weights),
        p2p_bytes=grad_accum * spec.transfers * transfer,
        transfer_bytes=transfer,
        link=link,
        link_bytes_per_s=bandwidth,
        grad_accum=grad_accum,
        dcn_hops=dcn_hops(spec, num_slices=target.num_slices, dp_replicate=parallel_dims.dp_replicate)
        if link == "DCN"
        else 0,
        ici_bytes_per_s=ici_bytes_per_s(target),
        mixing_share=mixing_share(shape, kwargs.get("flops_per_token"), seq_len),
    )
    est = dataclasses.replace(per_rank[heaviest], local_batch_size=local_batch_size, pp=spec.pp, pipeline=cost)
    est.notes.append(cost.describe())
    return est
