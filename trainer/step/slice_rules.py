"""The step plan's rules for a job on several TPU slices (`SLICE_RULES`, part of `RULES`).

The slice count against the recipe's `[job] target`, the data-center network between slices, and
the local checkpoint tier across them (trainer/step/plan.py stars them into `RULES` in this place;
docs/rules.md). They read the `StepRequest` fields `num_slices` (resolved against the launcher),
`recipe_num_slices`, `target_num_slices`, `dp_replicate`, `pp_degree`, `allow_dcn_sharding` and
`local_checkpoint`.
"""

from __future__ import annotations

from trainer.step.rule import Rule

SLICE_RULES: tuple[Rule, ...] = (
    # A recipe whose target names several slices (`v6e-256x2`) runs on that many.
    Rule(
        "parallelism.num_slices",
        "a slice count other than the one the recipe's job.target names (v6e-256x2: 2)",
        lambda r: r.target_num_slices > 1 and r.recipe_num_slices not in (0, r.target_num_slices),
        "{r.recipe_num_slices}, but job.target has {r.target_num_slices} slices; allowed: {r.target_num_slices} or 0",
    ),
    # Several slices (multislice): the data-center network (DCN) between slices carries the HSDP
    # gradient all-reduce once per step; FSDP's per-layer gathers (or TP/EP/CP) over it would not keep up.
    Rule(
        "parallelism.data_parallel_replicate_degree",
        "several slices whose count does not divide the replicate degree (x the pipeline degree: the "
        "stages take the slices first) (FSDP, and with it EP, traffic would cross the DCN), unless "
        "parallelism.allow_dcn_sharding",
        lambda r: r.num_slices > 1 and (r.pp_degree * r.dp_replicate) % r.num_slices != 0 and not r.allow_dcn_sharding,
        "{r.dp_replicate} on {r.num_slices} slices puts FSDP/EP collectives on the data-center network "
        "between slices; allowed: a multiple of {r.num_slices} (HSDP: shard inside a slice, all-reduce "
        "gradients across slices), pipeline_parallel_degree ({r.pp_degree}) x data_parallel_replicate_degree "
        "a multiple of {r.num_slices} (graph-mode PP: the stages take the slices), or "
        "parallelism.allow_dcn_sharding = true",
    ),
    # The local checkpoint tier (trainer/checkpoint/local.py) restores a lost slice from a slice that
    # holds a whole replica: none does when the slices shard the model (`ParallelDims.dcn_mesh_shape`
    # spills onto dp_shard exactly when the slice count does not divide dp_replicate).
    Rule(
        "checkpoint.local_folder",
        "a local tier on several slices that shard the model (parallelism.allow_dcn_sharding with a "
        "replicate degree the slice count does not divide)",
        lambda r: r.local_checkpoint and r.num_slices > 1 and r.dp_replicate % r.num_slices != 0,
        "the {r.num_slices} slices shard the model (parallelism.allow_dcn_sharding with "
        "data_parallel_replicate_degree {r.dp_replicate}), so no slice holds a whole replica to restore a "
        "lost one from; allowed: a data_parallel_replicate_degree that is a multiple of num_slices, or an "
        "empty local_folder",
    ),
)
