"""Plans: estimate one explicit plan, search the plans of a target, suggest what would fit.

`plan_estimate` validates the degrees, shards the real model on a fake world and adds the
activation model; `recommend` searches degrees, AC mode and local batch for a target
(preference order in docs/planner.md, "How --recommend chooses"); `suggest_fixes` says what
would make a plan that does not fit, fit.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.contract import ModelShape
from models.errors import ConfigError
from parallelisms.activation_checkpoint import AC_MODES
from planner.activations import DeltaRuleShape, activation_bytes
from planner.deepseek import is_mla, mla_activation_bytes
from planner.deepseek_v4 import is_deepseek_v4, v4_activation_bytes
from planner.memory import RECOMPUTE_RANK, Estimate, estimate
from planner.shard import fake_process_group, scan_layout, shard_model
from planner.targets import Target

# See planner/targets.py: a torch-only leaf, the FLOP convention the trainer's MFU uses.
from trainer.runtime.flops import model_flops_per_token as model_flops

# The trainer's rule table: the planner never proposes a plan the trainer refuses.
from trainer.step.plan import StepPlan, StepRequest, plan_step, refusals

if TYPE_CHECKING:
    from models import ModelFamily
    from models.contract import ModelArgs
    from parallelisms.parallel_dims import ParallelDims
    from parallelisms.quantize import QuantizePlan

AC_SEARCH_ORDER = tuple(sorted((m for m in AC_MODES if m != "full_save_attention"), key=RECOMPUTE_RANK.__getitem__))
"""The AC modes the search tries, least recompute first. Not full_save_attention: it holds more
than full, so it fits only where full does, and full is what the search then picks (a recipe
chooses it for speed; the planner prices it when a recipe sets it)."""


@dataclass(frozen=True)
class PlanInputs:
    """What a plan needs besides the degrees: the model and the batch."""

    family: ModelFamily
    args: ModelArgs
    model_name: str
    seq_len: int
    """Tokens per sequence; a FLUX sample's text + image tokens."""
    local_batch_size: int
    grad_accum: int = 1
    flow_tokens: tuple[int, int] | None = None
    """FLUX (task flow): (image tokens, text tokens) per sample; None for a decoder LM."""
    step: StepRequest | None = None
    """The recipe's step settings (mode, scan, loss...; trainer/step/plan.py): a plan whose
    degrees and AC mode the step plan's rules refuse is refused (`plan_estimate`) or skipped
    (`recommend`). None: no mode rules (an eager step)."""
    quantize: QuantizePlan | None = None
    """The recipe's `[quantize]` (None: no low-precision linears)."""

    @property
    def muon_exclude(self) -> tuple[str, ...] | None:
        """The recipe's `[optimizer] muon_exclude` (None: the optimizer's default)."""
        return None if self.step is None else self.step.muon_exclude

    def _request(
        self,
        *,
        tp: int,
        ac_mode: str,
        target: Target,
        dp_replicate: int | None = None,
        pp: int | None = None,
        local_batch: int = 0,
        pp_microbatches: int | None = None,
        cp: int | None = None,
        ep: int | None = None,
    ) -> StepRequest:
        # several slices (`v6e-256x2`): the slice rule reads the count and the replicate degree
        slices = {"num_slices": target.num_slices}
        if dp_replicate is not None:
            slices["dp_replicate"] = dp_replicate
        # the pipeline rules read the degree, the layers and the local batch (None: the recipe's)
        pipe = dict(n_layers=getattr(self.args, "n_layers", 0), local_batch=local_batch)
        if pp is not None:
            pipe["pp_degree"] = pp
        if pp_microbatches is not None:
            pipe["pp_microbatches"] = pp_microbatches
        # the plan's own cp and ep degrees (None: the recipe's), which the pipeline rules read
        if cp is not None:
            pipe["cp_degree"] = cp
        if ep is not None:
            pipe["ep_degree"] = ep
        return dataclasses.replace(
            self.step, tp_degree=tp, ac_mode=ac_mode, device_type=target.device_type, **slices, **pipe
        )

    def refusals(self, *, tp: int, ac_mode: str, target: Target, dp_replicate: int | None = None, **pipe) -> list[str]:
        """What the trainer's rules refuse in this plan (empty: it would start). `pipe`: `pp`,
        `local_batch`, `pp_microbatches`, `cp`, `ep` of a pipeline layout (default: the recipe's)."""
        if self.step is None:
            return []
        return refusals(self._request(tp=tp, ac_mode=ac_mode, target=target, dp_replicate=dp_replicate, **pipe))

    def step_plan(
        self, *, tp: int, ac_mode: str, target: Target, dp_replicate: int | None = None, **pipe
    ) -> StepPlan | None:
        """The trainer's step plan for this layout on `target` (None without step settings)."""
        if self.step is None:
            return None
        return plan_step(self._request(tp=tp, ac_mode=ac_mode, target=target, dp_replicate=dp_replicate, **pipe))

    def pipeline(self, pp: int | None = None, *, microbatches: int | None = None):
        """The `PipelineSpec` of this plan: the recipe's `[parallelism] pipeline_*` (degree `pp`
        and `microbatches` when given), or a 1F1B pipeline without step settings."""
        from planner.pipeline import PipelineSpec, spec_of

        spec = spec_of(self.step) if self.step is not None else PipelineSpec(pp=1)
        return dataclasses.replace(
            spec,
            pp=spec.pp if pp is None else pp,
            microbatches=spec.microbatches if microbatches is None else microbatches,
        )

    def flops_per_token(self, shape: ModelShape) -> float:
        if self.flow_tokens is not None:
            from planner.flux import flux_flops_per_token

            img, txt = self.flow_tokens
            return flux_flops_per_token(self.args, img_tokens=img, txt_tokens=txt)
        return model_flops_per_token(self.args, shape, self.seq_len)

    def activations(self, *, local_batch_size: int, tp: int, ac_mode: str, cp: int = 1):
        """FLUX's and DeepSeek-V3's (MLA, two stacks) activation bytes, Qwen 3.5's (its Gated DeltaNet
        blocks' own bytes, and with cp > 1 the cp delta rule's, `planner.activations.cp_delta_rule_bytes`);
        None (the decoder-LM model in `estimate`) for a GQA decoder LM."""
        if self.flow_tokens is None:
            if is_mla(self.args):
                return mla_activation_bytes(
                    self.args, local_batch_size=local_batch_size, seq_len=self.seq_len, tp=tp, ac_mode=ac_mode, cp=cp
                )
            if is_deepseek_v4(self.args):  # the hyper-connected streams, compressors, masked SDPA
                return v4_activation_bytes(
                    self.args, local_batch_size=local_batch_size, seq_len=self.seq_len, tp=tp, ac_mode=ac_mode, cp=cp
                )
            delta = DeltaRuleShape.of(self.args)
            if delta is not None:  # Qwen 3.5's Gated DeltaNet blocks (and the cp delta rule with cp > 1)
                return activation_bytes(
                    self.args.shape(),
                    local_batch_size=local_batch_size,
                    seq_len=self.seq_len,
                    tp=tp,
                    ac_mode=ac_mode,
                    loss_parallel=False,  # (the family has no TP plan: tp = 1)
                    cp=cp,
                    delta=delta,
                    mtp_depth=getattr(self.args, "mtp_depth", 0),  # Qwen 3.5's MTP module
                )
            return None
        from planner.flux import flux_activation_bytes

        img, txt = self.flow_tokens
        return flux_activation_bytes(
            self.args, img_tokens=img, txt_tokens=txt, local_batch_size=local_batch_size, tp=tp, ac_mode=ac_mode
        )

    @property
    def split_seq_len(self) -> int:
        """The length tensor parallelism splits (sequence parallel); 0: FLUX's plan splits none."""
        return 0 if self.flow_tokens is not None else self.seq_len


