"""The planner's host-offload term (`[activation_checkpoint] offload = "block_inputs"`,
planner/memory.py `OFFLOAD_KEPT_SHARE`): the scanned blocks' saved inputs are counted as host bytes,
the device keeps the share the compiled program showed, and nothing moves off a TPU.

Against the deviceless compile of configs/llama3_8b_v6e.toml with and without the offload
(docs/results/offload_compile_2026-12-07_84404b4_32layers.csv, v6e-256, libtpu 0.0.52): the host
bytes are the compiled host temporaries exactly, and the device totals are within 5 % of the
compiler's (arguments + outputs + temporaries), the band docs/planner.md gives the scanned pod recipes.
"""

from __future__ import annotations

import csv
from pathlib import Path

import planner
from planner.memory import OFFLOAD_KEPT_SHARE
from tools.recipe_check import plan_inputs
from trainer.config import build_config

ROOT = Path(__file__).resolve().parents[2]
COMPILED = ROOT / "docs/results/offload_compile_2026-12-07_84404b4_32layers.csv"


def _estimate(recipe: str, *overrides: tuple[str, str]) -> planner.Estimate:
    """`scripts/estimate.py --config` of `recipe` (the one-block probe: the same total)."""
    cfg = build_config(str(ROOT / recipe), list(overrides))
    p = cfg.parallelism
    return planner.plan_estimate(
        plan_inputs(cfg),
        planner.parse_target(cfg.job.target),
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel,
        probe=True,
    )


OFFLOAD = ("activation_checkpoint.offload", "block_inputs")


def test_offload_term_matches_the_compiled_8b():
    rows = {r["offload"]: r for r in csv.DictReader(COMPILED.open())}
    compiled = {k: sum(int(r[f]) for f in ("args bytes", "out bytes", "temp bytes")) for k, r in rows.items()}
    off = _estimate("configs/llama3_8b_v6e.toml", OFFLOAD)
    kept = _estimate("configs/llama3_8b_v6e.toml")  # without the offload
    assert kept.offloaded == kept.offload_kept == 0 and kept.host_bytes == 0
    # all 32 blocks' inputs [1, 8192, 4096] bf16 go to the host: the compile's host temporaries
    assert off.activations.blocks == 32 * 8192 * 4096 * 2
    assert off.host_bytes == off.offloaded == int(rows["block_inputs"]["host temp bytes"]) == 2**31
    # the device keeps the measured share; the rest of the plan is unchanged
    assert abs(off.offload_kept - OFFLOAD_KEPT_SHARE * 2**31) <= 1
    assert kept.total - off.total == off.offloaded - off.offload_kept
    for est, key in ((kept, "none"), (off, "block_inputs")):
        assert abs(est.total / compiled[key] - 1) < 0.05, (key, est.total, compiled[key])
    # without the measured share (the whole stack off the device) the planner would be 20 % under
    assert (off.total - off.offload_kept) / compiled["block_inputs"] < 0.85


def test_offload_term_counts_every_pipeline_iteration_and_only_on_tpu():
    """Graph-mode PP keeps T = m + p - 1 iterations' block inputs (planner/pipeline.py): with the
    offload all of them are host bytes (the 405B recipe: 63 blocks x 3 iterations x one 8192 x 16384
    bf16 sequence); on a GPU target (the pass leaves the graph alone on CUDA) nothing moves."""
    pp = "configs/pending/llama3_405b_v6e_2x256_pp.toml"
    off = _estimate(pp, OFFLOAD)
    assert off.pipeline is not None and off.pipeline.in_flight == 3
    assert off.offloaded == off.activations.blocks == 63 * 3 * 8192 * 16384 * 2
    without = _estimate(pp, ("activation_checkpoint.offload", "none"))
    assert without.offloaded == 0 and without.total - off.total == off.offloaded - off.offload_kept
    gpu = _estimate("configs/llama3_8b_v6e.toml", OFFLOAD, ("job.target", "h100-8"), ("compile.scan_layers", "true"))
    assert gpu.activations.blocks > 0 and gpu.offloaded == 0
