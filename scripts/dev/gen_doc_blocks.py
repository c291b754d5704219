"""Write the generated blocks of README.md and docs/rules.md from the code they describe.

    python scripts/dev/gen_doc_blocks.py            # rewrite the blocks
    python scripts/dev/gen_doc_blocks.py --check    # exit 1 if a block is stale (used by tests/unit/test_docs.py)

A block sits between `<!-- BEGIN generated:NAME ... -->` and `<!-- END generated:NAME -->`;
only its inside is rewritten. The blocks:
- README.md `layout`: the top-level folders, and the modules and packages of trainer/, models/
  and parallelisms/ (trainer's subpackages one level deeper), each with the first sentence of
  its docstring (read with `ast`, nothing imported). A package whose modules are listed under
  it keeps only the head of a long first sentence (up to its first colon). Folders without
  Python packages (and tests/) have their line in FOLDERS below; a top-level folder missing from
  ORDER is an error.
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
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

WIDTH = 100
NAME_COL = 16
EXPANDED = ("trainer", "models", "parallelisms")
"""Top-level packages whose modules are listed; trainer's subpackages are listed one level deeper."""
ORDER = (
    "trainer",
    "models",
    "titan_kernels",
    "parallelisms",
    "planner",
    "tools",
    "configs",
    "constraints",
    "scripts",
    "tests",
    "examples",
    "assets",
    "docs",
)
FOLDERS = {
    "configs": "TOML recipes, <model>_<size>[_<target>].toml; a pod recipe names its `[job] target`",
    "constraints": "dev.txt: the CPU/GPU venv's lock (every package of the [dev] tree, exact), used by "
    "scripts/env.sh for .venv; tpu.txt: the TPU stack's exact pins (torch CPU build, torch-tpu, "
    "libtpu, jax), used by scripts/env.sh tpu (docs/tpu.md)",
    "scripts": "the commands a user runs (tests/unit/test_layout.py USER_COMMANDS): train.sh, test.sh, env.sh, "
    "launch_pod.sh, benchmark.py, estimate.py (pod planner), check_recipe.py, convert.py (HF <-> DCP), sample.py and "
    "eval_flux.py (FLUX), the TPU ones (tpu_smoke.sh, xla_env.sh, estimate_xla.py, mfu_suite.py); data/: the "
    "corpus, BPE and FLUX data builders; bench/: the single-purpose benchmarks (bench_*.py) and their shared "
    "helpers, the TorchTitan peer of benchmark.py --peer, the TPU kernel tile sweep; dev/: the doc generators "
    "and other developer tools",
    "tests": "pytest, CPU only by default (markers for multi-process, slow, tpu, cuda); toy_family.py is "
    "a model family defined outside models/; tests/xla is the XLA tier (its own venvs)",
    "examples": "grpo_debug.py: GRPO on the debug Llama 3 through the engine API (docs/engine.md)",
    "assets": "the bundled corpus and BPE tokenizers (offline debug runs), anchors.toml (published "
    "numbers that benchmarks compare against)",
    "docs": "the pages in the table above; results/ holds every measurement's CSV",
}


# ----------------------------------------------------------------------------------- layout