def model_flops_per_token(args: ModelArgs, shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs per token, PaLM convention (trainer/runtime/flops.py `model_flops_per_token`)."""
    return model_flops(args, seq_len)["palm"]


def make_parallel_dims(
    *,
    dp_replicate: int,
    dp_shard: int,
    tp: int,
    ep: int,
    world_size: int,
    shape: ModelShape,
    seq_len: int,
    cp: int = 1,
    num_slices: int = 1,
    pp: int = 1,
) -> ParallelDims:
    """Validated `ParallelDims` (ConfigError naming the key if the degrees cannot work). With
    pp > 1 over several slices the stages take the slices (`pp` outermost): the data-parallel
    ranks span `num_slices / pp` of them."""
    from parallelisms.parallel_dims import ParallelDims

    dims = ParallelDims(
        dp_replicate=dp_replicate,
        dp_shard=dp_shard,
        cp=cp,
        tp=tp,
        ep=ep,
        pp=pp,
        num_slices=max(1, num_slices // pp),
        world_size=world_size,
    )
    dims.validate_for_model(shape, seq_len=seq_len)
    return dims


def tpu_layout(target: Target, dims: ParallelDims) -> list[str]:
    """The notes of torch-tpu's layout of `dims` on a TPU target (parallelisms/tpu_topology.py:
    the split axes and their cost; empty when every axis takes whole physical axes, off a TPU, or
    for a slice without a known grid); ConfigError when torch-tpu could not lay the mesh out."""
    from parallelisms.tpu_topology import map_mesh, topology_of

    topology = topology_of(target) if target.device_type == "tpu" else None
    if topology is None or topology.devices != dims.world_size:
        return []
    if dims.pp > 1:
        return [f"pp {dims.pp}: the stages' place on the slice is not modelled (the stage mesh is)"]
    layout = map_mesh(topology, dims.mesh_shape)
    return [f"mesh {layout.summary()}: {note}" for note in layout.notes()]


def plan_estimate(
    inputs: PlanInputs,
    target: Target,
    *,
    dp_replicate: int = 1,
    dp_shard: int = -1,
    tp: int = 1,
    ep: int = 1,
    ac_mode: str = "none",
    loss_parallel: bool = False,
    headroom: float = 0.1,
    assumed_mfu: float = 0.4,
    probe: bool = False,
    cp: int = 1,
    pp: int | None = None,
    check_rules: bool = True,
) -> Estimate:
    """Estimate one explicit plan: validate (degrees, and the trainer's step rules), shard the
    real model on a fake world, add activations. `pp`: the pipeline degree (None: the recipe's,
    `inputs.step`; its schedule and micro-batches are the recipe's: planner/pipeline.py).
    `check_rules=False` prices a plan the rules refuse today (the recipe check's figures for a
    pipeline recipe on TPU, which waits for graph-mode PP); never a plan to run."""
    spec = inputs.pipeline(pp)
    # 1. The rules (or, unchecked, what they refuse), and the step plan they give.
    request = dict(
        tp=tp,
        ac_mode=ac_mode,
        target=target,
        dp_replicate=dp_replicate,
        pp=spec.pp,
        local_batch=inputs.local_batch_size,
        **(dict(cp=cp, ep=ep) if spec.pp > 1 else {}),  # the pipeline rules read the plan's cp and ep
    )
    refused, step = _checked_step(inputs, request, cp=cp, check_rules=check_rules)
    # 2. The degrees on the target's world, torch-tpu's layout, the real model sharded on a fake world.
    shape = inputs.args.shape()
    dims = _dims(inputs, target, shape, dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, ep=ep, cp=cp, pp=spec.pp)
    layout_notes = tpu_layout(target, dims)  # ConfigError where torch-tpu could not build the mesh
    with fake_process_group(target.devices):
        stats = shard_model(inputs.family, inputs.args, dims, probe=probe, muon_exclude=inputs.muon_exclude)
    # 3. Priced: the heaviest pp rank of a pipeline, else the one plan.
    priced = _Priced(shape=shape, stats=stats, dims=dims, step=step, ac_mode=ac_mode, loss_parallel=loss_parallel)
    kw = dict(local_batch_size=inputs.local_batch_size, headroom=headroom, assumed_mfu=assumed_mfu)
    if spec.pp > 1:
        est = _pipeline_candidate(inputs, target, spec, priced, **kw)
        est.notes.extend(layout_notes)
        est.notes.extend(f"refused by the trainer's rules today: {line}" for line in refused)
        return est
    est = _candidate(
        inputs, target, priced, flops_per_token=inputs.flops_per_token(shape), grad_accum=inputs.grad_accum, **kw
    )
    est.notes.extend(layout_notes)
    return est


def _checked_step(
    inputs: PlanInputs, request: dict, *, cp: int, check_rules: bool
) -> tuple[list[str], StepPlan | None]:
    """(what the trainer's rules refuse, the step plan) of one plan: ConfigError for the first
    refusal (unless `check_rules=False`) and for CP on FLUX, which the planner does not model."""
    refused = inputs.refusals(**request)
    if refused and check_rules:
        raise ConfigError(refused[0])
    if cp > 1 and inputs.flow_tokens is not None:
        raise ConfigError(
            f"parallelism.context_parallel_degree: {cp}: the planner models context parallelism "
            "for decoder LMs only (FLUX's joint text + image sequence has no CP plan); allowed: 1"
        )
    return refused, _step_plan_or_stage(inputs, refused, **request)


def _step_plan_or_stage(inputs: PlanInputs, refused: list[str], *, pp: int, **request) -> StepPlan | None:
    """The step plan of a plan; for a pipeline plan the rules refuse (`check_rules=False`), the
    step plan its stages would have without the pipeline (the same memory terms: scan, fused
    loss, the update), None when that is refused too."""
    if not refused:
        return inputs.step_plan(pp=pp, **request)
    # the stage's own step: no pipeline, on one slice (the stages take the slices)
    stage = {**request, "target": dataclasses.replace(request["target"], num_slices=1)}
    if pp > 1 and not inputs.refusals(pp=1, **stage):
        return inputs.step_plan(pp=1, **stage)
    return None


@dataclass(frozen=True)
class _Priced:
    """What every candidate is priced from: the model's shape, its shards, the degrees, the step
    plan (None: the rules refuse it and no stage plan stands in) and the memory choices."""

    shape: ModelShape
    stats: Any
    dims: ParallelDims
    step: StepPlan | None
    ac_mode: str
    loss_parallel: bool

    def common(self, inputs: PlanInputs, target: Target, *, local_batch_size: int, **kw) -> dict:
        """The arguments `planner.memory.estimate` and `planner.pipeline.pipeline_estimate` share."""
        return dict(
            model=inputs.model_name,
            target=target,
            shape=self.shape,
            stats=self.stats,
            parallel_dims=self.dims,
            local_batch_size=local_batch_size,
            seq_len=inputs.seq_len,
            ac_mode=self.ac_mode,
            loss_parallel=self.loss_parallel,
            **kw,
            **_step_terms(self.step, inputs),
        )

    def activations(self, inputs: PlanInputs, local_batch_size: int):
        return inputs.activations(
            local_batch_size=local_batch_size, tp=self.dims.tp, ac_mode=self.ac_mode, cp=self.dims.cp
        )


def _candidate(inputs: PlanInputs, target: Target, priced: _Priced, *, local_batch_size: int, **kw) -> Estimate:
    """One plan without a pipeline priced (`planner.memory.estimate`); `kw`: headroom, assumed
    MFU, FLOPs per token and (`plan_estimate`) the recipe's gradient accumulation."""
    return estimate(
        **priced.common(inputs, target, local_batch_size=local_batch_size, **kw),
        activations=priced.activations(inputs, local_batch_size),
    )


def _pipeline_candidate(
    inputs: PlanInputs,
    target: Target,
    spec,
    priced: _Priced,
    *,
    local_batch_size: int,
    headroom: float,
    assumed_mfu: float,
) -> Estimate:
    """One pipeline plan's estimate (`planner.pipeline.pipeline_estimate`: the heaviest pp rank). A
    model of dense blocks then MoE blocks (DeepSeek-V3's `n_dense_layers`) weighs each layer by its
    own FLOPs and activation bytes (`two_kind_weights` over the model's own counts)."""
    from planner.pipeline import pipeline_estimate, two_kind_weights

    args, n = inputs.args, priced.shape.n_layers
    n_dense = getattr(args, "n_dense_layers", 0) if priced.shape.is_moe and inputs.flow_tokens is None else 0
    at = lambda d: dataclasses.replace(args, n_dense_layers=d)  # noqa: E731  (the model with d dense blocks)
    head = 6.0 * priced.shape.dim * priced.shape.vocab_size  # (`head_block_units`' head)
    layer_weights = two_kind_weights(n, n_dense, lambda d: model_flops(at(d), inputs.seq_len)["palm"] - head)
    mb = local_batch_size // spec.m if spec.m and local_batch_size % spec.m == 0 else 1
    kind_acts = lambda d: dataclasses.replace(inputs, args=at(d)).activations(  # noqa: E731
        local_batch_size=mb, tp=priced.dims.tp, ac_mode=priced.ac_mode, cp=priced.dims.cp
    )
    activation_weights = two_kind_weights(n, n_dense, lambda d: kind_acts(d).blocks) if is_mla(args) else None
    est = pipeline_estimate(
        spec,
        **priced.common(
            inputs,
            target,
            local_batch_size=local_batch_size,
            grad_accum=inputs.grad_accum,
            headroom=headroom,
            assumed_mfu=assumed_mfu,
            flops_per_token=inputs.flops_per_token(priced.shape),
        ),
        activations_of=lambda mb: priced.activations(inputs, mb),
        layer_weights=layer_weights,
        activation_weights=activation_weights,
    )
    if target.num_slices > 1 and not (inputs.step is not None and inputs.step.allow_dcn_sharding):
        est.notes.append(
            "a pipeline over the slices: FSDP across the slices ([parallelism] allow_dcn_sharding = true, "
            "MaxText's layout) holds the same state per device without the bubble, and wherever it fits the planner "
            "finds it faster on every multislice target at a 4M-16M-token batch (docs/pipeline_parallel.md, "
            "'Where PP wins'); --recommend searches it when the recipe allows it"
        )
    return est


def _step_terms(step: StepPlan | None, inputs: PlanInputs) -> dict:
    """The memory terms a step plan and the recipe's optimizer switch on (`planner.memory.estimate`)."""
    return dict(
        fused_loss=bool(step and step.fused_loss),
        scan_flips=bool(step and step.scan_flips),
        undonated_update=bool(step and step.undonated_update),
        stacked=bool(step and step.scan),
        scan_layout=scan_layout(inputs.args) if step and step.scan else None,
        offload=step.scan_offload if step else "none",
        optimizer=inputs.step.optimizer if inputs.step is not None else "adamw",
        moe_capacity_factor=inputs.step.moe_capacity_factor if inputs.step is not None else 0.0,
        quantize=inputs.quantize,
        moe_layers=getattr(inputs.args, "n_layers", 0) - getattr(inputs.args, "n_dense_layers", 0),
    )


def _powers_of_two_dividing(n: int, limit: int) -> list[int]:
    return [v for v in (2**i for i in range(0, 31)) if v <= limit and n % v == 0]


def preference_key(est: Estimate, pp_rank: int | None = None) -> tuple:
    """Smaller is better; documented in docs/planner.md ("How --recommend chooses").

    1. micro-batches big enough to hide FSDP's all-gathers on this generation;
    2. no pipeline (the smallest PP degree): PP only where nothing without it fits, since its
       bubble and point-to-point transfers are lost time at equal memory; on several slices
       `pp_rank` replaces the degree (`recommend`: 0 for a pipeline that beats the best plan
       without one by `PP_WIN_MARGIN` in tokens/s with the DCN priced, 1 for no pipeline, 2 for a
       pipeline that does not);
    3. the smallest TP degree (TP puts activation collectives on every layer's critical path,
       FSDP's weight gathers overlap with compute): pure FSDP first, then add TP;
    4. the smallest CP degree (CP all-gathers k/v on every layer: with GQA a fraction of TP's
       activation traffic, so CP is added before TP, but only when the sequence needs it);
    5. the least recompute: none, then selective, then full;
    6. the most tokens per device per step (amortizes the per-step FSDP traffic);
    7. MoE: the largest expert-parallel degree (each rank gathers num_experts / ep experts per
       layer; the dispatch's all-to-all moves tokens x top-k rows whatever the degree);
    8. the fewest replicas (HSDP only when it costs nothing else).
    """
    return (
        est.fsdp_bound,
        est.pp if pp_rank is None else pp_rank,
        est.tp,
        est.cp,
        RECOMPUTE_RANK[est.ac_mode],
        -est.tokens_per_device_step,
        -est.ep,
        est.dp_replicate,
    )


def search_key(est: Estimate, max_global_tokens: int, pp_rank: int | None = None) -> tuple:
    """`recommend`'s order: first the plans whose global batch stays within `max_global_tokens`
    (one sequence per data-parallel rank can exceed it: 128k tokens x 256 ranks is 32M; context
    or tensor parallelism puts several devices on one sequence and brings it back), then
    `preference_key`."""
    return (est.global_batch_tokens > max_global_tokens, *preference_key(est, pp_rank))


PP_WIN_MARGIN = 0.05
"""On several slices a pipeline plan comes first only where its tokens/s per device, the DCN priced
(`planner.multislice.priced_tokens_per_s`), beat the best plan without a pipeline's by this share:
the planner's time model is an estimate at an assumed MFU, and a pipeline costs a recipe more
(stage split, micro-batches, graph mode's T iterations of activations)."""


def pp_ranks(candidates: list[Estimate], max_global_tokens: int) -> dict[int, int]:
    """`preference_key`'s `pp_rank` of each candidate on a multislice target (by `id`): the
    pipelines that beat the best fitting plan without one (the most tokens/s per device with the
    DCN priced: its HSDP all-reduce, or its FSDP gathers and reduce-scatters across the slices) by
    `PP_WIN_MARGIN` rank 0, the plans without a pipeline 1, the other pipelines 2. Where no plan
    without a pipeline fits within `max_global_tokens`, every fitting pipeline ranks 0."""
    from planner.multislice import priced_tokens_per_s

    flat = [
        priced_tokens_per_s(c)
        for c in candidates
        if c.fits and c.pp == 1 and c.global_batch_tokens <= max_global_tokens
    ]
    best = max(flat, default=0.0)
    return {
        id(c): 1 if c.pp == 1 else (0 if c.fits and priced_tokens_per_s(c) > best * (1 + PP_WIN_MARGIN) else 2)
        for c in candidates
    }


def recommend(
    inputs: PlanInputs,
    target: Target,
    *,
    headroom: float = 0.1,
    assumed_mfu: float = 0.4,
    max_global_tokens: int = 16 * 2**20,
    max_local_batch: int = 64,
    tp_choices: list[int] | None = None,
    ac_modes: tuple[str, ...] = AC_SEARCH_ORDER,
    dp_replicate_choices: list[int] | None = None,
    cp_choices: list[int] | None = None,
    max_cp: int = 16,
    ep_choices: list[int] | None = None,
    max_ep: int = 64,
    pp_choices: list[int] | None = None,
    max_pp: int = 8,
) -> list[Estimate]:
    """Search dp_replicate, tp (<= devices per host), cp, ep, AC mode and local batch for `target`.

    MoE models: expert-parallel degrees are powers of two up to `max_ep` that divide the experts
    (`ep_choices` overrides; dense models: 1). DeepSeek-V3 (MLA): cp = 1 only (`planner.deepseek`).

    Returns every candidate evaluated (fitting or not), best first by `preference_key` among
    those that fit; a layout the trainer's rules refuse (`PlanInputs.step`) is not evaluated. Shard sizes come from the real plan applied to a one-block copy (exact:
    blocks are identical); `plan_estimate(..., probe=False)` re-checks a choice on the full model.
    CP degrees (powers of two up to `max_cp` with `seq_len % (2 cp tp) == 0`; decoder LMs only)
    are searched in increasing order, and a larger one only while no plan of a smaller one fits
    at the smallest tp with its FSDP gathers hidden: `preference_key` would rank such a plan
    first anyway, so the search is exact and costs nothing extra for sequences that fit.
    Pipeline degrees (`pp_choices`, default powers of two up to `max_pp` dividing the world, on
    several slices multiples of the slice count: the stages take the slices) are searched the same
    way, after pp = 1 and only while no plan without PP fits with its gathers hidden (on one
    slice), and only when the trainer's rules allow a pipeline for this model on this target
    (`PlanInputs.step`; none without step settings). A pipeline candidate takes the recipe's
    schedule and micro-batches (0: one sequence per micro-batch); its batch and micro-batches pass
    the rules. On several slices every pipeline degree is searched, the layouts without a pipeline
    are HSDP (and, where the recipe sets `[parallelism] allow_dcn_sharding`, FSDP across the
    slices: any replicate degree), and a pipeline comes first only where it beats the best of those
    with the DCN priced (`pp_ranks`, docs/pipeline_parallel.md "Where PP wins").
    """
    shape = inputs.args.shape()
    world = target.devices
    tps = tp_choices or _powers_of_two_dividing(world, target.generation.devices_per_host)
    if inputs.flow_tokens is not None or is_mla(inputs.args) or is_deepseek_v4(inputs.args):
        cps = [1]
    else:
        cps = cp_choices or _powers_of_two_dividing(world, max_cp)
    eps = ep_choices or (_powers_of_two_dividing(shape.num_experts, max_ep) if shape.is_moe else [1])
    search = dict(
        fpt=inputs.flops_per_token(shape),
        ac_modes=ac_modes,
        headroom=headroom,
        assumed_mfu=assumed_mfu,
        max_global_tokens=max_global_tokens,
        max_local_batch=max_local_batch,
    )
    candidates: list[Estimate] = []
    multislice = target.num_slices > 1
    for pp in pp_choices or _pipeline_degrees(inputs, target, max_pp):
        if (
            pp > 1
            and not multislice
            and any(
                c.fits and not c.fsdp_bound and c.pp < pp and c.global_batch_tokens <= max_global_tokens
                for c in candidates
            )
        ):
            break  # a plan with less pipelining fits: no plan with this pp can come first (`search_key`)
        candidates += _search_pp(
            inputs, target, shape, pp=pp, tps=tps, cps=cps, eps=eps, dp_replicate_choices=dp_replicate_choices, **search
        )
    # several slices: a pipeline comes first only where it wins with the DCN priced (`pp_ranks`)
    ranks = pp_ranks(candidates, max_global_tokens) if multislice else {}
    fitting = sorted(
        (c for c in candidates if c.fits), key=lambda c: search_key(c, max_global_tokens, ranks.get(id(c)))
    )
    rest = sorted((c for c in candidates if not c.fits), key=lambda c: c.total)
    return fitting + rest


def _pipeline_degrees(inputs: PlanInputs, target: Target, max_pp: int) -> list[int]:
    """`recommend`'s default pipeline degrees: 1, and the powers of two up to `max_pp` that divide
    the world (on several slices: multiples of the slice count) when the rules allow a pipeline for
    this model on this target at all (checked at pp 2 with the batch not yet chosen, in the AC modes
    the search tries: until 2026-12-07 at AC none only, which refused every recipe that offloads its
    block inputs, the pending 405B PP recipe's included)."""
    ask = dict(tp=1, target=target, pp=2, pp_microbatches=0)
    # in any AC mode the search tries (a recipe that offloads the block inputs needs full AC)
    if inputs.step is None or all(inputs.refusals(ac_mode=m, **ask) for m in AC_SEARCH_ORDER):
        return [1]
    s = target.num_slices
    return [1] + [p for p in _powers_of_two_dividing(target.devices, max_pp) if p > 1 and p % s == 0]


def _pp_refuses(inputs: PlanInputs, target: Target, *, pp: int, cp: int = 1, ep: int = 1) -> bool:
    """The rules refuse this cp or ep degree with PP where they take it at 1 (graph mode's CP and EP
    rules; checked at tp 1 with the batch not yet chosen, like `_pipeline_degrees`)."""
    ask = dict(tp=1, ac_mode="none", target=target, pp=pp, pp_microbatches=0)
    return len(inputs.refusals(**ask, cp=cp, ep=ep)) > len(inputs.refusals(**ask, cp=1, ep=1))


def _search_pp(
    inputs: PlanInputs,
    target: Target,
    shape: ModelShape,
    *,
    pp: int,
    tps: list[int],
    cps: list[int],
    eps: list[int],
    dp_replicate_choices: list[int] | None,
    max_global_tokens: int,
    **search,
) -> list[Estimate]:
    """`recommend`'s candidates at one pipeline degree (its docstring)."""
    world = target.devices
    stage = world // pp
    replicas_span = max(1, target.num_slices // pp)  # slices the data-parallel ranks span
    # FSDP across the slices (MaxText's dcn_fsdp) where the recipe allows it: any replicate degree;
    # else HSDP, one replica group per slice at least
    dcn_sharding = inputs.step is not None and inputs.step.allow_dcn_sharding
    if pp > 1:  # the cp and ep degrees the pipeline rules take with PP (eager: all; graph mode: 1)
        cps = [c for c in cps if c == 1 or not _pp_refuses(inputs, target, pp=pp, cp=c)] or [1]
        eps = [e for e in eps if e == 1 or not _pp_refuses(inputs, target, pp=pp, ep=e)] or [1]
    candidates: list[Estimate] = []
    with fake_process_group(world):
        for tp, cp in ((tp, cp) for cp in cps for tp in tps if stage % (tp * cp) == 0):
            if (
                cp > 1
                and tp == tps[0]
                and any(
                    c.fits and not c.fsdp_bound and c.tp == tps[0] and c.global_batch_tokens <= max_global_tokens
                    for c in candidates
                )
            ):
                # A smaller cp already fits at the smallest tp, within the global batch, without
                # exposed FSDP traffic: no plan with this cp can come first (`search_key`).
                break
            for dp_replicate, ep in (
                (r, e)
                for e in eps
                for r in dp_replicate_choices or _powers_of_two_dividing(stage // (tp * cp), stage // (tp * cp))
                if r % replicas_span == 0 or dcn_sharding
            ):
                candidates += _layout_candidates(
                    inputs,
                    target,
                    shape,
                    tp=tp,
                    cp=cp,
                    ep=ep,
                    dp_replicate=dp_replicate,
                    pp=pp,
                    max_global_tokens=max_global_tokens,
                    **search,
                )
    if target.num_slices > 1:
        _note_dcn(candidates, target)
    return candidates


def _note_dcn(candidates: list[Estimate], target: Target) -> None:
    """Each multislice candidate's DCN line (`planner.multislice.describe`), and where FSDP spans
    the slices the recipe key that allows it."""
    from planner.multislice import dcn_cost, dcn_split, describe

    for c in candidates:
        cost = dcn_cost(c, target)
        if cost is None:
            continue
        c.notes.append(describe(cost))
        shard_slices = dcn_split(c, target)[1]
        if shard_slices > 1:
            c.notes.append(
                f"dp_shard spans {shard_slices} slices (FSDP over the DCN, MaxText's dcn_fsdp): the recipe needs "
                "[parallelism] allow_dcn_sharding = true"
            )


def _layout_candidates(
    inputs: PlanInputs,
    target: Target,
    shape: ModelShape,
    *,
    tp: int,
    cp: int,
    ep: int,
    dp_replicate: int,
    fpt: float,
    ac_modes: tuple[str, ...],
    pp: int = 1,
    headroom: float,
    assumed_mfu: float,
    max_global_tokens: int,
    max_local_batch: int,
) -> list[Estimate]:
    """`recommend`'s candidates of one mesh layout: every AC mode the trainer allows times every
    local batch (powers of two up to `max_local_batch`, within `max_global_tokens` but for one
    sequence); none where the degrees do not divide the model or torch-tpu could not lay the mesh
    out on the target's slice."""
    laid_out = _laid_out(inputs, target, shape, tp=tp, cp=cp, ep=ep, dp_replicate=dp_replicate, pp=pp)
    if laid_out is None:
        return []
    dims, layout_notes = laid_out
    # the rules read this candidate's own cp and ep (e.g. a family without a CP plan refuses cp > 1)
    own = dict(tp=tp, target=target, dp_replicate=dp_replicate, pp=1, cp=cp, ep=ep)
    if pp == 1 and all(inputs.refusals(ac_mode=m, **own) for m in ac_modes):
        return []  # the trainer refuses the layout in every AC mode (e.g. tp > 1 for a family without
        # a TP plan, whose one-block probe below would raise the TP build's own error)
    stats = shard_model(inputs.family, inputs.args, dims, probe=True, muon_exclude=inputs.muon_exclude)
    batches = [
        b
        for b in (2**i for i in range(0, 12))
        if b <= max_local_batch and (b == 1 or b * inputs.seq_len * dims.dp_degree <= max_global_tokens)
    ]
    candidates = []
    if pp > 1:
        return _pipeline_layout_candidates(
            inputs,
            target,
            shape,
            stats,
            dims,
            batches=batches,
            ac_modes=ac_modes,
            notes=layout_notes,
            headroom=headroom,
            assumed_mfu=assumed_mfu,
        )
    for ac_mode in ac_modes:
        if inputs.refusals(ac_mode=ac_mode, **own):
            continue  # the trainer would refuse it (e.g. layer scan with tp > 1)
        step = inputs.step_plan(ac_mode=ac_mode, **own)
        priced = _Priced(shape, stats, dims, step, ac_mode=ac_mode, loss_parallel=tp > 1 and inputs.flow_tokens is None)
        for batch in batches:
            candidates.append(
                _candidate(
                    inputs,
                    target,
                    priced,
                    local_batch_size=batch,
                    flops_per_token=fpt,
                    headroom=headroom,
                    assumed_mfu=assumed_mfu,
                )
            )
            candidates[-1].notes.extend(layout_notes)
    return candidates


def _laid_out(
    inputs: PlanInputs, target: Target, shape: ModelShape, *, tp: int, cp: int, ep: int, dp_replicate: int, pp: int
) -> tuple[ParallelDims, list[str]] | None:
    """The degrees of one mesh layout (FSDP takes the rest of the world) and torch-tpu's layout
    notes; None where they do not divide the model or torch-tpu could not lay the mesh out."""
    try:
        dims = _dims(inputs, target, shape, dp_replicate=dp_replicate, dp_shard=-1, tp=tp, ep=ep, cp=cp, pp=pp)
        return dims, tpu_layout(target, dims)
    except ConfigError:
        return None  # this tp / cp does not divide the model's heads / hidden sizes / seq_len, or
        # torch-tpu could not lay the mesh out on the target's slice


def _dims(inputs: PlanInputs, target: Target, shape: ModelShape, **degrees: int) -> ParallelDims:
    """`make_parallel_dims` of these degrees on the target's world, slices and the model's
    (split) sequence; ConfigError for degrees that do not divide the world or the model."""
    return make_parallel_dims(
        **degrees,
        world_size=target.devices,
        shape=shape,
        seq_len=inputs.split_seq_len,
        num_slices=target.num_slices,
    )


def _pipeline_layout_candidates(
    inputs: PlanInputs,
    target: Target,
    shape: ModelShape,
    stats,
    dims: ParallelDims,
    *,
    batches: list[int],
    ac_modes: tuple[str, ...],
    notes: list[str],
    headroom: float,
    assumed_mfu: float,
) -> list[Estimate]:
    """`_layout_candidates` with pp > 1: the recipe's schedule and micro-batches (0: one sequence
    per micro-batch), every (AC mode, local batch) the rules allow."""
    candidates = []
    for ac_mode in ac_modes:
        for batch in batches:
            spec = inputs.pipeline(dims.pp)
            if not spec.microbatches:
                spec = dataclasses.replace(spec, microbatches=batch)
            pipe = dict(pp=dims.pp, local_batch=batch, pp_microbatches=spec.microbatches)
            request = dict(
                tp=dims.tp,
                ac_mode=ac_mode,
                target=target,
                dp_replicate=dims.dp_replicate,
                cp=dims.cp,
                ep=dims.ep,
                **pipe,
            )
            if inputs.refusals(**request):
                continue  # the trainer would refuse it (the micro-batches, the stage count, ...)
            loss_parallel = dims.tp > 1 and inputs.flow_tokens is None
            priced = _Priced(
                shape, stats, dims, inputs.step_plan(**request), ac_mode=ac_mode, loss_parallel=loss_parallel
            )
            est = _pipeline_candidate(
                dataclasses.replace(inputs, local_batch_size=batch),
                target,
                spec,
                priced,
                local_batch_size=batch,
                headroom=headroom,
                assumed_mfu=assumed_mfu,
            )
            est.notes.extend(notes)
            candidates.append(est)
    return candidates


@dataclass(frozen=True)
class Fixes:
    """What would make a plan that does not fit, fit (`suggest_fixes`)."""

    single_changes: list[Estimate]
    """Fitting plans that differ in one of AC mode, local batch, TP, CP and EP degree (or only
    turn on loss parallel), best first."""
    best: Estimate | None
    """`recommend`'s choice for the target; None when no plan fits it."""
    devices_needed: int = 0
    """When no plan fits: about how many devices would fit `devices_needed_plan`; 0 when more
    devices would not help (activations alone exceed HBM) or when some plan fits."""
    devices_needed_plan: Estimate | None = None


def suggest_fixes(inputs: PlanInputs, est: Estimate, *, limit: int = 4) -> Fixes:
    """For a plan that does not fit: single changes that would fit, then the best plan overall.

    Tries the other AC modes, smaller local batches, larger TP (up to a host) with loss
    parallel, CP degrees (decoder LMs), and loss parallel alone; then runs `recommend` for the target.
    """
    target = est.target
    kw = dict(headroom=est.headroom, assumed_mfu=est.assumed_mfu)
    host = target.generation.devices_per_host
    tps = sorted({est.tp, *(t for t in (2 * est.tp, 4 * est.tp) if t <= host)})
    near = recommend(
        dataclasses.replace(inputs, local_batch_size=est.local_batch_size),
        target,
        tp_choices=tps,
        dp_replicate_choices=[est.dp_replicate],
        max_local_batch=est.local_batch_size,
        **kw,
    )
    single: list[Estimate] = []
    for c in near:
        if not c.fits or len(single) >= limit:
            continue
        changed = [
            c.ac_mode != est.ac_mode,
            c.local_batch_size != est.local_batch_size,
            c.tp != est.tp,
            c.cp != est.cp,
            c.ep != est.ep,
        ]
        if sum(changed) == 1 or (sum(changed) == 0 and c.loss_parallel != est.loss_parallel):
            single.append(c)
    everything = recommend(inputs, target, **kw)
    if everything and everything[0].fits:
        return Fixes(single_changes=single, best=everything[0])
    needs = [(n, preference_key(c), c) for c in everything if (n := devices_needed(c))]
    if not needs:
        return Fixes(single_changes=single, best=None)
    n, _, c = min(needs, key=lambda x: x[:2])
    return Fixes(single_changes=single, best=None, devices_needed=n, devices_needed_plan=c)


def best_per_layout(estimates: list[Estimate]) -> list[Estimate]:
    """The first (best) estimate of each (tp, ep, AC mode), in the given order."""
    seen, out = set(), []
    for est in estimates:
        key = (est.tp, est.ep, est.ac_mode)
        if key not in seen:
            seen.add(key)
            out.append(est)
    return out


def devices_needed(est: Estimate) -> int:
    """Smallest power-of-two device count at which this plan's memory would fit.

    Parameters, gradients and optimizer state shrink with the number of dp shards; activations
    and the gathered bf16 weights per device do not.
    """
    sharded = est.params + est.grads + est.optimizer
    fixed = est.total - sharded
    if fixed >= est.usable:
        return 0  # activations alone do not fit: more devices do not help
    need = sharded * est.target.devices / (est.usable - fixed)
    return 2 ** math.ceil(math.log2(max(need, 1)))
