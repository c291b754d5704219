"""The planner's host-offload term and the embedding backward's transient (planner/memory.py), against
the deviceless TPU compiles (libtpu 0.0.52).

With `[activation_checkpoint] offload = "block_inputs"` on a TPU target the scanned blocks' saved
inputs are host bytes, all of them (the compiled programs' host temporaries are the stack exactly),
and the device keeps one row of the stack, the one the backward trip reads. The step's peak is then
the larger of the layers' peak without the stack and the embedding backward after both loops: the
fp32 scatter-add of the gathered table's gradient and its fp32 copy (`embedding_backward_bytes`).
Until 2026-12-07 the device kept `OFFLOAD_KEPT_SHARE` = 61.6 % of the stack, a share fitted to the
8B's compile: it put the 70B and 405B offload compiles 62-123 % over.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

import planner
from planner.memory import EMBEDDING_BACKWARD_BYTES_PER_ELEMENT
from tools.recipe_check import planned
from trainer.config import build_config

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs/results"
GIB = 2**30
OFFLOAD = ("activation_checkpoint.offload", "block_inputs")
NO_OFFLOAD = ("activation_checkpoint.offload", "none")
LLAMA_8B = "configs/llama3_8b_v6e.toml"
PP_405B = "configs/pending/llama3_405b_v6e_2x256_pp.toml"
PP_TP4 = (
    ("parallelism.tensor_parallel_degree", "4"),
    ("parallelism.enable_loss_parallel", "true"),
    ("training.local_batch_size", "1"),
    ("parallelism.pipeline_microbatches", "1"),
)
"""The 405B two-slice PP layout compiled with and without the offload (docs/pipeline_parallel.md)."""
ONE_SEQUENCE = ("training.gradient_accumulation_steps", "1")


def _estimate(recipe: str, *overrides: tuple[str, str]) -> planner.Estimate:
    """`scripts/estimate.py --config` of `recipe` (the one-block probe: the same total)."""
    cfg = build_config(str(ROOT / recipe), list(overrides))
    return planned(cfg, planner.parse_target(cfg.job.target), probe=True)


def _rows_8b(name: str) -> dict[str, dict[str, str]]:
    """offload key -> the row of an 8B offload-compile CSV (bytes per device)."""
    return {r["offload"]: r for r in csv.DictReader((RESULTS / name).open())}


def _compiler_total(row: dict[str, str]) -> int:
    return sum(int(row[f]) for f in ("args bytes", "out bytes", "temp bytes"))


def _compiled_gib(name: str) -> float:
    """The compiler's total (GiB) of the offload row of a compile CSV: the 8B's in bytes, the others'
    `compiler GiB` (scripts/check_recipe.py --compile-csv) or `compiler_gib` (the MaxText side by side)."""
    if name in (_8B_4, _8B_32):
        return _compiler_total(_rows_8b(name)["block_inputs"]) / GIB
    (row,) = csv.DictReader((RESULTS / name).open())
    return float(row.get("compiler GiB") or row["compiler_gib"])


def _state(est: planner.Estimate) -> int:
    """What the step holds beside its backward's peak: fp32 parameters, gradients and moments, and
    the undonated update's outputs."""
    return est.params + est.grads + est.optimizer + est.update


_8B_32 = "offload_compile_2026-12-07_84404b4_32layers.csv"
_8B_4 = "offload_compile_2026-12-07_b32890c.csv"


def test_the_whole_stack_goes_to_the_host_and_one_row_stays():
    """configs/llama3_8b_v6e.toml at 32 layers: the compile's host temporaries are the 32 blocks'
    inputs [1, 8192, 4096] bf16 exactly; the device keeps one of them; the rest of the plan is
    unchanged (the layers' peak stays the planner's larger)."""
    host = {k: int(r["host temp bytes"]) for k, r in _rows_8b(_8B_32).items()}
    off = _estimate(LLAMA_8B, OFFLOAD)
    kept = _estimate(LLAMA_8B)  # without the offload
    assert kept.offloaded == kept.offload_kept == kept.host_bytes == host["none"] == 0
    row = 8192 * 4096 * 2
    assert off.activations.blocks == 32 * row
    assert off.host_bytes == off.offloaded == host["block_inputs"] == 2**31
    assert off.offload_kept == off.activations.per_block == row
    assert off.loop_peak > off.embedding_backward
    assert kept.total - off.total == off.offloaded - off.offload_kept


