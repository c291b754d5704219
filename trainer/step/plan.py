"""The step plan: the one place that decodes `[compile] mode` and refuses combinations.

`plan_step(StepRequest)` turns the compile, activation-checkpointing and parallelism settings
into a `StepPlan`; everything that depends on the mode reads that object and nothing else:
- the compiler backend, resolved once (`resolve_backend`);
- where activation checkpointing is applied: on the blocks by `parallelize_model`, in the
  documented order TP -> EP -> AC -> compile -> SimpleFSDP, in every mode; only a scanned graph
  step, whose blocks run as one scan body, applies it inside that body instead;
- which blocks are compiled (`compile` mode), and whether the step is one captured graph;
- the loss: plain (logits, then fp32 cross entropy) or fused (`ops.linear_cross_entropy` from
  the final hidden states: the logits are never whole, nor upcast to fp32 whole), and the
  loss-parallel context (TP with vocab-sharded logits), for eager and graph steps alike;
- the host-sync policy: the step returns device tensors and never reads them; the loop reads
  them on logged steps and before a checkpoint (`trainer/train.py`).

`RULES` is the table of every combination of settings (mode x parallelism x model x device x
caller, and pairs of keys such as `optimizer.qk_clip_tau` x `optimizer.name`) that cannot be
honoured; no other module refuses one that a rule can read from a `StepRequest` (where one is
re-checked later, it is an `assert`). It is read before anything is built: by `build_job`
(trainer and engine), by the planner's search (`planner.search.recommend` skips refused layouts)
and by the recipe tests (`tests/e2e/test_recipes.py`: every shipped recipe at its declared
degrees). A rule names the config key the user changes, when it refuses, and what is allowed
instead. The refusals that need a built model, the mesh or the host cannot be rules over a
request; `trainer/step/checks.py: BUILD_CHECKS` names each of them. Both tables are generated
into docs/rules.md.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from models import FAMILIES
from models.common.moe import ROUTINGS
from models.common.quantize import RECIPES as QUANTIZE_RECIPES
from models.errors import ConfigError
from parallelisms.pipeline_parallel import PipelinePlan
from parallelisms.quantize import DEFAULT_FILTER_FQNS
from titan_kernels import ATTENTION_BACKENDS, ATTENTION_DEVICES, attention_backends_for
from trainer.step.loss import model_lm_loss
from trainer.step.pipeline_rules import PIPELINE_RULES, PipelineRequest
from trainer.step.rule import Rule
from trainer.step.slice_rules import SLICE_RULES

if TYPE_CHECKING:
    from trainer.step.quantize import QuantizeCensus

FLIP_FREE_BACKENDS = ("inductor", "tpu")
"""Graph backends whose backward scans run in reverse without copies (trainer/graph/passes.py:
Inductor a reversed loop, tpu torch-tpu's reverse-tagged scan); with the others the backward
scan reads `flip` copies of its stacked inputs (torch's scan autograd)."""

MODES = ("eager", "compile", "graph")
BACKENDS = ("auto", "inductor", "aot_eager", "eager", "tpu")
FUSED_LOSS = ("auto", "on", "off")
AC_OFFLOADS = ("none", "block_inputs")
"""`[activation_checkpoint] offload`: none, or block_inputs (the block inputs the layer scan saves
for the backward kept in host memory: trainer/graph/passes.py `offload_block_inputs_pass`)."""
TASKS = ("lm", "flow")
DOCUMENT_POSITIONS = ("global", "restart")
CP_TILE = 128
"""Tokens of the TPU splash kernel's query tile (titan_kernels/tpu/splash.py `TILE`, which asserts
it mid-trace); a context-parallel chunk must hold whole tiles."""
FLOAT8_RECIPES = tuple(r for r in QUANTIZE_RECIPES if r.startswith("float8"))
QUANTIZE_NATIVE_TPU = {"v7x": FLOAT8_RECIPES, "v6e": ("int8",), "v5e": ("int8",), "v5p": ("int8",), "v4": ()}
"""`[quantize] recipe`s each TPU generation's MXU runs faster than bf16 (docs/low_precision.md: Google's
tables: v7x FP8 4614 vs bf16 2307 TFLOP/s and no int8 rate; v5e/v5p/v6e int8 at twice bf16, FP8 at
bf16's rate; v4 int8 at bf16's rate). The rules refuse the others on a known generation."""
QUANTIZE_CUDA_MIN_SM = {"float8_tensorwise": 89, "float8_rowwise": 89, "int8": 80}
"""The compute capability each recipe's CUDA kernel needs (`torch._scaled_mm` float8: sm89+;
`torch._int_mm`: sm80+); float8_blockwise has no CUDA kernel wired (refused on CUDA)."""
DOCUMENT_MASK_FAMILIES_TEXT = ", ".join(name for name, family in FAMILIES.items() if family.document_mask)
"""The registered families with `ModelFamily.document_mask`, as the rules' messages name them."""


@dataclass(frozen=True)
class StepRequest(PipelineRequest):
    """What the mode rules read: the run's settings plus the facts of its model, mesh and caller."""

    mode: str = "eager"
    """`[compile] mode`: eager | compile | graph."""
    backend: str = "auto"
    """`[compile] backend` (unresolved)."""
    scan_layers: bool = False
    """`[compile] scan_layers`."""
    ac_mode: str = "none"
    """`[activation_checkpoint] mode`."""
    ac_offload: str = "none"
    """`[activation_checkpoint] offload`: none | block_inputs."""
    loss_parallel: bool = False
    """`[parallelism] enable_loss_parallel`."""
    tp_degree: int = 1
    """Tensor-parallel degree of the mesh."""
    device_type: str = "cpu"
    """cpu | cuda | tpu (the picked device)."""
    fused_loss: str = "off"
    """`[training] fused_loss`: auto | on | off."""
    model_has_hidden: bool = False
    """The model has `hidden()` (the contract's optional part the fused loss needs)."""
    task: str = "lm"
    """The family's task: lm | flow."""
    caller_loss: bool = False
    """The step runs a caller's loss function on the logits (the RL engine), not the task's."""
    document_mask: bool = False
    """`[training] document_mask`: micro-batches carry document (segment) ids."""
    document_positions: str = "global"
    """`[training] document_positions`: global | restart."""
    model_document_mask: bool = False
    """The family's model takes segment ids and positions (`ModelFamily.document_mask`)."""
    cp_degree: int = 1
    """`[parallelism] context_parallel_degree`."""
    seq_len: int = 0
    """`[training] seq_len` (0: not known to the caller; no rule reads it then)."""
    qk_clip: bool = False
    """`[optimizer] qk_clip_tau` > 0 (MuonClip's QK clip, trainer/optim/qk_clip.py)."""
    optimizer: str = "adamw"
    """`[optimizer] name` (the planner counts Muon's one moment and its update buffers)."""
    muon_exclude: tuple[str, ...] | None = None
    """`[optimizer] muon_exclude` (None: the optimizer's default): which matrices the planner counts
    as Muon's."""
    moe_routing: str = "learned"
    """`[moe] routing`: learned | random | balanced."""
    moe_capacity_factor: float = 0.0
    """`[moe] capacity_factor`: 0 dropless, > 0 the capacity-bounded dispatch."""
    moe_dispatch_chunks: int = 1
    """`[moe] dispatch_chunks`: the capacity buffer's row chunks over the EP all-to-all."""
    routing_benchmark_only: bool = False
    """`[moe] routing_benchmark_only`: the recipe marks itself a throughput benchmark."""
    model_has_experts: bool = True
    """The model has MoE layers (False: a dense flavor, FLUX, ...; True when not known)."""
    grad_accum: int = 1
    """Gradient accumulation steps (1 when not known to the caller)."""
    attn_backend: str = "auto"
    """`[model] attn_backend`: auto | sdpa | cpu_kernel | splash."""
    tp_refusal: str | None = None
    """Why tensor parallelism cannot apply to this model, whatever the degree (the hf backend's
    `models.hf.plan.tp_refusal`, or a native family's model class attribute `tp_refusal`: Qwen 3.5's
    Gated DeltaNet has no TP plan); None: it can."""
    flow_shift: float = 1.0
    """`[flow] shift`."""
    flow_resolution_shift: bool = False
    """`[flow] resolution_shift`."""
    initial_load_format: str = ""
    """`[checkpoint] initial_load_format` when `initial_load_path` is set ("": nothing is loaded)."""
    model_has_hf_adapter: bool = True
    """The family has an `hf_adapter` (Hugging Face names: `ModelFamily.hf_adapter`)."""
    model_attn_backends: tuple[str, ...] = ATTENTION_BACKENDS
    """The `[model] attn_backend` values the family's attention honours (its model class's
    `attn_backends`; gpt-oss: auto, sdpa, its own formulation with sinks); default: all."""
    num_slices: int = 1
    """TPU slices the job spans (`[parallelism] num_slices`, resolved against the launcher's
    `MEGASCALE_NUM_SLICES`)."""
    recipe_num_slices: int = 0
    """`[parallelism] num_slices` as the recipe sets it (0: the launcher's count)."""
    target_num_slices: int = 1
    """The slices the recipe's `[job] target` names (`v6e-256x2`: 2; 1 without a target or a count)."""
    dp_replicate: int = 1
    """`[parallelism] data_parallel_replicate_degree`."""
    allow_dcn_sharding: bool = False
    """`[parallelism] allow_dcn_sharding`."""
    local_checkpoint: bool = False
    """`[checkpoint] enable` with a `local_folder` (the local tier restores a lost slice from another
    slice's whole replica)."""
    replicate_reduce: str = "micro_batch"
    """`[training] replicate_reduce`."""
    replicate_reduce_dtype: str = "float32"
    """`[training] replicate_reduce_dtype`."""
    quantize: str = "none"
    """`[quantize] recipe`."""
    fsdp_float8_all_gather: bool = False
    """`[quantize] fsdp_float8_all_gather`."""
    fsdp_shard_degree: int = 0
    """Ranks the SimpleFSDP shard axis splits weights over (dp_shard x cp; 0: not known to the
    caller, and no rule reads it then)."""
    device_generation: str = ""
    """The device's generation where the quantize rules need it: a TPU generation (v4, v5e, v5p,
    v6e, v7x) or a CUDA compute capability (`sm90`); "" when unknown (no quantize rule reads it)."""
    quantize_census: QuantizeCensus | None = None
    """What `[quantize]` picks in the model (trainer/step/quantize.py), counted on the meta device
    by `plan_job` when a recipe is set; None when not known (no rule reads it then)."""
    mtp_depth: int = 0
    """The model's multi-token-prediction modules (`[model] mtp_depth` of deepseek_v3 and qwen3_5; 0: none or not known)."""
    indexer_loss: bool = False
    """DeepSeek-V4's lightning indexers train on their KL loss (`[model] indexer_loss_weight` > 0)."""
    linear_conv_halo: int = 0
    """Tokens before each one that the model's linear-attention short convolution reads (Qwen 3.5:
    `linear_conv_kernel_dim - 1`), which context parallelism takes from the preceding chunk only
    (parallelisms/context_parallel_linear.py); 0: none or not known (no rule reads it then)."""
    n_layers: int = 0
    """The model's repeated blocks (0: not known to the caller; no rule reads it then)."""
    local_batch: int = 0
    """Sequences per data-parallel rank and accumulation micro-batch, as the batch split resolves
    them (0: not known to the caller; no rule reads it then)."""
    ep_degree: int = 1
    """`[parallelism] expert_parallel_degree`."""
    model_pipeline: bool = True
    """The family's model can be cut into pipeline stages (a `Decoder` with its own forward: token
    embedding, a block stack, norm and head; models/common/decoder.py)."""
    tie_embeddings: bool = False
    """The model ties its output head to the token embedding."""
    device_order: str = "auto"
    """`[parallelism] device_order`, as text."""

    @property
    def device_order_named(self) -> bool:
        """device_order names a TPU target's layout (not identity, auto or a permutation)."""
        text = self.device_order.replace(" ", "")
        return text not in ("identity", "auto") and not all(p.isdigit() for p in text.strip("[]").split(","))

    @property
    def model_attn_backends_text(self) -> str:
        """`model_attn_backends` for the rules' messages."""
        return ", ".join(self.model_attn_backends)

    @property
    def attn_backends_here(self) -> str:
        """The attention backends that serve `device_type`, for the rules' messages."""
        return ", ".join(attention_backends_for(self.device_type))

    @property
    def quantize_native_here(self) -> str:
        """The recipes this device generation runs natively, for the quantize rules' messages."""
        if self.device_type == "tpu":
            native = QUANTIZE_NATIVE_TPU.get(self.device_generation, ())
        else:
            native = tuple(r for r, sm in QUANTIZE_CUDA_MIN_SM.items() if self.cuda_sm >= sm)
        return ", ".join(("none",) + native)

    @property
    def quantizes_nothing(self) -> bool:
        """A recipe is set, and the model's census says it picks no linear and no experts module."""
        c = self.quantize_census
        return self.quantize in QUANTIZE_RECIPES and self.quantize != "none" and c is not None and c.quantizes_nothing

    @property
    def quantize_left_out(self) -> str:
        """Why the recipe quantizes nothing (the census's words), for the quantize rules' messages."""
        return self.quantize_census.left_out(self.quantize) if self.quantize_census is not None else ""

    @property
    def quantize_min_dims(self) -> str:
        """The `quantize.min_dim` values that would quantize something, for the rule's message."""
        return self.quantize_census.min_dim_allowed if self.quantize_census is not None else ""

    @property
    def quantize_min_sm(self) -> int:
        """The compute capability the recipe's CUDA kernel needs (0: none known)."""
        return QUANTIZE_CUDA_MIN_SM.get(self.quantize, 0)

    @property
    def cuda_sm(self) -> int:
        """The CUDA compute capability as an integer (sm90 -> 90); 0 when not known."""
        g = self.device_generation
        return int(g[2:]) if g.startswith("sm") and g[2:].isdigit() else 0

    @property
    def cp_chunk(self) -> int | float:
        """Tokens per context-parallel chunk: each window is cut into 2 x cp chunks (load balance)."""
        chunks = 2 * self.cp_degree
        return self.seq_len // chunks if self.seq_len % chunks == 0 else self.seq_len / chunks

    @property
    def cp_seq_multiple(self) -> int:
        """What `seq_len` must be a multiple of for whole splash tiles per context-parallel chunk."""
        return 2 * self.cp_degree * CP_TILE


def _others(choices: tuple[str, ...], *drop: str) -> str:
    return ", ".join(c for c in choices if c not in drop)


RULES: tuple[Rule, ...] = (
    # Choices (the config's `allowed` lists are these same tuples, trainer/config/schema.py).
    Rule(
        "compile.mode",
        "the mode is not one of MODES",
        lambda r: r.mode not in MODES,
        f"{{r.mode!r}} is not allowed; allowed: {', '.join(MODES)}",
    ),
    Rule(
        "compile.backend",
        "the backend is not one of BACKENDS",
        lambda r: r.backend not in BACKENDS,
        f"{{r.backend!r}} is not allowed; allowed: {', '.join(BACKENDS)}",
    ),
    Rule(
        "training.fused_loss",
        "the value is not one of FUSED_LOSS",
        lambda r: r.fused_loss not in FUSED_LOSS,
        f"{{r.fused_loss!r}} is not allowed; allowed: {', '.join(FUSED_LOSS)}",
    ),
    Rule(
        "model.name",
        "the family declares a task the trainer has no task for",
        lambda r: r.task not in TASKS,
        f"the family declares task {{r.task!r}}; allowed: a family whose task is one of {', '.join(TASKS)}",
    ),
    Rule(
        "activation_checkpoint.offload",
        "the value is not one of AC_OFFLOADS",
        lambda r: r.ac_offload not in AC_OFFLOADS,
        f"{{r.ac_offload!r}} is not allowed; allowed: {', '.join(AC_OFFLOADS)}",
    ),
    Rule(
        "training.document_positions",
        "the value is not one of DOCUMENT_POSITIONS",
        lambda r: r.document_positions not in DOCUMENT_POSITIONS,
        f"{{r.document_positions!r}} is not allowed; allowed: {', '.join(DOCUMENT_POSITIONS)}",
    ),
    # Device.
    Rule(
        "compile.backend",
        "backend tpu on a device that is not a TPU",
        lambda r: r.backend == "tpu" and r.device_type != "tpu",
        f"tpu needs a TPU device; allowed here: {_others(BACKENDS, 'tpu')}",
    ),
    # Attention kernels that serve one device type (titan_kernels/__init__.py ATTENTION_DEVICES).
    Rule(
        "model.attn_backend",
        "cpu_kernel on a device that is not the CPU",
        lambda r: r.attn_backend == "cpu_kernel" and r.device_type != ATTENTION_DEVICES["cpu_kernel"],
        "cpu_kernel runs on the CPU only, not on {r.device_type}; allowed here: {r.attn_backends_here}",
    ),
    Rule(
        "model.attn_backend",
        "splash on a device that is not a TPU",
        lambda r: r.attn_backend == "splash" and r.device_type != ATTENTION_DEVICES["splash"],
        "splash runs on TPU only, not on {r.device_type}; allowed here: {r.attn_backends_here}",
    ),
    # A family whose attention is its own formulation, not the op (gpt-oss: no kernel takes its sinks).
    Rule(
        "model.attn_backend",
        "a backend the family's own attention does not run (gpt-oss: attention sinks)",
        lambda r: r.attn_backend not in r.model_attn_backends,
        "{r.attn_backend} cannot serve this model's attention (attention sinks: the family's own torch "
        "formulation); allowed: {r.model_attn_backends_text}",
    ),
    # Layer scan.
    Rule(
        "compile.scan_layers",
        "scan_layers outside graph mode",
        lambda r: r.scan_layers and r.mode != "graph",
        'needs compile.mode = "graph"; allowed otherwise: false',
    ),
    # Host offload of the block inputs the scan saves (the layer scan's forward/backward pair
    # with full checkpointing is what `offload_block_inputs_pass` rewrites).
    Rule(
        "activation_checkpoint.offload",
        "block_inputs without graph mode, layer scan and full activation checkpointing",
        lambda r: r.ac_offload != "none" and not (r.mode == "graph" and r.scan_layers and r.ac_mode == "full"),
        '{r.ac_offload} needs compile.mode = "graph", compile.scan_layers = true and activation_checkpoint.mode '
        '= "full" (here: {r.mode}, scan_layers {r.scan_layers}, {r.ac_mode}); allowed otherwise: none',
    ),
    # Scan with tensor parallelism runs the decoder TP styles in the body on local tensors
    # (parallelisms/scan.py); a plan style without a scan form is refused when the step is built
    # (BUILD_CHECKS, trainer/step/checks.py).
    # Tensor parallelism of the hf backend: its plan is translated from the transformers model's
    # own (models/hf/plan.py `tp_refusal` says why an architecture has none); a native family
    # without a TP plan says why in its model class's `tp_refusal` (qwen3_5).
    Rule(
        "parallelism.tensor_parallel_degree",
        "TP > 1 on an hf-backend model whose TP plan does not translate, or a family whose model class "
        "has a tp_refusal (qwen3_5)",
        lambda r: r.tp_degree > 1 and r.tp_refusal is not None,
        "{r.tp_refusal}; allowed for this model: 1",
    ),
    # Loss.
    Rule(
        "training.fused_loss",
        "fused loss on, with tensor parallelism",
        lambda r: r.fused_loss == "on" and r.tp_degree > 1,
        "on needs the whole vocabulary on each rank, but tensor parallelism shards it; allowed with "
        "tensor_parallel_degree > 1: auto, off",
    ),
    Rule(
        "training.fused_loss",
        "fused loss on, for a model without hidden()",
        lambda r: r.fused_loss == "on" and not r.model_has_hidden,
        "on needs a model with hidden() (models/contract.py); allowed for this model: auto, off",
    ),
    Rule(
        "parallelism.enable_loss_parallel",
        "loss parallel for a flow model",
        lambda r: r.loss_parallel and r.task == "flow",
        "shards an LM's vocabulary; a flow model has none; allowed: false",
    ),
    # Document masking (packed documents; docs/data.md#document-masking).
    Rule(
        "training.document_positions",
        "restart positions without document masking",
        lambda r: r.document_positions == "restart" and not r.document_mask,
        "restart needs training.document_mask = true; allowed without it: global",
    ),
    Rule(
        "training.document_mask",
        "document masking for a task other than lm",
        lambda r: r.document_mask and r.task != "lm",
        "true applies to packed token windows (task lm); this family's task is {r.task}; allowed: false",
    ),
    Rule(
        "training.document_mask",
        "document masking for an LM family without ModelFamily.document_mask",
        lambda r: r.document_mask and r.task == "lm" and not r.model_document_mask,
        f"true needs a model that takes segment ids (ModelFamily.document_mask: {DOCUMENT_MASK_FAMILIES_TEXT}; "
        "the hf backend's transformers model does not); allowed for this model: false",
    ),
    Rule(
        "training.document_mask",
        "document masking in the engine (its caller's batches)",
        lambda r: r.document_mask and r.caller_loss,
        "true applies to the trainer's packed windows; the engine takes its caller's batches; allowed: false",
    ),
    # Context parallelism (docs/context_parallel.md): the LM step shards token windows, passes
    # the shards' RoPE positions and serves `causal_attention` with the cp all-gather attention.
    Rule(
        "parallelism.context_parallel_degree",
        "CP > 1 for a task other than lm",
        lambda r: r.cp_degree > 1 and r.task != "lm",
        "{r.cp_degree} shards the token windows of task lm; this family's task is {r.task}; allowed: 1",
    ),
    Rule(
        "parallelism.context_parallel_degree",
        "CP > 1 for an LM family without ModelFamily.document_mask",
        lambda r: r.cp_degree > 1 and r.task == "lm" and not r.model_document_mask,
        "{r.cp_degree} needs a model that takes RoPE positions and runs attention through the op "
        f"causal_attention (ModelFamily.document_mask: {DOCUMENT_MASK_FAMILIES_TEXT}; the hf backend's "
        "transformers model does not); allowed for this model: 1",
    ),
    Rule(
        "parallelism.context_parallel_degree",
        "CP > 1 in the engine (its caller's loss on whole sequences)",
        lambda r: r.cp_degree > 1 and r.caller_loss,
        "{r.cp_degree}: the engine runs its caller's loss on whole sequences; allowed: 1",
    ),
    # On TPU each cp rank's two chunks (seq_len / (2 cp) tokens each) are splash's query blocks at
    # static offsets (titan_kernels/tpu/splash.py, `cp_forward`): whole 128-token tiles only.
    Rule(
        "training.seq_len",
        f"on TPU with CP > 1, a seq_len that is not a multiple of 2 * cp * {CP_TILE}",
        lambda r: r.device_type == "tpu" and r.cp_degree > 1 and r.seq_len % r.cp_seq_multiple != 0,
        "{r.seq_len} with parallelism.context_parallel_degree = {r.cp_degree} makes context-parallel "
        "chunks of seq_len / (2 * cp) = {r.cp_chunk} tokens; on TPU the splash kernel takes whole "
        f"{CP_TILE}-token tiles per chunk; allowed: a seq_len that is a multiple of 2 * cp * {CP_TILE} = "
        "{r.cp_seq_multiple}, or a context_parallel_degree for which it is one",
    ),
    # Linear attention under CP (Qwen 3.5): each chunk's convolution takes the preceding chunk's last
    # K - 1 rows as its halo (parallelisms/context_parallel_linear.py), so a chunk must hold them.
    Rule(
        "parallelism.context_parallel_degree",
        "CP chunks shorter than the linear attention's convolution halo",
        lambda r: r.cp_degree > 1 and r.linear_conv_halo > 0 and r.cp_chunk < r.linear_conv_halo,
        "{r.cp_degree} with training.seq_len = {r.seq_len} makes context-parallel chunks of seq_len / "
        "(2 * cp) = {r.cp_chunk} tokens, fewer than the {r.linear_conv_halo} tokens before each one that "
        "the linear attention's short convolution reads (passed from the preceding chunk only); allowed: "
        "a context_parallel_degree with seq_len / (2 * cp) >= {r.linear_conv_halo}, or 1",
    ),
    # The engine runs a caller's loss on the logits.
    Rule(
        "compile.mode",
        "graph mode in the engine (its caller's loss)",
        lambda r: r.caller_loss and r.mode == "graph",
        '"graph" captures the LM loss and the optimizer update in one graph, so the engine cannot run '
        f"a caller's loss function; allowed: {_others(MODES, 'graph')}",
    ),
    Rule(
        "training.fused_loss",
        "fused loss on in the engine (its caller reads log-probs)",
        lambda r: r.caller_loss and r.fused_loss == "on",
        "on never forms the log-probs the engine's loss functions read; allowed: auto, off",
    ),
    Rule(
        "model.name",
        "a family whose task is not lm in the engine",
        lambda r: r.caller_loss and r.task != "lm",
        "the engine trains language models (task lm); this family's task is {r.task}; allowed: a family with task lm",
    ),
    # MuonClip's QK clip (docs/optimizers.md): part of the Muon step; the attention forward records
    # its max logits as a module side effect, which the captured step does not run; with CP a rank
    # sees only its own keys. (TP runs: each rank tracks its own heads and the maxima meet in one
    # all-reduce, trainer/optim/qk_clip.py.)
    Rule(
        "optimizer.qk_clip_tau",
        "QK clip with an optimizer other than Muon",
        lambda r: r.qk_clip and r.optimizer != "muon",
        "> 0 is MuonClip, part of the Muon step; optimizer.name is {r.optimizer!r}; allowed: 0, or "
        'optimizer.name = "muon"',
    ),
    Rule(
        "optimizer.qk_clip_tau",
        "QK clip in graph mode",
        lambda r: r.qk_clip and r.mode == "graph",
        "> 0 runs in the eager step only (the captured step does not track max logits); allowed with "
        'compile.mode = "graph": 0',
    ),
    Rule(
        "optimizer.qk_clip_tau",
        "QK clip with context parallelism",
        lambda r: r.qk_clip and r.cp_degree > 1,
        "> 0 with context parallelism is not implemented (a rank's max logits would see only its own "
        "keys, at local positions); allowed with context_parallel_degree > 1: 0",
    ),
    # Benchmark routing (models/common/moe.py, docs/moe.md#benchmark-routing): a synthetic choice
    # of experts is for measuring throughput, never for training a model.
    Rule(
        "moe.routing",
        "the routing is not one of ROUTINGS",
        lambda r: r.moe_routing not in ROUTINGS,
        f"{{r.moe_routing!r}} is not allowed; allowed: {', '.join(ROUTINGS)}",
    ),
    Rule(
        "moe.routing",
        "benchmark routing for a model without experts",
        lambda r: r.moe_routing in ROUTINGS and r.moe_routing != "learned" and not r.model_has_experts,
        "{r.moe_routing} routes tokens to experts; this model has none; allowed: learned",
    ),
    Rule(
        "moe.routing",
        "benchmark routing in a recipe not marked a benchmark",
        lambda r: (
            r.moe_routing in ROUTINGS
            and r.moe_routing != "learned"
            and r.model_has_experts
            and not r.routing_benchmark_only
        ),
        "{r.moe_routing} is for throughput benchmarks only (the loss is not a model's); allowed for "
        "training: learned, or mark the recipe a benchmark with moe.routing_benchmark_only = true",
    ),
    # The draw is keyed by a token's place in the step's global batch, which the router knows
    # from its rank's first token: whole windows per rank, one micro-batch per step, written by
    # the trainer's loop (the engine's caller owns its steps and batches).
    Rule(
        "moe.routing",
        "benchmark routing with TP, CP, gradient accumulation or the engine",
        lambda r: (
            r.moe_routing in ("random", "balanced")
            and (r.tp_degree > 1 or r.cp_degree > 1 or r.grad_accum > 1 or r.caller_loss)
        ),
        "{r.moe_routing} with tensor or context parallelism, gradient accumulation or the engine is "
        "not implemented (the trainer keys tokens by whole windows, one micro-batch per step); "
        "allowed there: learned",
    ),
    # The capacity-bounded dispatch (models/common/moe.py): per-sequence capacity groups, so a
    # rank must hold whole sequences (TP's MoE sees a sequence shard, CP two chunks of it).
    Rule(
        "moe.capacity_factor",
        "a negative capacity factor",
        lambda r: r.moe_capacity_factor < 0,
        "{r.moe_capacity_factor}; allowed: 0 (dropless) or a factor > 0, e.g. 1.25",
    ),
    Rule(
        "moe.capacity_factor",
        "a capacity for a model without experts",
        lambda r: r.moe_capacity_factor > 0 and not r.model_has_experts,
        "{r.moe_capacity_factor} bounds what each expert takes; this model has none; allowed: 0",
    ),
    Rule(
        "moe.capacity_factor",
        "a capacity with tensor or context parallelism",
        lambda r: r.moe_capacity_factor > 0 and (r.tp_degree > 1 or r.cp_degree > 1),
        "{r.moe_capacity_factor} with tensor or context parallelism is not implemented (capacity is "
        "counted per whole sequence, which a TP or CP rank does not hold); allowed there: 0 (dropless)",
    ),
    Rule(
        "moe.dispatch_chunks",
        "dispatch chunks without a capacity",
        lambda r: r.moe_dispatch_chunks > 1 and r.moe_capacity_factor <= 0,
        "{r.moe_dispatch_chunks} splits the capacity dispatch's buffer, and moe.capacity_factor is 0 "
        "(the dropless dispatch); allowed there: 1, or set moe.capacity_factor > 0",
    ),
    # Initial weights in Hugging Face form are read through the family's adapter
    # (trainer/checkpoint/initial.py `load_initial`).
    Rule(
        "checkpoint.initial_load_format",
        "hf weights to load into a family without hf_adapter.py",
        lambda r: r.initial_load_format == "hf" and not r.model_has_hf_adapter,
        "'hf' is not supported for this model (no hf_adapter.py); allowed: dcp",
    ),
    # Several slices: trainer/step/slice_rules.py.
    *SLICE_RULES,
    # Low-precision matmuls (`[quantize]`, parallelisms/quantize.py, docs/low_precision.md): each
    # device runs the recipes its matrix units run natively; the CPU runs all as the emulation.
    Rule(
        "quantize.recipe",
        "the recipe is not one of RECIPES",
        lambda r: r.quantize not in QUANTIZE_RECIPES,
        f"{{r.quantize!r}} is not allowed; allowed: {', '.join(QUANTIZE_RECIPES)}",
    ),
    Rule(
        "quantize.recipe",
        "on a TPU generation whose MXU does not run the recipe faster than bf16",
        lambda r: (
            r.device_type == "tpu"
            and r.quantize != "none"
            and r.device_generation in QUANTIZE_NATIVE_TPU
            and r.quantize not in QUANTIZE_NATIVE_TPU[r.device_generation]
        ),
        "{r.quantize} does not run natively on TPU {r.device_generation} (float8 needs v7x's MXU, int8 "
        "v5e/v5p/v6e's); allowed here: {r.quantize_native_here}",
    ),
    Rule(
        "quantize.recipe",
        "float8_blockwise on CUDA (no blockwise kernel wired)",
        lambda r: r.device_type == "cuda" and r.quantize == "float8_blockwise",
        "float8_blockwise has no CUDA kernel here yet (it runs on TPU v7x and as the CPU emulation); "
        f"allowed on cuda: {', '.join(('none', *QUANTIZE_CUDA_MIN_SM))}",
    ),
    Rule(
        "quantize.recipe",
        "on a CUDA device below the recipe's compute capability",
        lambda r: (
            r.device_type == "cuda"
            and r.cuda_sm > 0
            and r.quantize in QUANTIZE_CUDA_MIN_SM
            and r.cuda_sm < QUANTIZE_CUDA_MIN_SM[r.quantize]
        ),
        "{r.quantize} needs a GPU of compute capability sm{r.quantize_min_sm}+ (float8: Ada, Hopper, "
        "Blackwell), this one is "
        "{r.device_generation}; allowed here: {r.quantize_native_here}",
    ),
    # A recipe that quantizes nothing would train in bf16 while the recipe, the banner's step time
    # and the planner's float8 bytes say it does not: refused, naming the key that left each out.
    Rule(
        "quantize.min_dim",
        "a recipe that quantizes none of the model's linears, some left out by min_dim (or by sides "
        "that are not multiples of 16)",
        lambda r: r.quantizes_nothing and r.quantize_census.by_min_dim > 0,
        "{r.quantize_left_out}; allowed: {r.quantize_min_dims}, or quantize.recipe = none",
    ),
    Rule(
        "quantize.filter_fqns",
        "a recipe that quantizes none of the model's linears, each left out by filter_fqns",
        lambda r: r.quantizes_nothing and r.quantize_census.by_min_dim == 0,
        "{r.quantize_left_out}; allowed: fewer module-path substrings (the default: "
        f"{', '.join(DEFAULT_FILTER_FQNS)}), or quantize.recipe = none",
    ),
    # Float8 all-gather of weights (parallelisms/simple_fsdp.py `_Float8Gather`): the scale is one
    # all-reduced amax per weight, known before the gather only for a tensorwise recipe.
    Rule(
        "quantize.fsdp_float8_all_gather",
        "true with a recipe other than float8_tensorwise, with tensor parallelism, or with weights "
        "not sharded (dp_shard x cp = 1, when known)",
        lambda r: (
            r.fsdp_float8_all_gather
            and (r.quantize != "float8_tensorwise" or r.tp_degree > 1 or r.fsdp_shard_degree == 1)
        ),
        "true needs quantize.recipe = float8_tensorwise (one scale per weight, from the shards' "
        "all-reduced amax before the gather), tensor_parallel_degree = 1 and weights sharded by "
        "SimpleFSDP (data_parallel_shard_degree x context_parallel_degree > 1); here recipe "
        "{r.quantize}, tp {r.tp_degree}, shard degree {r.fsdp_shard_degree}; allowed: false",
    ),
    # The once-per-step mean over dp_replicate (parallelisms/replicate_reduce.py) is the only
    # reduction that can put bf16 on the wire while it sums in fp32.
    Rule(
        "training.replicate_reduce_dtype",
        "bfloat16 while training.replicate_reduce is micro_batch",
        lambda r: r.replicate_reduce_dtype != "float32" and r.replicate_reduce != "step",
        "{r.replicate_reduce_dtype} applies to the once-per-step reduction over dp_replicate only "
        '(training.replicate_reduce = "step"); here replicate_reduce is {r.replicate_reduce}; '
        'allowed: float32, or set training.replicate_reduce = "step"',
    ),
    # Multi-token prediction (models/deepseek_v3, trainer/step/loss.py `MTPLoss`): the eager and the
    # graph step return each depth's loss; the MTP modules sit outside the block stacks that TP
    # shards, their shifted tokens would cross TP's sequence shards and CP's chunks, and the
    # engine's caller loss never runs them.
    Rule(
        "model.mtp_depth",
        "multi-token prediction with tensor or context parallelism, or in the engine",
        lambda r: r.mtp_depth > 0 and (r.tp_degree > 1 or r.cp_degree > 1 or r.caller_loss),
        "{r.mtp_depth} (multi-token prediction) runs in the trainer (every compile mode) without "
        "tensor or context parallelism; here tensor_parallel_degree {r.tp_degree}, "
        "context_parallel_degree {r.cp_degree}, engine {r.caller_loss}; allowed: 0, or "
        "tensor_parallel_degree = context_parallel_degree = 1 in the trainer",
    ),
    # Pipeline parallelism: trainer/step/pipeline_rules.py.
    *PIPELINE_RULES,
    # FLUX's timestep shift (trainer/tasks/flux.py): a fixed shift or the resolution-dependent one.
    Rule(
        "flow.shift",
        "a fixed shift other than 1.0 together with flow.resolution_shift = true",
        lambda r: r.flow_resolution_shift and r.flow_shift != 1.0,
        "{r.flow_shift} with flow.resolution_shift = true sets the shift twice; allowed: 1.0 with "
        "resolution_shift, or flow.resolution_shift = false",
    ),
    # DeepSeek-V4's indexer loss (models/deepseek_v4/model.py `indexer_kl`, trainer/tasks/lm.py
    # `IndexerLoss`): its target sums the main attention's probabilities over all heads, which TP
    # splits over its ranks (the replicated indexer would train on a partial sum), and the engine's
    # caller loss never adds it.
    Rule(
        "model.indexer_loss_weight",
        "the indexer loss with tensor parallelism, or in the engine",
        lambda r: r.indexer_loss and (r.tp_degree > 1 or r.caller_loss),
        "> 0 (DeepSeek-V4's indexers trained on their KL loss) runs in the trainer without tensor "
        "parallelism: its target sums the attention over every head, which TP splits; here "
        "tensor_parallel_degree {r.tp_degree}, engine {r.caller_loss}; allowed: 0, or "
        "tensor_parallel_degree = 1 in the trainer",
    ),
)


def refusals(request: StepRequest) -> list[str]:
    """The message of every rule that refuses `request` (empty: it can run)."""
    return [rule.message(request) for rule in RULES if rule.refuses(request)]


@dataclass(frozen=True)
class StepPlan:
    """Everything `[compile] mode` decides, resolved once (see the module docstring)."""

    mode: str
    """eager | compile | graph."""
    backend: str | None
    """The resolved compiler backend (inductor | aot_eager | eager | tpu); None in eager mode."""
    block_ac: str
    """AC mode `parallelize_model` applies to the blocks (none | full | selective)."""
    block_compile: str | None
    """Backend that `parallelize_model` compiles each block with; None: blocks stay eager."""
    scan: bool
    """Graph mode runs the repeated blocks as one scan."""
    scan_ac: str
    """AC mode applied inside the scan bodies (graph + layer scan, or graph-mode PP's iteration scan);
    "none" otherwise."""
    loss_parallel: bool
    """The LM loss runs on vocab-sharded logits under `loss_parallel_context` (TP only)."""
    fused_loss: bool = False
    """The LM loss is `ops.linear_cross_entropy(model.hidden(x), model.output.weight, y)`."""
    document_mask: bool = False
    """LM micro-batches are `(inputs, labels, segment_ids)` and the model gets the segment ids."""
    restart_positions: bool = False
    """With `document_mask`: micro-batches also carry per-document RoPE positions (4 tensors)."""
    scan_offload: str = "none"
    """`[activation_checkpoint] offload` of the scanned step (graph + scan + full AC); "none" otherwise."""
    pipeline: PipelinePlan | None = None
    """Pipeline parallelism (pp > 1): the schedule, stages per rank and micro-batches; None without."""

    @property
    def scan_flips(self) -> bool:
        """The backward scan reads flipped copies of the stacked saved tensors (memory the planner
        counts): a scanned step on a backend without the reversed-loop rewrite."""
        return self.scan and self.backend not in FLIP_FREE_BACKENDS

    @property
    def undonated_update(self) -> bool:
        """The optimizer update writes new parameter and moment buffers before the old ones are
        freed: torch-tpu's compile backend donates no captured input (torch_tpu 0.2.0)."""
        return self.mode == "graph" and self.backend == "tpu"

    def loss_context(self) -> contextlib.AbstractContextManager:
        from parallelisms import loss_parallel_context

        return loss_parallel_context(self.loss_parallel)

    def lm_loss(
        self,
        model,
        inputs: torch.Tensor,
        labels: torch.Tensor,
        segment_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        *,
        reduction: str = "mean",
    ) -> torch.Tensor:
        """The LM loss of this plan (plain or fused): trainer/step/loss.py `model_lm_loss`."""
        return model_lm_loss(model, inputs, labels, segment_ids, positions, fused=self.fused_loss, reduction=reduction)


def resolve_backend(backend: str, *, mode: str, device_type: str) -> str:
    """The compiler backend for `mode` on `device_type`: auto -> tpu on a TPU, inductor elsewhere.

    In graph mode `eager` means `aot_eager` (the captured graph runs op by op). The request has
    passed `RULES` (`plan_step`): the backend is a known one and `tpu` runs on a TPU.
    """
    if backend == "auto":
        return "tpu" if device_type == "tpu" else "inductor"
    if mode == "graph" and backend == "eager":
        return "aot_eager"
    return backend


def plan_step(request: StepRequest | None = None, **settings) -> StepPlan:
    """The `StepPlan` of a run; ConfigError (the first refusing rule of `RULES`) otherwise.

    Pass a `StepRequest`, or its fields as keywords. `fused_loss` auto fuses on TPU when the
    model has `hidden()` and no tensor parallelism (the op takes the whole vocabulary).
    """
    r = request if request is not None else StepRequest(**settings)
    refused = refusals(r)
    if refused:
        raise ConfigError(refused[0])
    tp = r.tp_degree > 1
    # The engine's caller reads logits or log-probs, which the fused loss never forms.
    fused = (
        r.model_has_hidden
        and not tp
        and not r.caller_loss
        and (r.fused_loss == "on" or (r.fused_loss == "auto" and r.device_type == "tpu"))
    )
    resolved = None if r.mode == "eager" else resolve_backend(r.backend, mode=r.mode, device_type=r.device_type)
    scan = r.mode == "graph" and r.scan_layers
    # graph-mode PP's iteration scan runs the stage's blocks in a scan body too: its checkpointing is
    # the body's partition (`scan_ac`), as layer scan's; the blocks' own wrapper does not reach it
    body_scan = scan or (r.mode == "graph" and r.pp_degree > 1 and r.pp_scan_iterations)
    return StepPlan(
        mode=r.mode,
        backend=resolved,
        block_ac="none" if body_scan else r.ac_mode,
        block_compile=resolved if r.mode == "compile" else None,
        scan=scan,
        scan_ac=r.ac_mode if body_scan else "none",
        scan_offload=r.ac_offload if scan else "none",
        loss_parallel=r.loss_parallel and tp,
        fused_loss=fused,
        document_mask=r.document_mask,
        restart_positions=r.document_mask and r.document_positions == "restart",
        pipeline=(
            PipelinePlan(
                pp=r.pp_degree,
                schedule=r.pp_schedule,
                num_virtual=r.pp_stages_per_rank,
                microbatches=r.pp_m,
                first_stage_less=r.pp_first_less,
                last_stage_less=r.pp_last_less,
                uniform=r.mode == "graph",
                scan_iterations=r.pp_scan_iterations,
            )
            if r.pp_degree > 1
            else None
        ),
    )
