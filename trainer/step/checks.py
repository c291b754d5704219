"""The refusals of combinations that cannot be rules over a `StepRequest`, named in one table.

`trainer/step/plan.py: RULES` refuses every combination of settings that a request states
before anything is built. What is left needs facts a request does not hold: the model's
arguments as resolved, the built model (its modules, its TP plan's styles, its scan form), the
mesh and the world, the optimizer's param groups, the captured graph, the data folder or the
host. Those checks stay where the facts are, each a `ConfigError` naming its config key;
`BUILD_CHECKS` names them (tests/unit/test_step_plan.py checks that each function exists and
raises a ConfigError naming its key), and docs/rules.md lists them under the rules.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BuildCheck:
    """A refusal made where its facts are: `where` is "module:function" (or "module:Class.method")."""

    key: str
    """The config key its message names (a section name when no one key is to blame)."""
    where: str
    what: str
    """What it refuses, in words."""


BUILD_CHECKS: tuple[BuildCheck, ...] = (
    # Resolving the model (before a request exists: these decide the family and its args).
    BuildCheck(
        "model.hf_config",
        "trainer.config.load:_validate_hf_config",
        'hf_config with a model.name other than "hf", or model.name = "hf" without one',
    ),
    BuildCheck(
        "model.max_seq_len",
        "trainer.config.load:resolve_model_args",
        "a max_seq_len override shorter than training.seq_len",
    ),
    # Degrees against the world and the model's sizes (plan_job, before anything is built).
    BuildCheck(
        "parallelism.data_parallel_shard_degree",
        "parallelisms.parallel_dims:ParallelDims.__post_init__",
        "degrees whose product is not the world size, or -1 that cannot fill it",
    ),
    BuildCheck(
        "training.global_batch_size",
        "trainer.job_plan:batch_split",
        "a global batch the data-parallel degree (the world's) does not divide, or that no accumulation count "
        "splits into micro-batches of at most local_batch_size",
    ),
    BuildCheck(
        "parallelism.num_slices",
        "parallelisms.parallel_dims:resolve_num_slices",
        "a slice count other than the launcher's MEGASCALE_NUM_SLICES, or a variable that is not a count",
    ),
    BuildCheck(
        "parallelism.num_slices",
        "parallelisms.parallel_dims:check_slice_major",
        "a rank whose MEGASCALE_SLICE_ID is not its slice in slice-major numbering (hosts not started "
        "through trainer.launch)",
    ),
    BuildCheck(
        "parallelism.device_order",
        "parallelisms.device_order:target_order",
        "a named layout whose devices per slice are not this world's",
    ),
    BuildCheck(
        "parallelism.device_order",
        "parallelisms.device_order:resolve_rank_order",
        "a permutation that is not of this world's ranks, or that moves a rank to another slice",
    ),
    BuildCheck(
        "parallelism.expert_parallel_degree",
        "parallelisms.parallel_dims:ParallelDims.__post_init__",
        "an EP degree that does not divide dp_shard x cp x tp",
    ),
    BuildCheck(
        "parallelism.tensor_parallel_degree",
        "parallelisms.parallel_dims:ParallelDims.validate_for_model",
        "a TP degree that does not divide the heads, kv heads, FFN / expert hidden size (or the sizes the "
        "model's shape lists in `tp_splits`: DeepSeek-V4's query heads and output groups) or the (per-CP-rank) "
        "sequence",
    ),
    BuildCheck(
        "parallelism.expert_parallel_degree",
        "parallelisms.parallel_dims:ParallelDims.validate_for_model",
        "EP > 1 for a model without experts, or a degree that does not divide the experts",
    ),
    BuildCheck(
        "parallelism.context_parallel_degree",
        "parallelisms.context_parallel:check_seq_len",
        "a sequence length not divisible by 2 x cp (two load-balanced chunks per rank)",
    ),
    # The mesh on the devices.
    BuildCheck(
        "parallelism.tensor_parallel_degree",
        "parallelisms.tpu_topology:_split_axes",
        "a mesh axis (tp, cp, ...: the key of that axis) that does not fit the TPU slice, not even "
        "splitting physical axes (plan_job, when the slice is known: `tpu_mesh_layout`)",
    ),
    BuildCheck(
        "parallelism",
        "parallelisms.tpu_topology:_whole_axes",
        "a mesh axis that is not a product of whole physical axes of the slice, or a physical axis no "
        "mesh axis takes (torch-tpu's layout without a split; the split layout is tried next)",
    ),
    BuildCheck(
        "parallelism.device_order",
        "parallelisms.device_order:check_mesh_order",
        "a mesh whose groups break the shard invariant (not built by parallelisms.build_mesh)",
    ),
    BuildCheck(
        "parallelism",
        "parallelisms.parallel_dims:_tpu_rank_grid",
        "a mesh torch-tpu cannot lay out on this TPU slice (at build_mesh)",
    ),
    BuildCheck("parallelism", "parallelisms.tpu_topology:assign", "a mesh whose device count is not the topology's"),
    BuildCheck(
        "parallelism",
        "parallelisms.parallel_dims:build_mesh",
        "degrees resolved for another world size than the process group's",
    ),
    # The built model under its parallelisms.
    BuildCheck(
        "parallelism.tensor_parallel_degree",
        "parallelisms.parallelize:_check_block_params_sharded",
        "a block parameter without a TP or EP style in the model's plan (its gradient would miss the TP sum)",
    ),
    BuildCheck(
        "parallelism.tensor_parallel_degree",
        "parallelisms.tensor_parallel:_retie",
        "tied parameters that get different TP layouts",
    ),
    BuildCheck(
        "optimizer.qk_clip_tau",
        "trainer.optim.qk_clip:QKClip.__init__",
        "QK clip on a model without attention modules it knows, or with per-head qk_norm",
    ),
    # Layer scan (graph mode): the scan form of the built blocks.
    BuildCheck(
        "compile.scan_layers",
        "trainer.graph.step:_enable_scans",
        "a model whose block stack is not a BlockStack, or whose blocks do not repeat from any block on "
        "(no blocks k.. of a period over two or more scan steps: the deepseek_v4 debug flavor)",
    ),
    BuildCheck(
        "compile.scan_layers",
        "models.hf.model:HFBlockStack.enable_scan",
        "an hf architecture without a scan form, or whose decoder layers are not uniform",
    ),
    BuildCheck(
        "compile.scan_layers",
        "parallelisms.scan:body_param_fn",
        "a block parameter that is a DTensor managed by neither SimpleFSDP nor TP",
    ),
    BuildCheck(
        "compile.scan_layers",
        "parallelisms.scan:_ScanTP.of",
        "a block TP style without a scan form (hooks outside the TP plan, rowwise with a bias, ...)",
    ),
    BuildCheck(
        "compile.scan_layers",
        "parallelisms.scan:_scatter_output_hook",
        "a sequence that does not split evenly over the TP degree in the scan body",
    ),
    # The graph step: its optimizer, its capture.
    BuildCheck("optimizer", "trainer.graph.step:build_graph_step", "param groups with different learning rates"),
    BuildCheck(
        "optimizer", "trainer.graph.optim:check_adamw", "an optimizer other than AdamW's default variant or Muon"
    ),
    BuildCheck(
        "optimizer",
        "trainer.graph.optim:AdamWSlots.__init__",
        "a layer-scanned parameter missing from, or split over, the param groups",
    ),
    BuildCheck(
        "optimizer.name",
        "trainer.graph.optim:muon_shards",
        "graph-mode Muon on a parameter sharded more than once per dim",
    ),
    BuildCheck(
        "activation_checkpoint.mode",
        "trainer.graph.remat:_check_rng",
        "a random op (dropout) in a checkpointed block of the captured graph",
    ),
    BuildCheck(
        "compile.mode", "trainer.graph.capture:check_torch", "graph mode with a torch that lacks trace_autograd_ops"
    ),
    BuildCheck("compile.backend", "trainer.graph.tpu:_torch_tpu", "backend tpu where torch-tpu finds no TPU"),
    BuildCheck("device.type", "trainer.runtime.device:pick_device", "tpu or cuda on a host without that device"),
    # Data, tokenizer, kernels, host.
    BuildCheck(
        "model.attn_backend", "titan_kernels:select", "cpu_kernel where the C++ kernel cannot be built on this host"
    ),
    BuildCheck(
        "model.attn_backend",
        "titan_kernels:_select_tpu",
        "splash where the Pallas kernels cannot be loaded on this host",
    ),
    BuildCheck(
        "training.dataset_shards",
        "trainer.data.text:build_dataloader",
        "a shard count that is not a multiple of dp degree x local batch",
    ),
    BuildCheck(
        "model.tokenizer",
        "trainer.tasks.lm:LMTask.__init__",
        "a tokenizer with more tokens than the model's vocab_size",
    ),
    BuildCheck(
        "flow.latent_size",
        "trainer.tasks.flux:FlowTask.example_batch",
        "the recipe check of a FLUX recipe without latent_size and text_seq_len",
    ),
    BuildCheck(
        "model.in_channels",
        "trainer.tasks.flux:FlowTask._check_shapes",
        "a FLUX data set whose latents (channels x 4) or text embeddings (T5 / CLIP widths) are not the "
        "model's in_channels / context_in_dim / vec_in_dim",
    ),
    BuildCheck(
        "flow.latent_size",
        "trainer.tasks.flux:FlowTask._check_shapes",
        "a flow.latent_size or flow.text_seq_len other than the FLUX data set's",
    ),
    BuildCheck(
        "model.name",
        "trainer.engine:Engine.hf_state_dict",
        "the engine's Hugging Face export for a family without hf_adapter.py",
    ),
    BuildCheck(
        "device.flag_bundle",
        "trainer.runtime.tpu_env:pick_bundle",
        "a flag bundle recorded for other TPU generations than this host's",
    ),
    BuildCheck(
        "device.libtpu_init_args",
        "trainer.runtime.tpu_env:_check_known",
        "a flag (device.libtpu_init_args, device.xla_flags or exported) the installed TPU runtime does not know",
    ),
    # The planner's model (the trainer runs these layouts; the planner cannot estimate them).
    BuildCheck(
        "parallelism.tensor_parallel_degree",
        "planner.deepseek_v4:v4_activation_bytes",
        "the planner: DeepSeek-V4 with TP > 1 (its activation terms are tp = 1's)",
    ),
    BuildCheck(
        "parallelism.context_parallel_degree",
        "planner.search:_checked_step",
        "the planner: CP > 1 for FLUX (no CP plan for its joint text + image sequence); it also raises "
        "the first RULES refusal of the layout",
    ),
    BuildCheck(
        "parallelism.tensor_parallel_degree",
        "planner.deepseek:mla_activation_bytes",
        "the planner: DeepSeek-V3 (MLA) with TP or CP > 1",
    ),
    BuildCheck(
        "flow.latent_size",
        "planner.flux:flux_tokens",
        "the planner of a FLUX recipe without latent_size and text_seq_len, or with an odd latent side",
    ),
)