def first_sentence(path: Path) -> str:
    """The first sentence of the module docstring's first paragraph, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text()))
    if not doc:
        raise SystemExit(f"{path.relative_to(ROOT)}: no module docstring (the layout reads its first sentence)")
    para = " ".join(doc.split("\n\n")[0].split())
    sentence = re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", para, maxsplit=1)[0]
    return sentence[:-1] if sentence.endswith(".") else sentence


def _entry(indent: int, name: str, summary: str, col: int) -> list[str]:
    head = " " * indent + name
    col = max(col, len(head) + 2)
    lines = textwrap.wrap(summary, width=WIDTH - col, break_on_hyphens=False) or [""]
    return [head.ljust(col) + lines[0]] + [" " * col + line for line in lines[1:]]


def _package_lines(pkg: Path, indent: int, depth: int) -> list[str]:
    """The modules, then the subpackages, of `pkg` (sorted), `depth` levels of subpackages deep;
    the summaries of siblings start in one column."""
    modules = [p for p in sorted(pkg.glob("*.py")) if p.name != "__init__.py"]
    subs = sorted(p for p in pkg.iterdir() if (p / "__init__.py").is_file())
    names = [p.name for p in modules] + [p.name + "/" for p in subs]
    col = max([NAME_COL + indent] + [indent + len(n) + 2 for n in names])
    out = []
    for path in modules:
        out += _entry(indent, path.name, first_sentence(path), col)
    for sub in subs:
        summary = first_sentence(sub / "__init__.py")
        if depth > 0 and len(summary) > WIDTH - col and ": " in summary:
            summary = summary.split(": ", 1)[0]
        out += _entry(indent, sub.name + "/", summary, col)
        if depth > 0:
            out += _package_lines(sub, indent + 2, depth - 1)
    return out


def _top_level_folders() -> list[str]:
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return sorted({f.split("/")[0] for f in files.splitlines() if "/" in f and not f.startswith(".")})


def render_layout() -> str:
    folders = _top_level_folders()
    unknown = [f for f in folders if f not in ORDER]
    if unknown:
        raise SystemExit(
            f"scripts/dev/gen_doc_blocks.py: top-level folder(s) {unknown} have no layout line; "
            "add them to ORDER (and to FOLDERS unless they are Python packages)"
        )
    out = ["```"]
    for name in ORDER:
        if name not in folders:
            continue
        init = ROOT / name / "__init__.py"
        summary = FOLDERS[name] if name in FOLDERS else first_sentence(init)
        if name in EXPANDED:
            if len(summary) > WIDTH - NAME_COL and ": " in summary:
                summary = summary.split(": ", 1)[0]
            out += _entry(0, name + "/", summary, NAME_COL)
            out += _package_lines(ROOT / name, 2, 1 if name == "trainer" else 0)
        else:
            out += _entry(0, name + "/", summary, NAME_COL)
    out.append("```")
    return "\n".join(out)


# --------------------------------------------------------------------------------- sections


def render_sections() -> str:
    from trainer.config import field_docs

    lines = []
    for section, rows in field_docs().items():
        keys = [key for key, _, _ in rows if key != "overrides"]
        extra = ", and any field of the flavor's args" if section == "model" else ""
        lines += textwrap.wrap(
            f"- `[{section}]` {', '.join(keys)}{extra}", width=WIDTH, subsequent_indent="  ", break_on_hyphens=False
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ rules


class _Field(str):
    def __repr__(self) -> str:
        return str(self)


class _Placeholders:
    def __getattr__(self, name: str) -> _Field:
        return _Field(f"`<{name}>`")


def _predicates() -> list[str]:
    """Each rule's `refuses` lambda body, as written in trainer/step/plan.py (the `r.` dropped)."""
    tree = ast.parse((ROOT / "trainer" / "step" / "plan.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "RULES":
            out = []
            for call in node.value.elts:
                (lam,) = [a for a in call.args if isinstance(a, ast.Lambda)]
                out.append(re.sub(r"\br\.", "", ast.unparse(lam.body)))
            return out
    raise SystemExit("trainer/step/plan.py: no RULES table")


def render_rules() -> str:
    from trainer.step.plan import RULES

    predicates = _predicates()
    assert len(predicates) == len(RULES), (len(predicates), len(RULES))
    out = [
        "| # | key | refused when | allowed (the message's end) | test over `StepRequest` fields |",
        "|---|---|---|---|---|",
    ]
    for i, (rule, predicate) in enumerate(zip(RULES, predicates), 1):
        why = rule.why.format(r=_Placeholders())
        allowed = why[why.rindex("allowed") :]  # every message ends in what is allowed (tests/unit/test_step_plan.py)
        cells = [f"`{rule.key}`", rule.when, allowed, f"`{predicate}`"]
        out.append(f"| {i} | " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def render_build_checks() -> str:
    from trainer.step.checks import BUILD_CHECKS

    out = ["| key | where | refuses |", "|---|---|---|"]
    for check in BUILD_CHECKS:
        cells = [f"`{check.key}`", f"`{check.where}`", check.what]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


LAYER_PACKAGES = ("tools", "planner", "trainer", "parallelisms", "titan_kernels", "models")  # top to bottom


def render_layer_imports() -> str:
    """A table: for each product package (top to bottom), how many of its modules import each
    package below it (every absolute import, function-local ones too), read with `ast`."""
    import ast

    counts: dict[str, dict[str, set[str]]] = {p: {q: set() for q in LAYER_PACKAGES} for p in LAYER_PACKAGES}
    modules = {p: 0 for p in LAYER_PACKAGES}
    for pkg in LAYER_PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            modules[pkg] += 1
            rel = str(path.relative_to(ROOT))
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module]
                    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    else []
                )
                for name in names:
                    top = name.split(".")[0]
                    if top in counts[pkg] and top != pkg:
                        counts[pkg][top].add(rel)
    head = "| package (modules) | " + " | ".join(f"imports `{q}`" for q in LAYER_PACKAGES) + " |"
    lines = [
        "Modules of each package (row) that import each other package (column); a package imports",
        "only those below it, so the upper triangle is empty.",
        "",
        head,
        "|" + "---|" * (len(LAYER_PACKAGES) + 1),
    ]
    for p in LAYER_PACKAGES:
        cells = [str(len(counts[p][q])) if counts[p][q] else ("-" if q != p else "·") for q in LAYER_PACKAGES]
        lines.append(f"| `{p}` ({modules[p]}) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def scheduled_entries(path: Path = ROOT / "tests" / "support" / "tiers.py") -> list[tuple[str, tuple, str]]:
    """(pattern, covered_by, why) of each `Scheduled(...)` in tiers.py's SCHEDULED, read with `ast`
    (scripts import nothing from tests/; tests/unit/test_layout.py): each argument is a literal."""
    fields = ("pattern", "covered_by", "why")
    for node in ast.parse(path.read_text()).body:
        names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
        if names == ["SCHEDULED"]:
            entries = []
            for call in node.value.elts:
                values = dict(zip(fields, call.args)) | {k.arg: k.value for k in call.keywords}
                try:
                    entries.append(tuple(ast.literal_eval(values[f]) for f in fields))
                except (KeyError, ValueError) as e:
                    raise SystemExit(
                        f"{path.relative_to(ROOT)}:{call.lineno}: a Scheduled entry needs literal {fields}: {e}"
                    )
            return entries
    raise SystemExit(f"{path.relative_to(ROOT)}: no SCHEDULED")


def render_scheduled() -> str:
    """The scheduled tier (tests/support/tiers.py SCHEDULED): each entry and the default-tier
    tests that cover its mechanism."""
    out = ["| scheduled tests (node-id pattern) | covered in the default tier by | why it may wait |", "|---|---|---|"]
    for pattern, covered_by, why in scheduled_entries():
        cells = [f"`{pattern}`", "<br>".join(f"`{c}`" for c in covered_by), why]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


# -------------------------------------------------------------------------- planner figures


def pod_recipes() -> list[str]:
    """The recipes with a `[job] target` (the pod recipes), by name."""
    import tomllib

    return [
        p.stem
        for p in sorted((ROOT / "configs").glob("*.toml"))
        if tomllib.loads(p.read_text()).get("job", {}).get("target")
    ]


def recipe_estimate(name: str, overrides: tuple[tuple[str, str], ...] = ()):
    """(config, `planner.Estimate`) of configs/<name>.toml on its `[job] target` with the recipe's
    degrees, as `scripts/estimate.py --config` plans it (the one-block probe: the same total)."""
    import planner
    from tools.recipe_check import plan_inputs
    from trainer.config import build_config

    cfg = build_config(str(ROOT / "configs" / f"{name}.toml"), list(overrides))
    p = cfg.parallelism
    est = planner.plan_estimate(
        plan_inputs(cfg),
        planner.parse_target(cfg.job.target),
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        tp=p.tensor_parallel_degree,
        ep=p.expert_parallel_degree,
        cp=p.context_parallel_degree,
        ac_mode=cfg.activation_checkpoint.mode,
        loss_parallel=p.enable_loss_parallel,
        probe=True,
    )
    return cfg, est


def compiled_figures() -> dict[str, tuple[str, str, str, str]]:
    """recipe -> (compiler GiB, planned GiB then, verdict, CSV name) from
    docs/results/pod_compile_*.csv; a later file (by name: date, then commit) overrides an
    earlier one's row."""
    import csv

    out = {}
    for path in sorted((ROOT / "docs" / "results").glob("pod_compile_*.csv")):
        lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
        for row in csv.DictReader(lines):
            out[row["recipe"].removesuffix(".toml")] = (
                row["compiler GiB"],
                row["planned GiB"],
                row["verdict"],
                path.name,
            )
    return out


def _layout(cfg, est) -> str:
    axes = [f"FSDP {est.dp_shard}"]
    if est.dp_replicate > 1:
        axes.insert(0, f"replicate {est.dp_replicate}")
    axes += [f"{name} {n}" for name, n in (("TP", est.tp), ("CP", est.cp), ("EP", est.ep)) if n > 1]
    parts = [" x ".join(axes)]
    if cfg.compile.scan_layers:
        parts.append("scan")
    parts.append(f"AC {est.ac_mode}")
    parts.append(f"{est.local_batch_size} x {est.seq_len}")
    if est.ep > 1:
        parts.append(f"capacity {cfg.moe.capacity_factor:g}" if cfg.moe.capacity_factor else "dropless")
    if cfg.quantize.recipe != "none":
        parts.append(cfg.quantize.recipe)
    return ", ".join(parts)


def render_pod_recipes() -> str:
    import planner

    gib = planner.GiB
    compiled = compiled_figures()
    out = [
        "| recipe | target | layout | planner GiB / usable | tokens / device / step | est. step s, tok/s/device "
        "(40 % MFU) | compiled GiB (the planner then: verdict; CSV) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in pod_recipes():
        cfg, est = recipe_estimate(name)
        fits = "" if est.fits else " (does not fit)"
        gib_c, planned, verdict, csv_name = compiled.get(name, ("-", "", "not compiled", ""))
        if gib_c != "-":
            where = f"{gib_c} (planned {planned} then: {verdict}; {csv_name})"
        else:
            where = f"{verdict} ({csv_name})" if csv_name else verdict
        out.append(
            f"| {name} | {est.target.name} | {_layout(cfg, est)} | {est.total / gib:.1f} / {est.usable / gib:.1f}{fits} "
            f"| {est.tokens_per_device_step:,.0f} | {est.step_time_s:.2f}, {est.tokens_per_s:,.0f} | {where} |"
        )
    return "\n".join(out)


def render_recommend() -> str:
    """`scripts/estimate.py --model M --flavor F --target T --recommend --csv` for a few model and
    target pairs (docs/results/planner_recommend_*.csv: the first row and the first fitting ones of
    each search, in `recommend`'s order): the first fitting plan of each, or the smallest when none fits."""
    import csv

    gib = 2**30
    (path,) = sorted((ROOT / "docs" / "results").glob("planner_recommend_*.csv"))[-1:]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    out = [
        "| model | target | recommended plan | GiB / device (usable) | tokens / device / step "
        "| est. step s, tok/s/device at 40 % MFU (x recompute) |",
        "|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((r["model"], r["target"]) for r in rows):
        plans = [r for r in rows if (r["model"], r["target"]) == key]
        best = next((r for r in plans if r["fits"] == "True"), None)
        r = best or plans[0]
        axes = [f"FSDP {r['dp_shard']}"]
        if int(r["dp_replicate"]) > 1:
            axes.insert(0, f"replicate {r['dp_replicate']}")
        axes += [f"{a} {r[k]}" for a, k in (("CP", "cp"), ("TP", "tp"), ("EP", "ep")) if int(r[k]) > 1]
        plan = " x ".join(axes) + (" (loss parallel)" if r["loss_parallel"] == "True" and int(r["tp"]) > 1 else "")
        plan += f", AC {r['ac_mode']}, batch {r['local_batch_size']}"
        total = int(r["total_bytes"]) / gib
        if best is None:
            out.append(f"| {key[0]} | {key[1]} | **none fits**: closest {plan} needs {total:.2f} | - | - | - |")
            continue
        out.append(
            f"| {key[0]} | {key[1]} | {plan} | {total:.2f} ({int(r['usable_bytes']) / gib:.1f}) "
            f"| {float(r['tokens_per_device_step']):,.0f} | {float(r['est_step_s']):.2f} s, "
            f"{float(r['est_tokens_per_s_per_device']):,.0f} |"
        )
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


def render_moe_search() -> str:
    """The dropless DeepSeek-V3 / Kimi K2 slice search of docs/results/planner_*_v7x_*.csv
    (`estimate.py --recommend --csv`): per target the first fitting plan in `recommend`'s order
    (least recompute, most tokens per device, largest EP), or the smallest plan when none fits,
    and up to three other fitting (EP, batch) layouts."""
    import csv

    gib = 2**30
    rank = {"none": 0, "selective": 1, "full": 2}
    out = [
        "| model | target | best plan | GiB / device (usable) | other fitting layouts (EP, batch, GiB) | CSV |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted((ROOT / "docs" / "results").glob("planner_*_v7x_*.csv")):
        rows = list(csv.DictReader(path.read_text().splitlines()))
        for target in sorted({r["target"] for r in rows}, key=lambda t: int(t.rsplit("-", 1)[1])):
            plans = [r for r in rows if r["target"] == target]
            fitting = sorted(
                (r for r in plans if r["fits"] == "True"),
                key=lambda r: (
                    int(r["tp"]),
                    int(r["cp"]),
                    rank[r["ac_mode"]],
                    -float(r["tokens_per_device_step"]),
                    -int(r["ep"]),
                    int(r["dp_replicate"]),
                ),
            )
            name = plans[0]["model"]

            def layout(r: dict) -> str:
                return f"EP {r['ep']}, AC {r['ac_mode']}, batch {r['local_batch_size']}"

            if not fitting:
                smallest = min(plans, key=lambda r: int(r["total_bytes"]))
                need = int(smallest["total_bytes"]) / gib
                out.append(
                    f"| {name} | {target} | none fits: {layout(smallest)} needs {need:.1f} | - | - | {path.name} |"
                )
                continue
            best, others, seen = fitting[0], [], set()
            seen.add((best["ep"], best["local_batch_size"]))
            for r in fitting[1:]:
                key = (r["ep"], r["local_batch_size"])
                if key not in seen and r["ac_mode"] == best["ac_mode"]:
                    seen.add(key)
                    others.append(f"EP {r['ep']} b{r['local_batch_size']} {int(r['total_bytes']) / gib:.1f}")
            out.append(
                f"| {name} | {target} | {layout(best)} | {int(best['total_bytes']) / gib:.1f} "
                f"({int(best['usable_bytes']) / gib:.1f}) | {'; '.join(others[:3])} | {path.name} |"
            )
    return "\n".join(out)


def render_ep_recipes() -> str:
    """The pod recipes with expert parallelism, planned as shipped, with their compiled figure."""
    import planner

    gib = planner.GiB
    compiled = compiled_figures()
    out = [
        "| recipe | target | layout | efsdp | per device, planner (usable) | compiled (CSV) |",
        "|---|---|---|---|---|---|",
    ]
    for name in pod_recipes():
        cfg, est = recipe_estimate(name)
        if est.ep == 1:
            continue
        efsdp = est.dp_shard * est.cp // est.ep
        gib_c, _, verdict, csv_name = compiled.get(name, ("-", "", "not compiled", ""))
        where = f"{gib_c} GiB ({csv_name})" if gib_c != "-" else (f"{verdict} ({csv_name})" if csv_name else verdict)
        out.append(
            f"| {name} | {est.target.name} | {_layout(cfg, est)} | {efsdp} | {est.total / gib:.1f} GiB "
            f"({est.usable / gib:.1f}) | {where} |"
        )
    return "\n".join(out)


def render_moe_dispatch_capacity() -> str:
    """docs/results/moe_dispatch_capacity_*.csv (scripts/bench/moe_dispatch_cost.py): the dropless
    recipes as they shipped against the capacity-1.25 ones, per layer."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("moe_dispatch_capacity_*.csv"))[-1:]
    out = [
        "| recipe | ep before / after | batch before / after | buffer rows per routed copy: dropless / capacity "
        "| buffers per layer (fwd + bwd), GiB | per 1k tokens, MiB | all-to-all per layer, GiB: dropless ragged / "
        "dropless equal split / capacity |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        f = {k: float(v) for k, v in r.items() if k != "recipe"}
        out.append(
            f"| `{r['recipe']}` | {r['ep_before']} / {r['ep_after']} | {r['batch_before']} / {r['batch_after']} "
            f"| {f['rows_per_copy_before']:.2f} / {f['rows_per_copy_after']:.2f} "
            f"| {f['buffer_gib_before']:.1f} / {f['buffer_gib_after']:.1f} "
            f"| {f['buffer_mib_per_1k_tokens_before']:.0f} / {f['buffer_mib_per_1k_tokens_after']:.0f} "
            f"| {f['a2a_gib_before_ragged']:.2f} / {f['a2a_gib_before_equal_split']:.1f} / {f['a2a_gib_after']:.1f} |"
        )
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


BREAKDOWN_RECIPES = ("llama3_8b_v6e", "llama3_70b_v6e", "llama3_405b_v7x")
"""The dense Llama 3 pod recipes whose per-device terms docs/planner.md tabulates."""


def render_breakdown() -> str:
    """Per-device terms of the dense Llama 3 pod recipes as shipped (GiB; scripts/estimate.py's rows)."""
    import planner

    ests = [recipe_estimate(name)[1] for name in BREAKDOWN_RECIPES]

    def g(n: float) -> str:
        return f"{n / planner.GiB:.2f}"

    def transient(e) -> str:
        which = "loss / LM head" if e.transient == e.transient_loss else "block backward"
        return f"{g(e.transient)} ({which})"

    rows = [
        ("parameters / gradients / AdamW (fp32)", lambda e: f"{g(e.params)} / {g(e.grads)} / {g(e.optimizer)}"),
        ("bf16 weights kept for backward", lambda e: g(e.saved_weights)),
        (
            "block activations (AC full)",
            lambda e: f"{e.n_layers} x {g(e.activations.per_block)} = {g(e.activations.blocks)}",
        ),
        ("final norm, LM-head input, ids", lambda e: g(e.activations.outside)),
        ("loss (fused: fp32 log-sum-exp per token)", lambda e: g(e.activations.loss)),
        ("transient peak", transient),
        ("undonated update", lambda e: g(e.update)),
        ("**total** / usable", lambda e: f"**{g(e.total)}** / {e.usable / planner.GiB:.1f}"),
    ]
    head = ["| |"] + [f" {name} ({e.target.name}) |" for name, e in zip(BREAKDOWN_RECIPES, ests)]
    out = ["".join(head), "|---|" + "---|" * len(ests)]
    for label, cell in rows:
        out.append(f"| {label} | " + " | ".join(cell(e) for e in ests) + " |")
    return "\n".join(out)


CP_RECIPES = ("llama3_8b_128k_v6e", "llama3_8b_128k_v7x", "qwen3_32b_128k_v6e", "qwen3_32b_128k_v7x")


def render_cp_recipes() -> str:
    """The 128k recipes (context parallelism) as shipped."""
    import planner

    out = [
        "| recipe | target | layout | tokens / device | global batch | planner GiB / device (usable) |",
        "|---|---|---|---|---|---|",
    ]
    for name in CP_RECIPES:
        cfg, est = recipe_estimate(name)
        out.append(
            f"| configs/{name}.toml | {est.target.name} | {_layout(cfg, est)} | {est.tokens_per_device_step:,.0f} "
            f"| {est.global_batch_tokens / 2**20:g}M | {est.total / planner.GiB:.2f} ({est.usable / planner.GiB:.1f}) |"
        )
    return "\n".join(out)


def render_low_precision_recipes() -> str:
    """Each low-precision pod recipe (`[quantize] recipe` set) against its parent (the name without
    the last `_` suffix), as shipped."""
    import planner

    gib = planner.GiB
    out = [
        "| recipe | `[quantize]` | planner GiB per device: parent -> variant (usable) | of which the largest quantized "
        "backward's low-precision copies | the variant's peak |",
        "|---|---|---|---|---|",
    ]
    for name in pod_recipes():
        cfg, est = recipe_estimate(name)
        if cfg.quantize.recipe == "none":
            continue
        _, parent = recipe_estimate(name.rsplit("_", 1)[0])
        peak = "loss / LM head" if est.transient == est.transient_loss else "block backward"
        out.append(
            f"| `{name}` | {cfg.quantize.recipe} | {parent.total / gib:.1f} -> {est.total / gib:.1f} "
            f"({est.usable / gib:.1f}) | {est.quantize_transient / gib:.2f} | {peak} |"
        )
    return "\n".join(out)


_COLLECTIVES = {
    "all_gather_into_tensor": "all-gather",
    "all_reduce": "all-reduce",
    "all_to_all_single": "all-to-all",
    "reduce_scatter_tensor": "reduce-scatter",
}


def render_pod_compiles() -> str:
    """The latest row of each recipe in docs/results/pod_compile_*.csv (`scripts/check_recipe.py
    --compile --compile-csv`; files by name: date, then commit), in the order compiled: the deviceless XLA compile of each pod recipe at full depth against the planner of
    that run (the `planned GiB` column; the planner of this commit is in docs/planner.md)."""
    import csv

    out = [
        "| recipe | target | mesh as compiled | program | compile s | args / out / temp GiB | compiler GiB "
        "| planned GiB (then) | verdict | CSV |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    latest: dict[str, tuple] = {}  # a later file (by name: date, then commit) replaces a recipe's row
    for path in sorted((ROOT / "docs" / "results").glob("pod_compile_*.csv")):
        lines = [line for line in path.read_text().splitlines() if not line.startswith("#")]
        for r in csv.DictReader(lines):
            latest.pop(r["recipe"], None)
            latest[r["recipe"]] = (path, r)
    for path, r in latest.values():
        program = r["program"]
        for name, short in _COLLECTIVES.items():
            program = program.replace(name, short)
        verdict = r["verdict"]
        if r["compiler GiB"] not in ("", "-") and r["planned GiB"] not in ("", "-"):
            verdict += f" ({float(r['compiler GiB']) / float(r['planned GiB']) - 1:+.0%})"
        cells = [
            r["recipe"].removesuffix(".toml"),
            r["target"],
            r["mesh as compiled"],
            program,
            r["compile s"],
            f"{r['args GiB']} / {r['out GiB']} / {r['temp GiB']}",
            r["compiler GiB"],
            r["planned GiB"],
            verdict,
            path.name,
        ]
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(out)


def render_muon_sharded() -> str:
    """docs/results/muon_sharded_*.csv (scripts/bench/bench_muon_sharded.py): the all-to-all and the
    gather of each stack side by side."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("muon_sharded_*.csv"))[-1:]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    out = [
        "| ranks | stack B x m x n | all-to-all ms | gather ms | speed-up | elements received per rank "
        "(a2a / gather) | whole matrices held (a2a / gather) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key in dict.fromkeys((r["ranks"], r["stack"]) for r in rows):
        a2a, gather = (
            next(r for r in rows if (r["ranks"], r["stack"]) == key and r["variant"] == v)
            for v in ("all_to_all", "gather")
        )
        a_ms, g_ms = float(a2a["median_ms"]), float(gather["median_ms"])
        out.append(
            f"| {key[0]} | {key[1].replace('x', ' x ')} | {a_ms:.0f} | {g_ms:.0f} | {g_ms / a_ms:.1f}x "
            f"| {int(a2a['received_elems']) / 1e6:.1f} M / {int(gather['received_elems']) / 1e6:.1f} M "
            f"| {a2a['whole_matrices_held']} / {gather['whole_matrices_held']} |"
        )
    worst = max(float(r["max_abs_diff"]) for r in rows)
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}; max |difference| between the two: {worst:g}.)"


def render_muon_vs_adamw() -> str:
    """docs/results/muon_vs_adamw_*.csv and its `_curves` companion (scripts/bench/bench_muon.py):
    the mean train loss over four 10-step windows, the validation loss, the speed; the best of each
    optimizer in bold (the last window and the validation loss)."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("muon_vs_adamw_*[0-9a-f].csv"))[-1:]
    rows = list(csv.DictReader(path.read_text().splitlines()))
    curves = list(csv.DictReader(path.with_name(path.stem + "_curves.csv").read_text().splitlines()))
    windows = ((21, 30), (51, 60), (101, 110), (141, 150))

    def mean_loss(r: dict, lo: int, hi: int) -> float:
        losses = [
            float(c["loss"])
            for c in curves
            if (c["optimizer"], c["lr"]) == (r["optimizer"], r["lr"]) and lo <= int(c["step"]) <= hi
        ]
        return sum(losses) / len(losses)

    best = {}
    for col in ("last", "val"):
        for opt in {r["optimizer"] for r in rows}:
            mine = [r for r in rows if r["optimizer"] == opt]
            key = (lambda r: mean_loss(r, *windows[-1])) if col == "last" else (lambda r: float(r["val_loss"]))
            best[col, opt] = min(mine, key=key)["lr"]
    out = [
        "| optimizer | lr | train loss, steps 21-30 | 51-60 | 101-110 | 141-150 | val loss | tokens/s | optimizer step ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        losses = [f"{mean_loss(r, lo, hi):.3f}" for lo, hi in windows]
        val = f"{float(r['val_loss']):.3f}"
        if best["last", r["optimizer"]] == r["lr"]:
            losses[-1] = f"**{losses[-1]}**"
        if best["val", r["optimizer"]] == r["lr"]:
            val = f"**{val}**"
        out.append(
            f"| {r['optimizer']} | {float(r['lr']):.0e} | ".replace("e-0", "e-")
            + " | ".join(losses)
            + f" | {val} | {int(r['tokens_per_s']):,} | {float(r['optimizer_step_ms']):.1f} |"
        )
    return "\n".join(out)


def csv_columns(glob: str, columns: dict[str, str]) -> str:
    """The latest docs/results/<glob> as a table: `columns` maps a CSV column to its header; a
    number is printed as the CSV has it (thousands grouped when it is a whole number >= 1000)."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob(glob))[-1:]
    out = ["| " + " | ".join(columns.values()) + " |", "|" + "---|" * len(columns)]
    for r in csv.DictReader(path.read_text().splitlines()):
        cells = [f"{int(r[c]):,}" if r[c].isdigit() and int(r[c]) >= 1000 else r[c] for c in columns]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


def render_moe_balance() -> str:
    return csv_columns(
        "moe_balance_*[0-9a-f].csv",
        {
            "variant": "variant",
            "max_vio_first": "MaxVio step 1",
            "max_vio_second_half_mean": "MaxVio 2nd half (mean)",
            "max_over_mean_final": "max/mean load, last step",
            "bias_abs_max": "max abs bias",
            "train_loss_last10": "train loss (last 10)",
            "val_loss": "val loss",
            "tokens_per_s": "tokens/s",
        },
    )


def render_cp_compiles() -> str:
    """docs/results/cp_128k_compiles_*.csv (the 128k recipes' attention sublayer compiled with CP,
    and the planner of that run beside it)."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("cp_128k_compiles_2*.csv"))[-1:]
    out = [
        "| recipe | compiled for | cp | tokens / device | compiler: args / out / temp GiB (attention sublayer, "
        "fwd + bwd) | planner: layer attention terms / block-backward transient GiB | planner: whole step GiB "
        "(usable) | all-gather / reduce-scatter in StableHLO; compiled HLO | Mosaic calls | lower + compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        hlo = (
            f"{r['hlo_all_gather']} all-gather, {r['hlo_all_reduce']} all-reduce"
            if r["counted_in"] == "compiled HLO"
            else "not printable (jaxlib 0.10.2)"
        )
        cells = [
            r["recipe"],
            r["compiled_for"],
            r["cp"],
            f"{int(r['tokens_per_device']):,}",
            f"{r['compiler_args_gib']} / {r['compiler_out_gib']} / {r['compiler_temp_gib']}",
            f"{r['planner_layer_attention_gib']} / {r['planner_block_backward_gib']}",
            f"{r['planner_step_total_gib']} ({r['planner_usable_gib']})",
            f"{r['stablehlo_all_gather']} / {r['stablehlo_reduce_scatter']}; {hlo}",
            r["mosaic_calls"],
            f"{float(r['lower_s']) + float(r['compile_s']):.0f}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}; the planner columns are the planner of that run.)"


def render_estimate_xla() -> str:
    """docs/results/estimate_xla_<date>_<commit>.csv (`scripts/estimate_xla.py --csv`, the dense pod
    recipes compiled at full depth): the compiler's figures, the planner of that run (the CSV's
    columns) and the planner of this commit for the same recipe."""
    import csv

    import planner

    (path,) = sorted((ROOT / "docs" / "results").glob("estimate_xla_2*.csv"))[-1:]
    out = [
        "| recipe (target) | layers compiled | scan, flips | arguments | outputs | temp | **total** | HBM | verdict "
        "| planner then: total (usable), verdict; compiler vs it | planner of this commit; compiler vs it "
        "| capture / compile / wall s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        name = r["recipe"].removesuffix(".toml")
        now = recipe_estimate(name)[1].total / planner.GiB
        total = float(r["total_gib"])
        cells = [
            f"{name} ({r['target']})",
            r["layers"],
            f"{'scan' if r['scan'] == '1' else 'unrolled'}, {r['flips']}",
            r["arg_gib"],
            r["out_gib"],
            r["temp_gib"],
            f"**{r['total_gib']}**",
            r["hbm_gib"],
            r["verdict"],
            f"{float(r['planner_total_gib']):.2f} ({r['planner_usable_gib']}), {r['planner_verdict']}; "
            f"{r['total_diff_pct']} %",
            f"{now:.2f}; {(total / now - 1) * 100:+.1f} %",
            f"{r['capture_s']} / {r['compile_s']} / {r['wall_s']}",
        ]
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


def render_low_precision_projection() -> str:
    """docs/results/low_precision_projection_*.csv (scripts/bench/low_precision_projection.py): each
    low-precision recipe's projected step against its bf16 parent's program."""
    import csv

    (path,) = sorted((ROOT / "docs" / "results").glob("low_precision_projection_*.csv"))[-1:]
    out = [
        "| recipe (target) | quantized share of bf16 compute | compute s bf16 -> low precision | collectives s "
        "| tokens/s/chip bf16 -> low precision, exposed / overlapped | speed-up exposed / overlapped "
        "| the same with the passes free (a bound) | MaxText tokens/s/chip bf16 -> FP8 (ratio) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in csv.DictReader(path.read_text().splitlines()):
        f = {k: float(v) for k, v in r.items() if v and k not in ("recipe", "parent", "target", "quantize", "program")}
        comm = f"{f['comm_s']:.2f}" + (f" -> {f['comm_s_lp']:.2f}" if abs(f["comm_s"] - f["comm_s_lp"]) > 1e-9 else "")
        maxtext = (
            f"{f['maxtext_bf16']:,.0f} -> {f['maxtext_fp8']:,.0f} ({f['maxtext_ratio']:.2f}x)"
            if "maxtext_ratio" in f
            else "-"
        )
        out.append(
            f"| {r['recipe']} ({r['target']}, {r['quantize']}) | {f['quantized_share_of_compute'] * 100:.0f} % "
            f"| {f['compute_s_bf16']:.2f} -> {f['compute_s_lp']:.2f} | {comm} "
            f"| {f['tokens_per_chip_exposed_bf16']:,.0f} -> {f['tokens_per_chip_exposed_lp']:,.0f} / "
            f"{f['tokens_per_chip_overlapped_bf16']:,.0f} -> {f['tokens_per_chip_overlapped_lp']:,.0f} "
            f"| {f['speedup_exposed']:.2f}x / {f['speedup_overlapped']:.2f}x "
            f"| {f['speedup_exposed_fused']:.2f}x / {f['speedup_overlapped_fused']:.2f}x | {maxtext} |"
        )
    return "\n".join(out) + f"\n\n(CSV: docs/results/{path.name}.)"


TORCHTITAN = "TorchTitan 0.3.0's own trainer (SDPA, its debugmodel, its SelectiveAC{})"
PEER_TABLES = {
    # block name -> (CSV, [(variant, label, ratio in bold)], peak memory column, scan against the unrolled graph)
    "peer_ttshape_3c806bd": (
        "cpu_peer_ttshape_2026-12-02_3c806bd.csv",
        [
            ("torchtitan", TORCHTITAN.format("; glibc defaults"), False),
            ("eager", "ours eager, bf16", True),
            ("graph", "ours graph, bf16", True),
            ("graph_scan", "ours graph + layer scan, bf16", True),
            ("graph_system", 'ours graph, bf16, `host_malloc = "system"`', False),
        ],
        True,
        True,
    ),
    "peer_ttshape_f5ff70c": (
        "cpu_peer_ttshape_2026-12-02_f5ff70c.csv",
        [
            ("torchtitan", TORCHTITAN.format(""), False),
            ("eager", "ours eager, bf16", True),
            ("graph", "ours graph, bf16", True),
        ],
        False,
        False,
    ),
    "peer_ttshape_8f1e82f": (
        "cpu_peer_ttshape_2026-12-02_8f1e82f.csv",
        [
            ("torchtitan", TORCHTITAN.format(""), False),
            ("eager", "ours eager, bf16", True),
            ("graph", "ours graph, bf16", True),
            ("graph_scan", "ours graph + layer scan, bf16", True),
        ],
        False,
        False,
    ),
}
"""docs/benchmarks.md's peer tables (`scripts/benchmark.py --preset ttshape`), from their CSVs."""


def render_peer_table(name: str) -> str:
    import csv

    csv_name, labels, mem, scan_note = PEER_TABLES[name]
    rows = {r["variant"]: r for r in csv.DictReader((ROOT / "docs" / "results" / csv_name).read_text().splitlines())}
    peer = float(rows["torchtitan"]["tokens_per_sec"])
    head = "| run | tok/s | vs TorchTitan (defaults vs defaults) | MFU % (of the bf16 peak) |" + (
        " peak mem GiB |" if mem else ""
    )
    out = [head, "|---|---|---|---|" + ("---|" if mem else "")]
    for variant, label, bold in labels:
        r = rows[variant]
        tok = float(r["tokens_per_sec"])
        ratio = f"{tok / peer:.2f}x"
        ratio = f"**{ratio}**" if bold else ratio
        if scan_note and variant == "graph_scan":
            ratio += f" ({tok / float(rows['graph']['tokens_per_sec']):.2f}x of the unrolled graph)"
        mfu = f"{float(r['mfu_pct']):.1f}" if r.get("mfu_pct") else "-"
        cells = [
            label,
            f"{tok:,.0f} ({float(r['tokens_per_sec_min']):,.0f}..{float(r['tokens_per_sec_max']):,.0f})",
            ratio,
            mfu,
        ]
        if mem:
            cells.append(f"{float(r['mem_gib']):.2f}" if r.get("mem_gib") else "-")
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out)


OPTIMIZER_RECIPES = ("deepseek_v3_671b_v7x", "kimi_k2_v7x", "qwen3_235b_a22b_v7x")
"""The MoE pod recipes whose optimizer docs/optimizers.md discusses (their recipes use AdamW)."""


def render_optimizer_memory() -> str:
    import planner

    gib = planner.GiB
    out = [
        "| recipe (as shipped) | optimizer | total GiB / usable | optimizer state | undonated update | Muon's update matrices |",
        "|---|---|---|---|---|---|",
    ]
    for name in OPTIMIZER_RECIPES:
        for opt in ("adamw", "muon"):
            _, est = recipe_estimate(name, (("optimizer.name", opt),))
            muon = f"{est.muon_update / gib:.2f}" if opt == "muon" else "-"
            out.append(
                f"| {name} | {opt} | {est.total / gib:.1f} / {est.usable / gib:.1f} | {est.optimizer / gib:.2f} "
                f"| {est.update / gib:.2f} | {muon} |"
            )
    return "\n".join(out)


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
