"""The recipe schema: one dataclass per TOML section, each field's docstring its documentation.

`docs/config.md` is generated from these strings (scripts/dev/gen_config_docs.py). A field's
`metadata` holds what `trainer.config.load` checks on every value: `choices` (the allowed
strings, the same tuples the code that reads them defines) or a `ge`/`gt`/`le` range.
`Config` holds one instance per section; `SECTIONS` maps a section name to its class.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from models.common.quantize import RECIPES
from parallelisms.activation_checkpoint import AC_MODES
from parallelisms.pipeline_parallel import SCHEDULES as PIPELINE_SCHEDULES
from parallelisms.quantize import DEFAULT_FILTER_FQNS, DEFAULT_MIN_DIM
from parallelisms.replicate_reduce import REPLICATE_REDUCE, REPLICATE_REDUCE_DTYPES
from titan_kernels import ATTENTION_BACKENDS
from trainer.checkpoint import ASYNC_MODES, HF_CONFIG_MISMATCH, INITIAL_LOAD_FORMATS
from trainer.optim import DECAY_TYPES, OPTIMIZERS
from trainer.runtime.device import COMPUTE_DTYPES, DEVICE_TYPES, HOST_MALLOC, PROBE_DTYPES
from trainer.runtime.tpu_env import FLAG_BUNDLES
from trainer.step.plan import AC_OFFLOADS, BACKENDS, DOCUMENT_POSITIONS, FUSED_LOSS, MODES, ROUTINGS
from trainer.tasks.flow import TIMESTEP_SAMPLING


def _choices(*values: str) -> dict:
    return {"choices": values}


def _range(ge: float | None = None, gt: float | None = None, le: float | None = None) -> dict:
    return {"ge": ge, "gt": gt, "le": le}


@dataclass
class JobConfig:
    dump_folder: str = "./outputs/llama3_debug"
    """Folder for everything a run writes: metrics.jsonl, tb/, checkpoints/, config.toml."""
    description: str = ""
    """Free text shown at start-up and stored in config.toml."""
    target: str = ""
    """The slice or cluster the recipe is written for (e.g. `v7x-512`, `v6e-256`; see
    `scripts/estimate.py --list-targets`); "" for a recipe that runs anywhere.
    `scripts/check_recipe.py` runs the trainer's start-up at this target's world size on a fake
    process group and plans its memory there (docs/recipe_check.md); the trainer itself runs on
    what it is given."""


@dataclass
class ModelConfig:
    name: str = "llama3"
    """Model family: llama3 | qwen3 | qwen3_5 | deepseek_v3 | deepseek_v4 | gpt_oss | flux | hf (qwen3: dense and MoE
    flavors; qwen3_5: Qwen 3.5 dense and MoE, Gated DeltaNet / gated full attention, docs/models.md;
    deepseek_v3: DeepSeek-V3 and Kimi K2, MLA + DeepSeek MoE, docs/models.md; deepseek_v4: DeepSeek-V4,
    hyper-connections, compressed sparse attention, hash-routed MoE, docs/models.md; gpt_oss: gpt-oss 20B and
    120B, attention sinks, docs/models.md; flux: the FLUX.1
    diffusion transformer, docs/flux.md; hf: any transformers causal LM from `hf_config`,
    docs/hf_backend.md), or `package.module:NAME` of a
    `models.ModelFamily` defined outside this repository (docs/adding_a_model.md)."""
    flavor: str = "debugmodel"
    """Size of the family, e.g. debugmodel, 1B, 8B, 70B, 405B (hf: its one flavor, config); qwen3's MoE flavors are
    debugmodel_moe, 30B-A3B, 235B-A22B; deepseek_v3's are debugmodel, 16B, 671B, kimi_k2 (see docs/models.md)."""
    attn_backend: str = field(default="auto", metadata=_choices(*ATTENTION_BACKENDS))
    """Implementation of the attention op (titan_kernels/): auto (the CPU kernel for small head dims
    on the CPU, splash on TPU, SDPA elsewhere), sdpa, cpu_kernel, or splash (Pallas, TPU only;
    see docs/attention.md)."""
    tokenizer: str = "bundled"
    """`bundled` (the shipped 4096-token BPE) or a path to a tiktoken BPE file such as Llama 3's
    tokenizer.model."""
    hf_config: str = ""
    """With name = "hf" (and flavor = "config"): a local directory holding a Hugging Face
    config.json, or the file; the `transformers` causal LM it describes is trained (nothing is
    downloaded; docs/hf_backend.md). Empty for the other families."""
    overrides: dict = field(default_factory=dict)
    """Not a TOML key: any other key under [model] overrides that field of the flavor's args
    (e.g. n_layers = 4)."""