@pytest.mark.parametrize("name,layers", [(_8B_4, "4"), (_8B_32, "32")])
def test_the_offloaded_8b_peaks_in_the_embedding_backward(name, layers):
    """With the stack on the host the 8B's live peak is the embedding backward (the buffer assignment
    at 4 layers: docs/results/offload_buffers_8b_4layers_2026-12-07_b9ea89b.txt, 2 x 2004 MiB
    f32[128256, 4096] after both loops). The compiler's `peak bytes` (arguments and outputs
    included) of both offload compiles is the planner's state plus its two tables within 0.2 %: the
    table is 128,256 x 4096 x 8 B whole (FSDP gathers it), the rest is the state the planner counts
    exactly from the shards (a difference of 4.6 MB at 32 layers, 0.4 MB at 4, both under 0.1 %).
    The planner's layers' peak without the stack stays above it (its loss transient, 3.0 GiB, is an
    upper bound), so the plan is above the live peak; the compiler's total (its heap's extent) is
    0.62 (4 layers) and 1.59 GiB (32) above the live peak: `test_against_the_offload_compiles`."""
    off = _estimate(LLAMA_8B, ("model.n_layers", layers), OFFLOAD)
    assert off.embedding_backward == EMBEDDING_BACKWARD_BYTES_PER_ELEMENT * 128256 * 4096 == 2 * 2004 * 2**20
    peak = int(_rows_8b(name)["block_inputs"]["peak bytes"])
    assert abs((_state(off) + off.embedding_backward) / peak - 1) < 0.002, (_state(off), off.embedding_backward, peak)
    assert off.total >= peak


def test_the_embedding_backward_is_the_tp_shard_and_sets_no_pod_recipes_peak():
    """Under TP the table is vocab-sharded (models/common/plan.py "embedding"): a rank's scatter-add
    covers its vocab / tp rows (the 405B at TP 4: 128,256 / 4 x 16384 x 8 B). Without the offload
    the layers' peak is the larger at the recipes' shapes (every pod compile's plan is unchanged by
    the term: the table in docs/planner.md "The embedding backward")."""
    est = _estimate(PP_405B, *PP_TP4, NO_OFFLOAD)
    assert est.embedding_backward == EMBEDDING_BACKWARD_BYTES_PER_ELEMENT * 128256 // 4 * 16384
    assert est.loop_peak > est.embedding_backward
    assert est.backward_peak == est.loop_peak


# (point, recipe, overrides, the compile's CSV, band)
COMPILED = [
    ("8B 4 layers", LLAMA_8B, (("model.n_layers", "4"), OFFLOAD), _8B_4, 0.10),
    ("8B 32 layers", LLAMA_8B, (OFFLOAD,), _8B_32, 0.20),
    (
        "405B PP 2 x TP 4",
        PP_405B,
        (*PP_TP4, OFFLOAD),
        "pp_compile_405b_2slice_offload_2026-12-07_1fe73ca.csv",
        0.05,
    ),
    (
        "70B 5 sequences",
        "configs/llama3_70b_v6e.toml",
        (("training.local_batch_size", "5"), ONE_SEQUENCE, OFFLOAD),
        "maxtext_side_by_side_2026-12-07_ee34b73_70b_offload.csv",
        0.20,
    ),
    (
        "405B v7x 3 sequences",
        "configs/llama3_405b_v7x.toml",
        (("training.local_batch_size", "3"), ONE_SEQUENCE, OFFLOAD),
        "maxtext_side_by_side_2026-12-07_ee34b73_405b_offload.csv",
        0.20,
    ),
]


