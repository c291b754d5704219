"""Write the generated blocks of README.md and docs/rules.md from the code they describe.

    python scripts/dev/gen_doc_blocks.py            # rewrite the blocks
    python scripts/dev/gen_doc_blocks.py --check    # exit 1 if a block is stale (used by tests/unit/test_docs.py)

A block sits between `<!-- BEGIN generated:NAME ... -->` and `<!-- END generated:NAME -->`;
only its inside is rewritten. The renderers live beside this script in doc_blocks/ (`layout`:
the code's layout, sections, rules; `planner`: recipes planned as shipped and searches; `results`:
the tables read from docs/results/ CSVs); BLOCKS below maps each block to its renderer. The blocks:
- README.md `layout`: the top-level folders, and the modules and packages of trainer/, models/
  and parallelisms/ (trainer's subpackages one level deeper), each with the first sentence of
  its docstring (read with `ast`, nothing imported). A package whose modules are listed under
  it keeps only the head of a long first sentence (up to its first colon). Folders without
  Python packages (and tests/) have their line in FOLDERS (doc_blocks/layout.py); a top-level
  folder missing from ORDER is an error.
- README.md `sections`: the recipe sections and their keys (`trainer.config.field_docs`).
- docs/rules.md `rules`: the step plan's refusal table (`trainer.step.plan.RULES`): the key,
  when the rule refuses (its `when` text, and its predicate over `StepRequest` fields as
  written) and what its message allows.
- docs/rules.md `build_checks`: the refusals made where a built model, the mesh or the host is
  known (`trainer.step.checks.BUILD_CHECKS`): the key, the function, what it refuses.
- docs/planner.md `pod_recipes`: every pod recipe (a `[job] target` in configs/) planned as
  shipped (`planner.plan_estimate`, the one-block probe), and its compiled figure from the latest
  docs/results/pod_compile_*.csv row of that recipe.
- docs/planner.md `breakdown`: the per-device terms of the dense Llama 3 pod recipes;
  docs/context_parallel.md `cp_recipes`: the 128k recipes (and `cp_compiles`, their attention
  sublayer's compile, from its CSV); docs/low_precision.md
  `low_precision_recipes`: each `[quantize]` pod recipe against its parent (all as shipped).
- docs/recipe_check.md `pod_compiles`: each recipe's latest row of docs/results/pod_compile_*.csv.
- docs/planner.md `recommend`: `--recommend` from model flags for a few model and target pairs,
  from docs/results/planner_recommend_*.csv (a search takes about half a minute each, too slow
  for this check).
- docs/planner.md `moe_search`: the DeepSeek-V3 / Kimi K2 slice search, from its CSVs
  (docs/results/planner_*_v7x_*.csv).
- docs/expert_parallel.md `moe_dispatch_capacity` (its CSV) and `ep_recipes` (the pod recipes with
  expert parallelism, planned as shipped).
- docs/low_precision.md `low_precision_projection`: the projection, from its CSV.
- docs/benchmarks.md `peer_ttshape_*`: three of the CPU peer tables, from their CSVs.
- docs/tpu.md `estimate_xla`: the full-depth compiles of the dense pod recipes, from their CSV,
  beside the planner of that run and of this commit.
- docs/moe.md `moe_balance`: the balancing benchmark, from its CSV (`csv_columns`).
- docs/optimizers.md `muon_sharded` and `muon_vs_adamw`: the Muon benchmarks, from their CSVs.
- docs/optimizers.md `optimizer_memory`: the MoE pod recipes planned with AdamW and with Muon.
- docs/results.md `results_*`: the results log's benchmark tables, each from its CSV
  (doc_blocks/results_log.py `RESULTS_LOG`); a table with no CSV behind it says so in the page.
"""

from __future__ import annotations

import functools
import os
import re
import sys

from doc_blocks.layout import (
    ROOT,
    render_build_checks,
    render_layer_imports,
    render_layout,
    render_rules,
    render_scheduled,
    render_sections,
)
from doc_blocks.planner import (  # pod_recipes, recipe_estimate, compiled_figures: tests/unit/test_planner_figures.py
    compiled_figures,
    pod_recipes,
    recipe_estimate,
    render_breakdown,
    render_cp_recipes,
    render_ep_recipes,
    render_low_precision_recipes,
    render_moe_search,
    render_optimizer_memory,
    render_pod_recipes,
    render_recommend,
)
from doc_blocks.results import (
    PEER_TABLES,
    render_cp_compiles,
    render_estimate_xla,
    render_low_precision_projection,
    render_moe_balance,
    render_moe_dispatch_capacity,
    render_muon_sharded,
    render_muon_vs_adamw,
    render_peer_table,
    render_pod_compiles,
)
from doc_blocks.results_log import RESULTS_LOG

__all__ = ["BLOCKS", "compiled_figures", "main", "pod_recipes", "recipe_estimate", "replace_block"]


# ----------------------------------------------------------------------------------- blocks

BLOCKS = {
    "README.md": {"layout": render_layout, "sections": render_sections},
    "docs/rules.md": {"rules": render_rules, "build_checks": render_build_checks},
    "docs/architecture.md": {"layer_imports": render_layer_imports},
    "docs/testing.md": {"scheduled": render_scheduled},
    "docs/planner.md": {
        "recommend": render_recommend,
        "pod_recipes": render_pod_recipes,
        "breakdown": render_breakdown,
        "moe_search": render_moe_search,
    },
    "docs/context_parallel.md": {"cp_recipes": render_cp_recipes, "cp_compiles": render_cp_compiles},
    "docs/moe.md": {"moe_balance": render_moe_balance},
    "docs/tpu.md": {"estimate_xla": render_estimate_xla},
    "docs/benchmarks.md": {name: functools.partial(render_peer_table, name) for name in PEER_TABLES},
    "docs/recipe_check.md": {"pod_compiles": render_pod_compiles},
    "docs/low_precision.md": {
        "low_precision_recipes": render_low_precision_recipes,
        "low_precision_projection": render_low_precision_projection,
    },
    "docs/optimizers.md": {
        "muon_sharded": render_muon_sharded,
        "optimizer_memory": render_optimizer_memory,
        "muon_vs_adamw": render_muon_vs_adamw,
    },
    "docs/expert_parallel.md": {"moe_dispatch_capacity": render_moe_dispatch_capacity, "ep_recipes": render_ep_recipes},
    "docs/results.md": RESULTS_LOG,
}


def replace_block(text: str, name: str, body: str, *, path: str) -> str:
    begin = re.search(rf"<!-- BEGIN generated:{name}\b[^>]*-->\n", text)
    end = re.search(rf"<!-- END generated:{name} -->", text)
    if not begin or not end or end.start() < begin.end():
        raise SystemExit(
            f"{path}: no '<!-- BEGIN generated:{name} ... -->' ... '<!-- END generated:{name} -->' markers"
        )
    return text[: begin.end()] + body + "\n" + text[end.start() :]


def main() -> int:
    check = "--check" in sys.argv
    stale = []
    for rel, blocks in BLOCKS.items():
        path = ROOT / rel
        text = path.read_text()
        new = text
        for name, render in blocks.items():
            new = replace_block(new, name, render(), path=rel)
        if new != text:
            stale.append(rel)
            if not check:
                path.write_text(new)
    if check and stale:
        print(
            f"stale generated blocks in {', '.join(stale)}: run python scripts/dev/gen_doc_blocks.py", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    sys.exit(main())