@dataclass
class TrainingConfig:
    dataset: str = "bundled"
    """`bundled` (the shipped offline corpus), a local file or glob (json, jsonl, parquet, txt),
    or a Hugging Face hub dataset name when online (see docs/data.md). FLUX (task flow):
    `procedural` (the captioned-shapes set, built and cached on first use; `bundled` means the
    same) or a folder written by scripts/data/build_flux_data.py (docs/flux.md)."""
    dataset_text_field: str = "text"
    """Field holding the document text in json/jsonl/parquet/hub datasets."""
    dataset_shards: int = field(default=0, metadata=_range(ge=0))
    """Virtual data shards S of the training stream (LM task; docs/data.md): global window g comes
    from shard g mod S, so each data-parallel rank reads and tokenizes only S/D shards (whole
    files when the data has >= S files, else every S-th document). Must be a multiple of the
    global micro-batch (dp degree x local batch); 0 = auto: lcm(64, dp degree x local batch),
    i.e. 64 whenever that divides 64, or 1 when the data would leave one of those shards
    without text (a few documents, one file: read as one stream, docs/data.md). Part of the
    data order: a checkpoint resumes only with the same value."""
    local_batch_size: int = field(default=8, metadata=_range(ge=1))
    """Sequences per micro-batch on each data-parallel rank; with global_batch_size set, the
    largest micro-batch allowed (the split follows the mesh)."""
    global_batch_size: int = field(default=-1, metadata=_range(ge=-1))
    """Sequences per optimizer step over all data-parallel ranks; -1 (or 0) = local_batch_size x
    dp degree x gradient_accumulation_steps. When set, the micro-batch and the accumulation
    count follow from the mesh (accumulation grows from gradient_accumulation_steps until the
    micro-batch fits local_batch_size), so a recipe trains the same from 1 to 256 devices."""
    seq_len: int = field(default=2048, metadata=_range(ge=2))
    """Tokens per sequence."""
    steps: int = field(default=1000, metadata=_range(ge=1))
    """Optimizer steps to train (the run ends at this step, counting resumed steps)."""
    gradient_accumulation_steps: int = field(default=1, metadata=_range(ge=1))
    """Micro-batches per optimizer step. Global batch = local_batch_size x dp degree x this
    (with global_batch_size set: the smallest accumulation count allowed)."""
    max_norm: float = field(default=1.0, metadata=_range(ge=0))
    """Global-norm gradient clipping threshold; 0 disables clipping (the norm is still logged)."""
    seed: int = 42
    """Seed for weights, data order and dropout-free RNG state; runs are deterministic under it."""
    mixed_precision_param: str = field(default="bfloat16", metadata=_choices(*COMPUTE_DTYPES))
    """Compute dtype of parameters in forward/backward. Master weights and optimizer state stay
    float32. `float32` trains in pure fp32. `auto`: bfloat16 on TPU and GPU; on the CPU the
    faster of the two by a matmul probe, measured once per machine (CPU model, torch version,
    thread count) and cached in $TITAN_CACHE/cpu_matmul_probe.json; the start-up line says what
    was chosen and why (docs/training.md)."""
    mixed_precision_reduce: str = field(default="float32", metadata=_choices(*PROBE_DTYPES))
    """Dtype of gradient reductions across data-parallel ranks (with `replicate_reduce = "step"`:
    the reduce-scatter over dp_shard; `replicate_reduce_dtype` sets the dp_replicate one)."""
    replicate_reduce: str = field(default="micro_batch", metadata=_choices(*REPLICATE_REDUCE))
    """When gradients are averaged over `dp_replicate` (HSDP's replicas; on a multislice job the
    axis across slices, over the data-center network). micro_batch: in each micro-batch's
    backward, with the dp_shard reduce-scatter (one all-reduce per micro-batch). step: once per
    optimizer step, after the last micro-batch: the gradients in ~25 MB buckets issued during that
    micro-batch's backward as they become final (eager and compile modes) or as graph ops the
    compiler schedules (graph mode); gradient accumulation then pays the replica all-reduce once
    instead of once per micro-batch. Same result up to fp32 summation order. docs/parallelism.md,
    "Gradient reduction across replicas"."""
    replicate_reduce_dtype: str = field(default="float32", metadata=_choices(*REPLICATE_REDUCE_DTYPES))
    """What the once-per-step reduction over `dp_replicate` sends. float32: an fp32 all-reduce.
    bfloat16: bf16 on the wire with fp32 accumulation (an all-to-all of bf16 chunks, an fp32 sum,
    an all-gather of the bf16 mean): the bytes of a bf16 all-reduce, half of fp32's, each
    replica's gradient and the mean rounded once to bf16, no partial sum rounded. Needs
    `replicate_reduce = "step"`."""
    aux_loss_coef: float = field(default=0.001, metadata=_range(ge=0))
    """Weight of the MoE load-balancing loss added to the LM loss (MoE models only)."""
    expert_bias_rate: float = field(default=0.001, metadata=_range(ge=0))
    """Auxiliary-loss-free balancing (MoE routers with a selection bias: deepseek_v3, Qwen 3 MoE
    with `[model] moe_expert_bias = true`): after each step every expert's bias moves by this
    much towards balance, `bias += rate * sign(mean load - load)` over the global batch
    (DeepSeek-V3's gamma: 0.001; 0 freezes the bias). docs/moe.md."""
    fused_loss: str = field(default="auto", metadata=_choices(*FUSED_LOSS))
    """LM loss from the final hidden states by `ops.linear_cross_entropy`, chunked over the
    vocabulary (a Pallas kernel on TPU): the [tokens, vocab] logits and their fp32 copy never
    exist whole. auto: on for TPU, off elsewhere; on: every device (not with tensor
    parallelism, which shards the vocabulary); off: logits, then fp32 cross entropy."""
    document_mask: bool = False
    """LM task: attention never crosses a document boundary inside a packed window. The loader
    emits each window's document ids (a new document starts after each EOS token), the model
    passes them to every attention call (a block-diagonal causal mask: SDPA on CPU/GPU, splash
    with segment ids on TPU). The loss and the data order are unchanged. Families with
    `ModelFamily.document_mask` only: the step plan's rule names them (docs/rules.md,
    docs/data.md#document-masking)."""
    document_positions: str = field(default="global", metadata=_choices(*DOCUMENT_POSITIONS))
    """RoPE positions with `document_mask`: global = the token's place in the packed window
    (0..seq_len-1, as without masking); restart = its place in its own document (0 at each
    document start, as if the document were trained alone). restart needs document_mask = true."""
    skip_nonfinite_updates: bool = False
    """A step whose gradient norm is not finite never updates the weights (the update is skipped
    on the device). false: the run stops with an error at the next logged or checkpoint step,
    naming the first such step, before any checkpoint is written. true: training goes on and
    metrics.jsonl counts the skipped updates (`skipped_updates`)."""
    startup_timeout_s: float = field(default=900.0, metadata=_range(gt=0))
    """Seconds every rank waits at each start-up barrier for the others: right after the process
    group is created (tag `process-group`: a rank frozen before its first collective) and after
    the model, optimizer and checkpoint are ready, before the first step compiles; past it the run
    stops with an error naming the ranks that did not arrive (docs/launch.md). It also bounds every
    call to object storage (gs://): no answer within it is one error line naming the endpoint
    (docs/checkpointing.md)."""
    collective_timeout_s: float = field(default=1800.0, metadata=_range(gt=0))
    """Seconds a collective (and the checkpoint's process group) waits for a peer before it fails:
    the bound on noticing a lost host or slice whose connections stay half-open. A failed
    collective ends the run with exit 75 (relaunch resumes from the newest complete checkpoint
    tier). Long enough for the slowest first-step compile of the recipe."""
    hang_dump_factor: float = field(default=10.0, metadata=_range(ge=0))
    """Step watchdog: when a step runs longer than this many times the median of the recent steps
    (and at least `hang_dump_min_s`), every thread's Python stack is written to stderr and
    `hang_rank{R}.txt` in the dump folder. 0 turns the watchdog off."""
    hang_dump_min_s: float = field(default=300.0, metadata=_range(gt=0))
    """Lower bound, in seconds, of the step watchdog's threshold (the first step, which compiles,
    is never judged: the watchdog starts after one finished step)."""


