"""Pod planning without a pod: per-device memory and step time of a parallel plan.

`scripts/estimate.py` is the command line; this package computes, and `planner.report` prints the
reports (the breakdown, the summary table, the CSV, the recipe keys).

1. **Targets** (`planner.targets`): `parse_target("v6e-256")` -> a `Target` (generation, devices,
   HBM and peak per device).
2. **Real sharding on a fake world** (`planner.shard`): inside `fake_process_group(world_size)`
   the real mesh, the real flavor on the meta device and the real plan (`parallelize_model`:
   TP, EP, SimpleFSDP) give rank 0's parameter shards (`shard_model` -> `ShardStats`).
3. **Activations, analytically** (`planner.activations`): `activation_bytes` from the model's
   declared sizes (`args.shape()`), validated against `measure_saved_bytes` (a real CPU forward).
4. **Totals** (`planner.memory`): `estimate` adds parameters, gradients, AdamW state,
   activations, kept bf16 weights and the transient peak, and compares with HBM minus headroom.
5. **Plans** (`planner.search`): `plan_estimate` for one explicit plan, `recommend` searches a
   target, `suggest_fixes` says what would make a plan fit.
6. **Pipelines** (`planner.pipeline`): with pipeline_parallel_degree > 1 the heaviest pp rank's
   memory (its stages' blocks, the embedding or head, its in-flight micro-batches), the bubble in
   the step time and the point-to-point bytes over ICI or DCN.

A model is used only through its family's contract (`models/contract.py`). Nothing here
touches an accelerator; it runs in seconds on a laptop CPU.
"""

from planner.activations import ActivationBytes, activation_bytes, cp_gathered_kv_bytes, measure_saved_bytes
from planner.memory import RECOMPUTE_FACTOR, RECOMPUTE_RANK, Estimate, estimate
from planner.search import (
    AC_SEARCH_ORDER,
    Fixes,
    PlanInputs,
    best_per_layout,
    devices_needed,
    make_parallel_dims,
    model_flops_per_token,
    plan_estimate,
    preference_key,
    recommend,
    search_key,
    suggest_fixes,
)
from planner.shard import ShardStats, build_parallel_model, fake_process_group, shard_model
from planner.targets import GENERATIONS, Generation, GiB, Target, parse_target

__all__ = [
    "AC_SEARCH_ORDER",
    "GENERATIONS",
    "RECOMPUTE_FACTOR",
    "RECOMPUTE_RANK",
    "ActivationBytes",
    "Estimate",
    "Fixes",
    "Generation",
    "GiB",
    "PlanInputs",
    "ShardStats",
    "Target",
    "activation_bytes",
    "best_per_layout",
    "build_parallel_model",
    "cp_gathered_kv_bytes",
    "devices_needed",
    "estimate",
    "fake_process_group",
    "make_parallel_dims",
    "measure_saved_bytes",
    "model_flops_per_token",
    "parse_target",
    "plan_estimate",
    "preference_key",
    "search_key",
    "recommend",
    "shard_model",
    "suggest_fixes",
]
