"""The step plan's pipeline-parallelism part (trainer/step/plan.py): the `[parallelism] pipeline_*`
fields of a `StepRequest` (`PipelineRequest`, its base) and the rules that refuse what PP does not
compose with yet (`PIPELINE_RULES`, part of `RULES`; docs/rules.md).

What runs (parallelisms/pipeline_parallel.py, docs/pipeline_parallel.md): eager stages of a
decoder through torch.distributed.pipelining on cpu/cuda (in compile mode the same schedules over
per-block compiled stages, the zero-bubble ones with AOTAutograd's donated buffers off), composed
with SimpleFSDP/HSDP, TP (and its loss parallel), context parallelism (the cp axis inside each stage), activation
checkpointing and gradient accumulation, and for an MoE flavor with expert parallelism
inside each stage (trainer/step/pipeline.py: the aux loss's gradient attached per stage, the expert
loads per layer); in graph mode the pipeline inside the captured step (trainer/graph/pipeline.py)
with uniform stages, one SPMD program on every pp rank, which is also the TPU path, on one slice or
with the pp axis over several (DCN), dense or MoE (each stage's aux loss and expert loads out of the
program, the bubble iterations masked), with tensor, expert and context parallelism inside each
stage. The rest is refused until it is wired.

Which families that is, is computed here once (`PIPELINE_FAMILIES`, from the registry and
`pipeline_capable`); the model rule's text and message, docs/rules.md (generated from them) and
docs/pipeline_parallel.md (tests/unit/test_prose_lists.py) read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from models import FAMILIES
from models.common.decoder import Decoder
from parallelisms.pipeline_parallel import SCHEDULES as PIPELINE_SCHEDULES
from parallelisms.pipeline_parallel import max_stages, schedule_style, virtual_stages
from trainer.step.rule import Rule


@dataclass(frozen=True)
class PipelineRequest:
    """The pipeline fields of `StepRequest` (its base class); `n_layers` and `local_batch` are
    `StepRequest`'s."""

    pp_degree: int = 1
    """`[parallelism] pipeline_parallel_degree`."""
    pp_schedule: str = "1F1B"
    """`[parallelism] pipeline_schedule`."""
    pp_microbatches: int = 0
    """`[parallelism] pipeline_microbatches` (0: the number of stages)."""
    pp_virtual_stages: int = 0
    """`[parallelism] pipeline_virtual_stages` (0: the schedule's default)."""
    pp_first_less: int = 1
    """`[parallelism] pipeline_first_stage_less_layers`."""
    pp_last_less: int = 1
    """`[parallelism] pipeline_last_stage_less_layers`."""
    pp_scan_iterations: bool = False
    """`[compile] scan_pipeline_iterations` (graph mode's iteration scan)."""

    @property
    def pp_stages_per_rank(self) -> int:
        """Pipeline stages per pp rank (`virtual_stages` of the schedule)."""
        return virtual_stages(self.pp_schedule, self.pp_virtual_stages) if self.pp_schedule in PIPELINE_SCHEDULES else 1

    @property
    def pp_num_stages(self) -> int:
        return self.pp_degree * self.pp_stages_per_rank

    @property
    def pp_m(self) -> int:
        """Micro-batches per schedule step (`pipeline_microbatches`, 0: the number of stages)."""
        return self.pp_microbatches or self.pp_num_stages

    @property
    def pp_max_stages(self) -> int:
        """The most stages the model's layers split into (every stage holding a block)."""
        return max_stages(self.n_layers, first_stage_less=self.pp_first_less, last_stage_less=self.pp_last_less)

    @property
    def pp_too_many_stages(self) -> bool:
        return self.pp_degree > 1 and self.n_layers > 0 and self.pp_num_stages > self.pp_max_stages

    @property
    def pp_rounds(self) -> int:
        """The loop schedules' rounds (torch: max(1, m // pp)); m must divide by it."""
        return max(1, self.pp_m // self.pp_degree)

    @property
    def pp_uneven(self) -> bool:
        """Graph mode's uniform stages: the layers do not split evenly over the pp ranks."""
        return self.pp_degree > 1 and self.n_layers > 0 and self.n_layers % self.pp_degree != 0


def pipeline_capable(model_cls) -> bool:
    """A model the pipeline can cut into stages: a `Decoder` that runs the shared forward (embedding,
    block stack, norm, head), each part optional (models/common/decoder.py)."""
    return (
        isinstance(model_cls, type)
        and issubclass(model_cls, Decoder)
        and model_cls.forward is Decoder.forward
        and model_cls.hidden is Decoder.hidden
    )


def pipeline_flavor(args) -> bool:
    """A flavor the model rule below lets through (dense or MoE, in every mode): no multi-token
    prediction, untied embeddings (`plan_job` reads the same facts)."""
    return getattr(args, "mtp_depth", 0) == 0 and not getattr(args, "tie_embeddings", False)


PIPELINE_FAMILIES: tuple[str, ...] = tuple(
    name
    for name, family in FAMILIES.items()
    if family.task == "lm"
    and pipeline_capable(family.model_cls)
    and any(pipeline_flavor(args) for args in family.flavors.values())
)
"""The registered families PP cuts into stages (their untied flavors without MTP, dense or MoE):
the one list the model rule's text, docs/rules.md and docs/pipeline_parallel.md name."""
PIPELINE_FAMILIES_TEXT = ", ".join(PIPELINE_FAMILIES)


PIPELINE_RULES: tuple[Rule, ...] = (
    Rule(
        "parallelism.pipeline_schedule",
        "the schedule is not one of SCHEDULES",
        lambda r: r.pp_schedule not in PIPELINE_SCHEDULES,
        f"{{r.pp_schedule!r}} is not allowed; allowed: {', '.join(PIPELINE_SCHEDULES)}",
    ),
    Rule(
        "parallelism.pipeline_parallel_degree",
        "PP > 1 on a TPU outside graph mode",
        lambda r: r.pp_degree > 1 and r.device_type == "tpu" and r.mode != "graph",
        "{r.pp_degree} runs eager or per-block compiled stages through torch.distributed.pipelining on cpu/cuda, "
        "or in graph mode the pipeline inside the captured step (the TPU path); here device {r.device_type}, "
        'compile.mode {r.mode}; allowed: 1, or compile.mode = "graph", or "eager" | "compile" on cpu/cuda',
    ),
    # Graph mode: the pipeline is one program per step (trainer/graph/pipeline.py), GPipe's order.
    Rule(
        "parallelism.pipeline_schedule",
        "graph mode with a schedule other than GPipe",
        lambda r: r.pp_degree > 1 and r.mode == "graph" and r.pp_schedule != "GPipe",
        "{r.pp_schedule!r} with compile.mode graph, whose one program per step runs GPipe's order (every "
        'forward iteration, then the backward through the permutes); allowed: "GPipe", or compile.mode = "eager"',
    ),
    Rule(
        "parallelism.pipeline_first_stage_less_layers",
        "graph mode with PP and a first or last stage lighter than the others",
        lambda r: r.pp_degree > 1 and r.mode == "graph" and (r.pp_first_less != 0 or r.pp_last_less != 0),
        "{r.pp_first_less} (last_stage_less_layers {r.pp_last_less}) with compile.mode graph, whose stages are "
        "uniform (one SPMD program: every pp rank holds as many blocks, the embedding and the head); "
        'allowed: pipeline_first_stage_less_layers = pipeline_last_stage_less_layers = 0, or compile.mode = "eager"',
    ),
    Rule(
        "parallelism.pipeline_parallel_degree",
        "graph mode with PP over layers that do not split evenly",
        lambda r: r.mode == "graph" and r.pp_uneven,
        "{r.pp_degree} does not divide the model's {r.n_layers} layers, and graph mode's stages are uniform "
        '(every pp rank holds as many blocks); allowed: a divisor of {r.n_layers}, or compile.mode = "eager"',
    ),
    # The iteration scan (trainer/graph/pipeline.py `PipelinedLoss(scan=True)`): graph-mode PP only;
    # its body takes the stage's parameters as local tensors, SimpleFSDP's (dp_shard, cp) and EP's
    # gathered by group name inside it, TP's styles in their local forms (tested against one process,
    # tests/unit/test_graph_pipeline.py). A layer scan nested in it fails to capture on torch 2.13
    # ("derivative for aten::detach_copy is not implemented", 2026-12-07).
    Rule(
        "compile.scan_pipeline_iterations",
        "the iteration scan without graph-mode PP",
        lambda r: r.pp_scan_iterations and (r.pp_degree == 1 or r.mode != "graph"),
        "true scans graph-mode PP's iterations; here pipeline_parallel_degree {r.pp_degree}, compile.mode "
        '{r.mode}; allowed: false, or compile.mode = "graph" with pipeline_parallel_degree > 1',
    ),
    Rule(
        "compile.scan_pipeline_iterations",
        "the iteration scan with layer scan",
        lambda r: r.pp_scan_iterations and r.pp_degree > 1 and r.scan_layers,
        "true with compile.scan_layers {r.scan_layers}: a layer scan nested in the iteration scan does not "
        "capture on torch 2.13; allowed: false, or scan_layers = false",
    ),
    # Several slices: graph mode's one SPMD program, the pp axis outermost over the slices
    # (ParallelDims.dcn_mesh_shape on `pp x dp_replicate`); the slice count must split the stages and
    # the replicas (slice_rules.py: pp x dp_replicate a multiple of num_slices).
    Rule(
        "parallelism.pipeline_parallel_degree",
        "PP > 1 on several slices outside graph mode",
        lambda r: r.pp_degree > 1 and r.num_slices > 1 and r.mode != "graph",
        "{r.pp_degree} on {r.num_slices} slices runs as graph mode's one program per step, the pp axis over the "
        'slices (DCN); here compile.mode {r.mode}; allowed: 1, or compile.mode = "graph"',
    ),
    Rule(
        "parallelism.pipeline_parallel_degree",
        f"PP > 1 for a model that is not a plain decoder (the untied flavors without MTP of {PIPELINE_FAMILIES_TEXT} "
        "are, dense or MoE), has multi-token prediction, ties its embeddings, or in the engine",
        lambda r: (
            r.pp_degree > 1
            and (not r.model_pipeline or r.task != "lm" or r.mtp_depth > 0 or r.tie_embeddings or r.caller_loss)
        ),
        f"{{r.pp_degree}} cuts a dense decoder or an MoE one (embedding, blocks, norm, head; the untied flavors "
        f"without MTP of {PIPELINE_FAMILIES_TEXT}) into stages; "
        "this model: decoder {r.model_pipeline}, task {r.task}, mtp_depth "
        "{r.mtp_depth}, tied embeddings {r.tie_embeddings}, engine {r.caller_loss}; allowed for it: 1",
    ),
    Rule(
        "moe.routing",
        "benchmark routing with PP",
        lambda r: r.pp_degree > 1 and r.moe_routing in ("random", "balanced"),
        "{r.moe_routing} with pipeline_parallel_degree {r.pp_degree}: the draw numbers a pp rank's routers "
        "and a chunk's tokens as if the rank held the whole model and batch; allowed: learned, or "
        "pipeline_parallel_degree = 1",
    ),
    Rule(
        "parallelism.pipeline_parallel_degree",
        "PP > 1 with document masking, a fused loss on outside graph mode, QK clip, the once-per-step replicate reduction, "
        "a local checkpoint tier, or initial weights to load",
        lambda r: (
            r.pp_degree > 1
            and (
                r.document_mask
                or (r.fused_loss == "on" and r.mode != "graph")
                or r.qk_clip
                or r.replicate_reduce == "step"
                or r.local_checkpoint
                or r.initial_load_format != ""
            )
        ),
        "{r.pp_degree} is not wired yet with training.document_mask ({r.document_mask}), training.fused_loss on "
        "in eager mode ({r.fused_loss}), optimizer.qk_clip_tau > 0 ({r.qk_clip}), training.replicate_reduce step "
        "({r.replicate_reduce}), checkpoint.local_folder "
        "({r.local_checkpoint}) or checkpoint.initial_load_path ({r.initial_load_format!r}; a resumed run's "
        "own checkpoints reshard); allowed: 1, or document_mask = false, fused_loss = auto | off (or compile.mode graph), qk_clip_tau = 0, "
        'replicate_reduce = "micro_batch", local_folder = "", initial_load_path = ""',
    ),
    Rule(
        "parallelism.device_order",
        "a TPU target's layout with PP > 1",
        lambda r: r.pp_degree > 1 and r.device_order_named,
        "{r.device_order!r} is a TPU layout; with pipeline_parallel_degree {r.pp_degree} allowed: identity, auto, "
        "or a permutation of the ranks",
    ),
    Rule(
        "parallelism.pipeline_virtual_stages",
        "a stage count per rank the schedule does not take (GPipe, 1F1B: 1; ZBVZeroBubble: 2)",
        lambda r: (
            r.pp_degree > 1
            and r.pp_schedule in PIPELINE_SCHEDULES
            and r.pp_virtual_stages not in (0, r.pp_stages_per_rank)
        ),
        "{r.pp_virtual_stages} with pipeline_schedule {r.pp_schedule}, which holds {r.pp_stages_per_rank} "
        "stage(s) per rank; allowed: 0 or {r.pp_stages_per_rank}, or a multi-stage schedule "
        "(Interleaved1F1B, LoopedBFS, InterleavedZeroBubble)",
    ),
    Rule(
        "parallelism.pipeline_parallel_degree",
        "more stages (pp x virtual stages) than the layers allow, every stage holding a block",
        lambda r: r.pp_too_many_stages,
        "{r.pp_degree} x {r.pp_stages_per_rank} stage(s) per rank = {r.pp_num_stages} stages, but the model's "
        "{r.n_layers} layers (the first stage {r.pp_first_less} and the last {r.pp_last_less} lighter, "
        "parallelism.pipeline_first/last_stage_less_layers) fill at most {r.pp_max_stages}; allowed: "
        "pp x virtual stages <= {r.pp_max_stages}",
    ),
    Rule(
        "parallelism.pipeline_microbatches",
        "micro-batches that do not divide the local batch",
        lambda r: r.pp_degree > 1 and r.local_batch > 0 and r.local_batch % r.pp_m != 0,
        "{r.pp_m} does not divide the local batch of {r.local_batch} sequences (per data-parallel rank and "
        "accumulation micro-batch); allowed: a divisor of {r.local_batch} (0: the number of stages, "
        "{r.pp_num_stages})",
    ),
    Rule(
        "parallelism.pipeline_microbatches",
        "1F1B with fewer micro-batches than stages",
        lambda r: r.pp_degree > 1 and r.pp_schedule == "1F1B" and r.pp_m < r.pp_num_stages,
        "{r.pp_m} with 1F1B over {r.pp_num_stages} stages (1F1B fills the pipeline before its first "
        'backward); allowed: >= {r.pp_num_stages}, or pipeline_schedule = "GPipe"',
    ),
    Rule(
        "parallelism.pipeline_microbatches",
        "a multi-stage schedule whose rounds (max(1, m // pp)) do not divide the micro-batches",
        lambda r: (
            r.pp_degree > 1
            and r.pp_schedule in PIPELINE_SCHEDULES
            and schedule_style(r.pp_schedule) != "single"
            and r.pp_m % r.pp_rounds != 0
        ),
        "{r.pp_m} with {r.pp_schedule} on pp {r.pp_degree}: the schedule runs max(1, m // pp) = {r.pp_rounds} "
        "rounds of equal size; allowed: a multiple of {r.pp_degree}, or fewer than {r.pp_degree}",
    ),
)