@pytest.mark.parametrize("point,recipe,overrides,source,band", COMPILED, ids=[c[0] for c in COMPILED])
def test_against_the_offload_compiles(point, recipe, overrides, source, band):
    """The plan with the offload against the compiler's total (arguments + outputs + temporaries).
    Bands: 5 % for the one-sequence 405B PP program (the band docs/planner.md gives the scanned pod
    recipes; planned 28.55 against 29.6, -3.6 %); 10 % for the 8B at 4 layers (-5.2 %: the heap's
    extent above its live peak, which the plan matches, see above); 20 % for the rest: the 8B at 32
    layers (-19.3 %) is the same extent, 1.59 GiB over the live peak the plan is 7.8 % above; the 70B
    (+15.9 %) and the 405B on v7x (-17.8 %) batch 5 and 3 sequences in one micro-batch, where the
    planner's block transient is not validated without offload either (no compile fits them
    without it). The kept share this replaced fails three of the five (+12.5, +62 and +123 %)."""
    est = _estimate(recipe, *overrides)
    assert est.host_bytes == est.offloaded > 0
    compiled = _compiled_gib(source)
    error = est.total / GIB / compiled - 1
    assert abs(error) < band, (point, est.total / GIB, compiled)
    shared = (est.total + round(0.616 * est.offloaded) - est.offload_kept) / GIB / compiled - 1
    assert point.startswith("8B") or shared > 0.12  # the old share's error, for the record


def test_the_offload_saving_on_the_405b_pp_program():
    """The same 405B PP layout compiled without the offload (docs/results/pp_compile_405b_2slice_2026-12-07_c872eb3.csv:
    30.5 GiB, temporaries 12.55) and with it (29.6, 11.71): the compiler saves 0.84 GiB of the 7.88 GiB
    stack; the planner saves the stack less one row (7.81 GiB). Without the offload the planner says
    36.4 GiB, 19 % over the compiler, whose program never holds its block transient, the loss's and the
    whole stack of both iterations at once the way the planner adds them; with the offload the
    planner's sum without the stack lands 3.6 % under the compiler (`test_against_the_offload_compiles`)."""
    off = _estimate(PP_405B, *PP_TP4, OFFLOAD)
    without = _estimate(PP_405B, *PP_TP4, NO_OFFLOAD)
    assert off.offloaded == 63 * 2 * 8192 * 16384 * 2 // 4  # T = 2 iterations, TP 4 (sequence-parallel inputs)
    assert without.total - off.total == off.offloaded - off.offload_kept
    compiled_without = _compiled_gib("pp_compile_405b_2slice_2026-12-07_c872eb3.csv")
    compiled_with = _compiled_gib("pp_compile_405b_2slice_offload_2026-12-07_1fe73ca.csv")
    assert (compiled_without, compiled_with) == (30.5, 29.6)
    assert 0.15 < without.total / GIB / compiled_without - 1 < 0.25
    assert (compiled_without - compiled_with) < 0.15 * off.offloaded / GIB


def test_offload_counts_every_pipeline_iteration_and_only_on_tpu():
    """Graph-mode PP keeps T = m + p - 1 iterations' block inputs (planner/pipeline.py): with the
    offload all of them are host bytes (the 405B recipe: 63 blocks x 3 iterations x one 8192 x 16384
    bf16 sequence); on a GPU target (the pass leaves the graph alone on CUDA) nothing moves."""
    off = _estimate(PP_405B, OFFLOAD)
    assert off.pipeline is not None and off.pipeline.in_flight == 3
    assert off.offloaded == off.activations.blocks == 63 * 3 * 8192 * 16384 * 2
    without = _estimate(PP_405B, NO_OFFLOAD)
    assert without.offloaded == 0 and without.total - off.total == off.offloaded - off.offload_kept
    gpu = _estimate(LLAMA_8B, OFFLOAD, ("job.target", "h100-8"), ("compile.scan_layers", "true"))
    assert gpu.activations.blocks > 0 and gpu.offloaded == 0