@dataclass
class OptimizerConfig:
    name: str = field(default="adamw", metadata=_choices(*OPTIMIZERS))
    """adamw, or muon: Newton-Schulz orthogonalised momentum for the 2-D (and expert 3-D) weight
    matrices of the blocks, AdamW (betas, eps) for embeddings, output head, router gate, norms
    and biases (docs/optimizers.md). Muon's update RMS is matched to AdamW's
    (0.2 x sqrt(max(rows, cols))), so lr and weight_decay apply to both kinds of parameters."""
    lr: float = field(default=8e-4, metadata=_range(gt=0))
    """Peak learning rate."""
    weight_decay: float = field(default=0.1, metadata=_range(ge=0))
    """Decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """Adam betas [beta1, beta2], each in [0, 1)."""
    eps: float = field(default=1e-8, metadata=_range(gt=0))
    """Adam epsilon."""
    muon_momentum: float = field(default=0.95, metadata=_range(ge=0))
    """name = muon: momentum (beta) of the Muon matrices, in [0, 1)."""
    muon_nesterov: bool = True
    """name = muon: Nesterov momentum (the published default)."""
    muon_ns_steps: int = field(default=5, metadata=_range(ge=1))
    """name = muon: quintic Newton-Schulz iterations (5 as published)."""
    muon_ns_dtype: str = field(default="bfloat16", metadata=_choices("bfloat16", "float32"))
    """name = muon: dtype of the Newton-Schulz iteration (bf16 as published: the iteration only
    needs the singular values pushed into ~[0.7, 1.2]; float32 for exact comparisons)."""
    muon_exclude: list[str] = field(
        default_factory=lambda: ["tok_embeddings", "output", "gate", "embed_tokens", "lm_head"]
    )
    """name = muon: module-path components (names between dots) whose matrices stay on AdamW:
    default the token embedding, the output head and the MoE router gate (this tree's names and
    the hf backend's; a FLUX model's matrices all take Muon unless listed here)."""
    qk_clip_tau: float = field(default=0.0, metadata=_range(ge=0))
    """name = muon: MuonClip's QK clip. After each step, a head whose largest pre-softmax logit
    of the step (the logit the softmax sees, max over the global batch) exceeded tau has its
    logits scaled by tau / max through its weights (MHA: W_q and W_k rows by sqrt(tau / max);
    GQA: its W_q rows by tau / max; MLA (deepseek_v3): the nope rows of W_q and of W_kv_b's key
    half by sqrt(tau / max), the rope q rows by tau / max; docs/optimizers.md). Kimi K2 uses 100.
    0 = off (no logit tracking, no cost). Eager mode (compile mode untested), with SimpleFSDP
    and TP; not with graph mode, context parallelism or q/k-norm models (Qwen 3)."""


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = field(default=200, metadata=_range(ge=0))
    """Steps of linear warmup from ~0 to the peak lr (lr = peak x step / warmup_steps). A run
    shorter than this stops part-way up the ramp and never reaches the peak."""
    decay_type: str = field(default="linear", metadata=_choices(*DECAY_TYPES))
    """Decay after warmup: linear or cosine down to min_lr_factor x lr over the remaining steps;
    wsd (warmup-stable-decay) holds the peak and decays linearly over the last decay_ratio of
    the steps; constant keeps the peak."""
    decay_ratio: float = field(default=0.2, metadata=_range(gt=0, le=1))
    """Fraction of all steps spent decaying, for decay_type = wsd."""
    min_lr_factor: float = field(default=0.1, metadata=_range(ge=0, le=1))
    """Final lr as a fraction of the peak lr."""


@dataclass
class ParallelismConfig:
    data_parallel_replicate_degree: int = field(default=1, metadata=_range(ge=1))
    """Replicas for HSDP/DDP (parameters replicated across this mesh axis)."""
    data_parallel_shard_degree: int = -1
    """SimpleFSDP shard degree; -1 fills the ranks the other degrees leave."""
    tensor_parallel_degree: int = field(default=1, metadata=_range(ge=1))
    """Tensor (and sequence) parallel degree."""
    expert_parallel_degree: int = field(default=1, metadata=_range(ge=1))
    """Expert parallel degree for MoE models, carved out of the data-parallel ranks."""
    context_parallel_degree: int = field(default=1, metadata=_range(ge=1))
    """Context parallel degree: each sequence split over this many ranks with causal load
    balancing (chunks r and 2 cp - 1 - r of 2 cp), RoPE positions per shard, keys/values
    all-gathered over cp for attention and the loss normalised by the global token count
    (docs/context_parallel.md). The cp ranks of a data-parallel group read the same rows;
    SimpleFSDP shards parameters over dp_shard x cp. `training.seq_len` must divide by
    2 x cp (and by 2 x cp x tp with tensor parallelism). LM families that take RoPE positions
    (`ModelFamily.document_mask`: the step plan's rule names them, docs/rules.md) only: not FLUX,
    the hf backend or the RL engine."""
    enable_loss_parallel: bool = False
    """With TP, compute the cross entropy on vocab-sharded logits instead of gathering them."""
    num_slices: int = field(default=0, metadata=_range(ge=0))
    """TPU slices the job spans (multislice: slices joined over the data-center network, DCN).
    0 = from the launcher's environment (`MEGASCALE_NUM_SLICES`, else 1); a value > 0 must agree
    with it when it is set. The DCN split is put on `dp_replicate`: HSDP shards inside a slice and
    all-reduces gradients across slices, so `data_parallel_replicate_degree` must be a multiple of
    the slice count (docs/launch.md, "Several slices"). With graph-mode pipeline parallelism the
    stages take the slices first (pp outermost over the DCN): `pipeline_parallel_degree x
    data_parallel_replicate_degree` must be a multiple (docs/pipeline_parallel.md, "Across slices")."""
    device_order: str | list[int] = "auto"
    """Which launcher rank (device) takes which place of the mesh. The mesh is always built in
    rank order, so a rank's shard is the same number in every parallelism, DCP and the initial
    loads; a device layout renumbers the processes instead (docs/parallelism.md, "Device order").
    identity: place p is launcher rank p; auto: torch-tpu's layout on a TPU whose slice is known
    at start-up (`[job] target` or the launcher's topology), identity elsewhere; a TPU target
    (e.g. `v6e-8`, `tpu7x-8`, `v6e-256`; its device count is the world size per slice): that
    slice's torch-tpu order, also on CPU/GPU ranks (how the tests run a TPU's order); or a
    permutation of the ranks, a list such as [0, 1, 3, 2] (`--parallelism.device_order=0,1,3,2`):
    place p <- launcher rank order[p]."""
    pipeline_parallel_degree: int = field(default=1, metadata=_range(ge=1))
    """Pipeline parallel degree: the outermost mesh axis (`pp`); each pp rank holds consecutive
    layers (the first stage the embedding, the last the norm and output head) and the other degrees
    apply inside it. Eager mode on CPU/GPU, or graph mode (the pipeline inside the captured step, GPipe,
    uniform stages: the TPU path, also across slices), dense decoder families without tied embeddings,
    composed with SimpleFSDP/HSDP, TP (sequence parallel, in both modes), activation checkpointing and
    gradient accumulation (docs/pipeline_parallel.md; the step plan's rules list what it does not
    compose with yet)."""
    pipeline_schedule: str = field(default="1F1B", metadata=_choices(*PIPELINE_SCHEDULES))
    """The pipeline schedule (TorchTitan's names, `torch.distributed.pipelining`): GPipe and 1F1B hold
    one stage per pp rank; Interleaved1F1B, LoopedBFS and InterleavedZeroBubble hold
    `pipeline_virtual_stages` per rank (loop order), ZBVZeroBubble two (V order)."""
    pipeline_microbatches: int = field(default=0, metadata=_range(ge=0))
    """Micro-batches the schedule splits each rank's local batch into (0: the number of stages,
    pp x virtual stages); must divide `training.local_batch_size` as the batch split resolves it.
    With gradient accumulation every accumulation micro-batch is split again."""
    pipeline_virtual_stages: int = field(default=0, metadata=_range(ge=0))
    """Stages per pp rank for the multi-stage schedules (0: 2); GPipe and 1F1B take 1, ZBVZeroBubble 2."""
    pipeline_first_stage_less_layers: int = field(default=1, metadata=_range(ge=0))
    """Blocks the first stage holds fewer than the others, for the embedding it also runs."""
    pipeline_last_stage_less_layers: int = field(default=1, metadata=_range(ge=0))
    """Blocks the last stage holds fewer than the others, for the final norm and output head."""
    allow_dcn_sharding: bool = False
    """Let a layout put FSDP (or TP/EP/CP) traffic on the DCN, i.e. `num_slices` that does not
    divide `data_parallel_replicate_degree`; refused otherwise (a per-layer collective over DCN is
    ~10-50x slower than over ICI)."""


@dataclass
class CompileConfig:
    mode: str = field(default="eager", metadata=_choices(*MODES))
    """eager: plain PyTorch; compile: torch.compile per block; graph: the whole train step as
    one captured FX graph (docs/graph_trainer.md)."""
    backend: str = field(default="auto", metadata=_choices(*BACKENDS))
    """Compiler backend; auto = inductor on cpu/cuda, tpu on TPU."""
    scan_layers: bool = False
    """Graph mode: run the repeated block as one scan over stacked layer parameters."""
    scan_pipeline_iterations: bool = False
    """Graph mode with pipeline_parallel_degree > 1: run the pipeline's m + p - 1 iterations as one
    scan (one copy of the stage and of its permutes in the program, whatever the micro-batch count;
    MaxText's `scan_pipeline_iterations`) instead of unrolled. Composes with SimpleFSDP, context and
    expert parallelism; not with tensor parallelism or scan_layers. Activation checkpointing does not
    reach its body yet (the blocks' activations are kept: +2.9 GiB on an 8B v6e-8 program).
    docs/pipeline_parallel.md, "A scan over the iterations"."""
    dump_graph: str = ""
    """Graph mode: write the captured graph as text to this path (relative to dump_folder)."""
    bucket_cap_mb: float = field(default=0.0, metadata=_range(ge=0))
    """Graph mode, inductor backend: merge the step's independent all-gathers and reduce-scatters
    (SimpleFSDP's per-parameter ones) into buckets of at most this many MB each, one collective
    per bucket (Inductor's FX bucketing); 0 = one collective per parameter. The TPU backend
    leaves combining to XLA. See docs/parallelism.md."""
    gloo_all_to_all: bool = True
    """Graph mode, CPU (gloo) process groups: run each reduce-scatter as an all-to-all and a
    local sum, moving the gradient in its own dtype (bf16) before the up-cast to reduce_dtype:
    gloo's reduce-scatter all-reduces the whole tensor, twice the traffic. The result is the
    same (the cast is exact; with more than 2 ranks the sum's order may differ). false = gloo's
    reduce-scatter. Other backends ignore it. See docs/parallelism.md."""
    cache_dir: str = ""
    """TPU: torch-tpu's persistent compilation cache, a local directory or a gs:// path shared by
    every process and run (TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT): a relaunch, a resumed run or
    another host loads the compiled programs instead of compiling them again. "" = off (or what
    the environment already exports). Every pod recipe sets a per-host path
    (~/.cache/titan-tpu/torch_tpu_compile); on a pod a gs:// bucket every host can read shares
    one cache. Ignored on cpu/cuda. See docs/tpu.md, "Compile cache"."""
    host_cache: bool = False
    """TPU: names torch-tpu's host-local compilation cache titan-tpu (TORCH_TPU_TIER2_COMPILATION_CACHE,
    under /dev/shm), through which the processes of one host compile each program once between
    them. torch-tpu turns that cache on by itself in every run of more than one process (name
    'default') and off in a world of 1, so this only names it; the banner's compilation-cache line
    says which tiers are on. Every pod recipe sets it. Ignored on cpu/cuda."""


@dataclass
class ActivationCheckpointConfig:
    mode: str = field(default="none", metadata=_choices(*AC_MODES))
    """Recompute activations in backward: none, full (each block), selective (op-level policy),
    full_save_attention (full, but the attention kernels' output and log-sum-exp are kept, so
    the backward does not run the attention forward again: MaxText's policies that save the
    attention output, TorchTitan's SAC saving SDPA; 2 x head width + 4 x heads bytes per token
    and block more than full). The modes and what each keeps: parallelisms/activation_checkpoint.py."""
    offload: str = field(default="none", metadata=_choices(*AC_OFFLOADS))
    """none, or block_inputs: the block inputs the layer scan saves for the backward
    (`[n_layers, batch, seq, dim]`, the largest activation term with full checkpointing) are
    stacked in host memory one row per block and read back row by row in the backward (MaxText's
    `decoder_layer_input=offload`). Needs compile.mode = "graph", scan_layers = true and mode =
    "full". On TPU the rows go to pinned host memory; on the CPU they are plain copies (same
    numbers); on CUDA nothing moves. docs/graph_trainer.md#host-offload-of-the-saved-block-inputs."""


@dataclass
class CheckpointConfig:
    enable: bool = False
    """Save DCP checkpoints and resume from the newest one in `folder`."""
    folder: str = "checkpoints"
    """Checkpoint folder, relative to dump_folder."""
    interval: int = field(default=500, metadata=_range(ge=1))
    """Save every `interval` steps (and at the last step)."""
    keep_latest_k: int = field(default=3, metadata=_range(ge=0))
    """Keep only the newest k checkpoints; 0 keeps all."""
    async_mode: str = field(default="disabled", metadata=_choices(*ASYNC_MODES))
    """disabled: blocking save; async: write in the background (dcp.async_save)."""
    load_step: int = -1
    """Resume from this step's checkpoint instead of the newest; -1 = newest. Weights, optimizer
    moments, data position and RNG come from the checkpoint; lr, lr schedule, betas, eps and
    weight_decay from this config (docs/checkpointing.md), so a rollback can lower the lr."""
    initial_load_path: str = ""
    """Weights to start from when the run has no checkpoint of its own (model only)."""
    initial_load_format: str = field(default="dcp", metadata=_choices(*INITIAL_LOAD_FORMATS))
    """Format of initial_load_path: dcp (a checkpoint folder) or hf (safetensors + config.json)."""
    hf_config_mismatch: str = field(default="error", metadata=_choices(*HF_CONFIG_MISMATCH))
    """initial_load_format = hf: what to do when the recipe's model differs from the architecture
    in the weights' config.json (rope_theta, RoPE scaling, norm eps, head counts, ...): error
    refuses to start and names the fields; override trains the recipe's model anyway (e.g. a
    new rope_theta for context extension) and prints each difference."""
    fallback_on_corrupt: bool = False
    """When the newest checkpoint fails its checksums (manifest.json), resume from the newest
    older one that passes instead of stopping with an error naming the file and that step.
    Never applies to an explicit load_step."""
    local_folder: str = ""
    """The local tier (docs/checkpointing.md, "Multi-tier checkpoints"): an absolute path on each
    host's own disk (or tmpfs) where every rank writes its own shards every `local_interval` steps,
    in `rank-R/step-N` (R: the rank's place inside its slice), and a resume takes the newest step
    complete on every surviving rank when it is newer than `folder`'s. The replica of a lost
    slice's shards is the same rank of another slice (HSDP); data position and every rank's RNG
    are in each rank's files. Empty: no local tier. Not gs://."""
    local_interval: int = field(default=50, metadata=_range(ge=1))
    """Write the local tier every `local_interval` steps (blocking, local disk; the newest 2 kept
    per rank). Meant to be smaller than `interval`."""


@dataclass
class MetricsConfig:
    log_freq: int = field(default=10, metadata=_range(ge=1))
    """Log a console line and a metrics.jsonl record every log_freq steps."""
    enable_tensorboard: bool = True
    """Also write TensorBoard scalars to dump_folder/tb."""


@dataclass
class ValidationConfig:
    enable: bool = False
    """Evaluate the loss on a held-out split every `freq` steps."""
    dataset: str = "bundled"
    """Validation data: `bundled` (the corpus's held-out split) or a file/glob/hub name."""
    freq: int = field(default=100, metadata=_range(ge=1))
    """Validate every `freq` steps."""
    steps: int = field(default=10, metadata=_range(ge=1))
    """Micro-batches per validation (same local_batch_size and seq_len as training)."""


@dataclass
class ProfilingConfig:
    enable: bool = False
    """Record a profile of every `freq`-th step: torch.profiler's Chrome trace on cpu/cuda; on a
    TPU torch-tpu's profiler (TpuProfilerConfig), an XPlane file that xprof / TensorBoard read."""
    freq: int = field(default=100, metadata=_range(ge=1))
    """Trace every `freq`-th step (steps freq, 2 x freq, ...); each trace covers one whole step."""
    folder: str = "profile_traces"
    """Trace folder, relative to dump_folder."""


@dataclass
class FlowConfig:
    timestep_sampling: str = field(default="logit_normal", metadata=_choices(*TIMESTEP_SAMPLING))
    """Flow models (FLUX): how the rectified-flow time t in (0, 1) is drawn per sample: uniform,
    or logit_normal (t = sigmoid(z), z ~ N(logit_mean, logit_std), SD3's choice: more weight on
    the middle of the trajectory). See docs/flux.md; LM recipes ignore [flow]."""
    logit_mean: float = 0.0
    """Mean of z for timestep_sampling = logit_normal."""
    logit_std: float = field(default=1.0, metadata=_range(gt=0))
    """Standard deviation of z for timestep_sampling = logit_normal."""
    shift: float = field(default=1.0, metadata=_range(gt=0))
    """Fixed timestep shift t' = shift t / (1 + (shift - 1) t) applied after sampling; 1.0 = none,
    > 1 spends more steps at high noise (SD3 uses 3.0 at 1024 px)."""
    resolution_shift: bool = False
    """Shift by the image token count instead, as FLUX does: shift = exp(mu), mu linear in the
    tokens from 0.5 at 256 tokens to 1.15 at 4096 (1.65 at 256 px, 3.16 at 1024 px). Needs
    shift = 1.0."""
    text_dropout: float = field(default=0.1, metadata=_range(ge=0, le=1))
    """Probability that a sample's text conditioning is dropped (classifier-free guidance
    training): its T5 sequence and CLIP vector become zeros, the conditioning the sampler's
    unconditional branch feeds."""
    guidance: float = field(default=1.0, metadata=_range(ge=0))
    """Value fed to the guidance embedding of a model that has one (FLUX.1-dev; schnell has
    none and ignores this). Pre-training from scratch has no teacher to distil guidance from,
    so a constant is fed and the embedding learns a fixed offset; 1.0 means no guidance."""
    latent_size: int = field(default=0, metadata=_range(ge=0))
    """Side of the VAE latent the data set holds (128 for 1024 px with FLUX's 8x VAE: 64 x 64 =
    4096 image tokens after 2x2 packing); 0 = whatever the data holds. When set, the data must
    match (the planner and pod recipes read it)."""
    text_seq_len: int = field(default=0, metadata=_range(ge=0))
    """T5 tokens per caption in the data set (256 for schnell, 512 for dev); 0 = whatever the
    data holds. When set, the data must match."""
    sample_prompts: int = field(default=0, metadata=_range(ge=0))
    """At each validation, sample this many distinct held-out captions (colour/shape/position
    combinations never trained on) with the Euler sampler and log the image grid to TensorBoard
    (`samples`); 0 = no grid. Needs validation.enable and metrics.enable_tensorboard."""
    sample_steps: int = field(default=20, metadata=_range(ge=1))
    """Euler steps per validation sample (trainer/tasks/flux_sample.py)."""
    cfg_scale: float = field(default=4.0, metadata=_range(ge=1))
    """Classifier-free guidance scale of the validation samples (1 = conditional only)."""


@dataclass
class DeviceConfig:
    type: str = field(default="auto", metadata=_choices(*DEVICE_TYPES))
    """auto picks tpu if torch-tpu found a TPU, else cuda if available, else cpu."""
    host_malloc: str = field(default="auto", metadata=_choices(*HOST_MALLOC))
    """How the process's C heap (glibc malloc; CPU tensors live there) treats large blocks:
    `retain` keeps freed memory in the heap for the next step (no mmap per large block, no
    trim), `system` keeps glibc's defaults (blocks above 32 MiB are mapped and unmapped on every
    allocation, so each step faults their pages in again); `auto` = retain on the CPU device,
    system on accelerators. Measured on the CPU: docs/graph_trainer.md, "Scan performance"."""
    flag_bundle: str = field(default="auto", metadata=_choices(*FLAG_BUNDLES))
    """TPU: the recorded XLA / libtpu flags to start from (assets/tpu_flags.toml, each flag with
    its source): auto = the bundle of the host's generation (v4, v5e, v5p, v6e, v7x), none, or a
    bundle's name (refused on another generation). Ignored on cpu/cuda. See docs/tpu.md, "XLA and
    libtpu flags"."""
    libtpu_init_args: list[str] = field(default_factory=list)
    """TPU: extra flags for LIBTPU_INIT_ARGS, e.g. ["--xla_tpu_scoped_vmem_limit_kib=65536"]; a
    flag here replaces the bundle's flag of the same name, a flag already exported in the
    environment replaces both. Set before the TPU runtime starts; a name the installed libtpu
    does not know stops the run with an error. Ignored on cpu/cuda."""
    xla_flags: list[str] = field(default_factory=list)
    """TPU: extra flags for XLA_FLAGS, merged like libtpu_init_args. Ignored on cpu/cuda."""


@dataclass
class MoEConfig:
    capacity_factor: float = 0.0
    """0 (the default): dropless, every token reaches its k experts. > 0: the capacity-bounded
    dispatch, each expert taking at most `ceil(capacity_factor x seq_len x top_k / num_experts)`
    token copies per sequence (first choices before second choices, then by position); copies
    over it are dropped (logged per step as moe_dropped and moe_dropped_pct) and every buffer is
    `capacity_factor x tokens x top_k` rows instead of the dropless static dispatch's `ep x tokens
    x top_k`. The same copies drop on any mesh. 1.0-1.5 is usual; needs a model with experts and
    tensor_parallel_degree = context_parallel_degree = 1 (whole sequences per rank).
    docs/moe.md#capacity-factor."""
    dispatch_chunks: int = field(default=1, metadata=_range(ge=1))
    """With a capacity (capacity_factor > 0) under expert parallelism: the capacity buffer crosses
    the all-to-all in this many row chunks, each chunk sent, run through the experts and sent back
    on its own. The products are the same; what changes is the program's dependences: one chunk's
    all-to-all does not wait for another chunk's expert matmuls, so XLA on TPU (with asynchronous
    all-to-alls, `--xla_tpu_enable_async_all_to_all=true` in `[device] libtpu_init_args`) can run
    them side by side instead of leaving every all-to-all exposed. 1 (the default): one all-to-all
    each way per layer. Needs capacity_factor > 0. docs/moe.md#dispatch-chunks."""
    routing: str = field(default="learned", metadata=_choices(*ROUTINGS))
    """Which experts each token goes to: `learned` (the router's top k; the only choice for
    training a model), `random` (a seeded draw per token, step and layer: k distinct experts
    uniformly; the same on every mesh) or `balanced` (round-robin: every expert the same count).
    random and balanced are for throughput benchmarks only (MaxText's published MoE numbers use
    random routing): the router still runs and its scores still weight the expert outputs, only
    the choice is replaced. Needs routing_benchmark_only = true and a model with experts.
    docs/moe.md#benchmark-routing."""
    routing_benchmark_only: bool = False
    """Marks the recipe as a throughput benchmark whose loss is not a model's: required for
    routing = random or balanced, so a training recipe cannot carry them by accident."""


@dataclass
class QuantizeConfig:
    recipe: str = field(default="none", metadata=_choices(*RECIPES))
    """Low-precision matmuls for the model's linear layers (forward and both gradients; master
    weights, optimizer state and the gradient reduction keep their precision): `none`,
    `float8_tensorwise` (one dynamic scale per tensor; e4m3, gradients e5m2), `float8_rowwise`
    (a power-of-two scale per row of each matmul operand; e4m3), `float8_blockwise` (DeepSeek-V3:
    1x128 activation tiles, 128x128 weight blocks; e4m3) or `int8` (per-token activations,
    per-channel weights; the weight gradient in the compute dtype). Each device runs the recipes
    its matrix units run natively (v7x: float8; v4/v5e/v5p/v6e: int8; CUDA sm89+: float8
    tensorwise/rowwise, sm80+: int8); the CPU runs every recipe as the exact emulation. The rules
    refuse the rest. docs/low_precision.md."""
    filter_fqns: list[str] = field(default_factory=lambda: list(DEFAULT_FILTER_FQNS))
    """Module-path substrings whose linears stay in the compute dtype (TorchTitan's name); the
    default keeps the output head and the MoE router out. MoE experts (grouped weights) are
    quantized too, by the same rule on (dim, moe hidden) (their matmuls go through
    `quantized_grouped_mm`); "experts" here leaves them in the compute dtype. The start-up banner
    says how many linears and expert layers were quantized and how many each key left out."""
    min_dim: int = field(default=DEFAULT_MIN_DIM, metadata=_range(ge=0))
    """Linears whose in or out features are below this stay in the compute dtype (the automatic
    filter: small matmuls gain less than quantizing costs); in and out features must also be
    multiples of 16. 0 quantizes every linear the filter allows (the CPU debug runs)."""
    fsdp_float8_all_gather: bool = False
    """SimpleFSDP all-gathers the quantized linears' weights as float8 e4m3 (1 byte per element,
    half bf16's traffic) instead of in the compute dtype, and the matmul uses the gathered float8
    weight as it is (TorchTitan's `enable_fsdp_float8_all_gather`). One all-reduce of the shards'
    amaxes gives each weight its scale before the gather; so only `float8_tensorwise` (one scale
    per tensor; a row or block scale would need the rows' amaxes across shards, and the gathered
    values then no longer feed a backward that scales along the other dim), and only with the
    weights sharded (`data_parallel_shard_degree` x `context_parallel_degree` > 1) and
    `tensor_parallel_degree = 1`. docs/low_precision.md."""


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    profiling: ProfilingConfig = field(default_factory=ProfilingConfig)
    flow: FlowConfig = field(default_factory=FlowConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    quantize: QuantizeConfig = field(default_factory=QuantizeConfig)


SECTIONS: dict[str, type] = {f.name: type(getattr(Config(), f.name)) for f in dataclasses.fields(Config)}
