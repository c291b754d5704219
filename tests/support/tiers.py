"""The test tiers (docs/testing.md).

- **default** (`scripts/test.sh`, what CI runs on every submission): everything not listed below,
  held under `BUDGET_S` of estimated wall time on 2 vCPUs by tests/unit/test_tiers.py over the
  durations recorded in `DURATIONS` (`scripts/test.sh --all --record`);
- **scheduled** (`scripts/test.sh --all`, `.ci/scheduled`, nightly or weekly): the default tier
  plus the tests in `SCHEDULED` and every test marked `exhaustive`. `.ci/scheduled` writes its
  result to `LAST_SCHEDULED`.

Each entry of `SCHEDULED` names the default-tier tests that cover its mechanism (`covered_by`,
node-id prefixes): a regression the scheduled test would catch must also fail one of those, or at
least the same code path must run there. tests/unit/test_tiers.py checks that every entry matches
a collected test, that every `covered_by` matches a default-tier test, and that every
`exhaustive` test has an entry.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DURATIONS = ROOT / "tests" / "support" / "durations.json"
LAST_SCHEDULED = ROOT / "docs" / "results" / "scheduled_tier.json"
# Estimated pytest wall time of the default tier on 2 workers; scripts/test.sh on a clean clone
# adds the venv set-up (about 3-4 minutes) and must stay under 20 minutes.
BUDGET_S = 15 * 60
WORKERS = 2

TIER = os.environ.get("TITAN_TEST_TIER") or ("all" if os.environ.get("TITAN_TEST_EXHAUSTIVE") == "1" else "default")
if TIER not in ("default", "all"):
    raise SystemExit(f"error: TITAN_TEST_TIER={TIER!r}: allowed: default, all")


@dataclass(frozen=True)
class Scheduled:
    pattern: str  # fnmatch pattern on the node id (relative to the repository root)
    covered_by: tuple[str, ...]  # default-tier node-id prefixes that run the same mechanism
    why: str


SCHEDULED: tuple[Scheduled, ...] = (
    # --- exhaustive matrix points (marker `exhaustive`): another mesh of a parallelism, another
    # wire of a pass, another recipe of the same family, whose mechanism a default test runs.
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp4]",
        ("tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",),
        "cp 4: the same ring and load-balanced chunks as cp 2, two more ranks",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2x[dh]*]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2xtp2]",
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
        ),
        "cp beside dp / hsdp: the mesh slicing cp x tp proves",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2xtp2-loss-parallel]",
        ("tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2xtp2]", "tests/e2e/test_parallel_e2e.py"),
        "cp x tp with loss parallel: cp x tp here, loss parallel in test_parallel_e2e",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[[]cp2-compile]",
        ("tests/e2e/test_cp_train.py::test_graph_scan_cp2_matches_single_process",),
        "cp under torch.compile: the graph step with cp compiles the same attention",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_moe_cp_matches_single_process[[]cp2]",
        ("tests/e2e/test_cp_train.py::test_moe_cp_matches_single_process[cp2xep2]",),
        "MoE with cp and no EP: cp x ep runs the same MoE layer under cp",
    ),
    Scheduled(
        "tests/e2e/test_cp_train.py::test_document_mask_cp2_matches_single_process[[]global]",
        ("tests/e2e/test_cp_train.py::test_document_mask_cp2_matches_single_process[restart]",),
        "global positions: the same masked cp attention with other position ids",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[[]fsdp2]",
        (
            "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[ep2]",
            "tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process",
        ),
        "SimpleFSDP is family-generic; the MoE families run it by default",
    ),
    Scheduled(
        "tests/e2e/test_deepseek_v3.py::test_parallel_matches_single_process[[]cp2]",
        (
            "tests/e2e/test_cp_train.py::test_eager_cp_matches_single_process[cp2]",
            "tests/unit/test_context_parallel.py",
        ),
        "MLA under cp: the cp attention path is the one every family runs",
    ),
    Scheduled(
        "tests/e2e/test_expert_balance.py::test_bias_trajectory_matches_single_process[[]cp2]",
        ("tests/e2e/test_expert_balance.py::test_bias_trajectory_matches_single_process[fsdp2]",),
        "the global expert load is reduced over every data rank, cp ranks among them",
    ),
    Scheduled(
        "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[[]4-degrees[23]]",
        (
            "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[4-degrees4]",
            "tests/e2e/test_flux_train.py::test_flux_losses_match_single_process[2-degrees0]",
        ),
        "FLUX at FSDP 4 and HSDP: FSDP 2 and the 4-rank point run the same wrapping",
    ),
    Scheduled(
        "tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process[[]4-degrees3]",
        ("tests/e2e/test_qwen3_e2e.py::test_moe_losses_match_single_process[4-degrees4]",),
        "MoE at FSDP 4 x EP 2: the other 4-rank point runs EP beside FSDP",
    ),
    Scheduled(
        "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[[]kimi_k2_v7x.toml]",
        (
            "tests/e2e/test_recipes.py::test_recipe_starts_on_its_target[deepseek_v3_671b_v7x.toml]",
            "tests/unit/test_planner_deepseek.py",
        ),
        "Kimi K2 is DeepSeek-V3's architecture at other sizes; the planner plans both",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_llama3_scan_tp2_loss_parallel_matches_single_process",
        (
            "tests/e2e/test_scan_tp.py::test_llama3_scan_tp2_matches_single_process_and_unrolled",
            "tests/e2e/test_parallel_e2e.py",
        ),
        "scan + TP is the test above; loss parallel on TP runs in test_parallel_e2e",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_llama3_scan_fsdp2_tp2_matches_single_process",
        ("tests/e2e/test_scan_tp.py::test_llama3_scan_tp2_matches_single_process_and_unrolled",),
        "scan over FSDP x TP: the TP scan form plus SimpleFSDP's gathers in the body",
    ),
    Scheduled(
        "tests/e2e/test_scan_tp.py::test_qwen3_scan_tp2_matches_unrolled",
        ("tests/e2e/test_scan_tp.py::test_llama3_scan_tp2_matches_single_process_and_unrolled",),
        "Qwen 3 shares the decoder block and its TP scan form with Llama 3",
    ),
    Scheduled(
        "tests/unit/test_context_parallel.py::test_graph_step_with_cp[[]scan]",
        (
            "tests/unit/test_context_parallel.py::test_graph_step_with_cp[unrolled]",
            "tests/e2e/test_cp_train.py::test_graph_scan_cp2_matches_single_process",
        ),
        "the graph step with cp, scanned: the e2e scan + cp run covers it",
    ),
    Scheduled(
        "tests/unit/test_expert_parallel.py::test_moe_layer_scan_matches_eager[[]fsdp2]",
        ("tests/unit/test_expert_parallel.py::test_moe_layer_scan_matches_eager[fsdp2-ep2]",),
        "MoE scan at FSDP 2 without EP: the fsdp2-ep2 point holds it",
    ),
    Scheduled(
        "tests/unit/test_flux_graph.py::test_two_stack_node_count_constant_with_scan",
        ("tests/unit/test_flux_graph.py::test_flux_node_count_constant_with_scan",),
        "the real two-stack FLUX node count covers the toy two-stack one",
    ),
    Scheduled(
        "tests/unit/test_graph_fsdp.py::test_inductor_bucketing_merges_fsdp_collectives[[]reduce-scatter]",
        ("tests/unit/test_graph_fsdp.py::test_inductor_bucketing_merges_fsdp_collectives[all-to-all]",),
        "the same bucketing pass on gloo's other reduce-scatter wire",
    ),
    Scheduled(
        "tests/unit/test_muon.py::test_graph_step_simple_fsdp_two_gloo_ranks[[]scan]",
        (
            "tests/unit/test_muon.py::test_graph_step_simple_fsdp_two_gloo_ranks[unrolled]",
            "tests/unit/test_muon.py::test_graph_step_matches_eager[scan]",
        ),
        "graph Muon over FSDP, scanned: each half runs by default",
    ),
    Scheduled(
        "tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives[[]4-degrees1]",
        ("tests/unit/test_parallel_compile.py::test_whole_step_is_one_graph_with_fsdp_collectives[2-degrees0]",),
        "the whole-step graph at FSDP x TP: the FSDP point runs the same capture",
    ),
    Scheduled(
        "tests/unit/test_parallel_compile.py::test_per_block_inductor_fsdp_tp",
        ("tests/unit/test_parallel_compile.py::test_per_block_compile_matches_eager",),
        "per-block compile under FSDP and under TP runs by default with aot_eager",
    ),
    Scheduled(
        "tests/xla/test_tpu_program.py::test_every_tpu_recipe_compiles[[]*]",
        ("tests/xla/test_tpu_program.py::test_the_program_compiles_with_its_kernels_and_collectives",),
        "each pod recipe's whole TPU program: the reduced dense / MoE EP / CP programs compile "
        "the same kernels and collectives by default",
    ),
)


def scheduled(nodeid: str) -> Scheduled | None:
    """The `SCHEDULED` entry a test belongs to, or None (a default-tier test)."""
    for entry in SCHEDULED:
        if fnmatch.fnmatchcase(nodeid, entry.pattern):
            return entry
    return None
