"""The blocks that describe the code: README.md `layout` and `sections`, docs/rules.md `rules` and
`build_checks`, docs/architecture.md `layer_imports`, docs/testing.md `scheduled`."""

from __future__ import annotations

import ast
import re
import subprocess
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

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


def _predicates(module: str = "plan", table: str = "RULES") -> list[str]:
    """Each rule's `refuses` lambda body, as written in trainer/step/plan.py (the `r.` dropped); a
    starred table in it (`*PIPELINE_RULES`, `*SLICE_RULES`) is read from its sibling module."""
    tree = ast.parse((ROOT / "trainer" / "step" / f"{module}.py").read_text())
    siblings = {"PIPELINE_RULES": "pipeline_rules", "SLICE_RULES": "slice_rules"}
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == table:
            out = []
            for call in node.value.elts:
                if isinstance(call, ast.Starred):
                    out += _predicates(siblings[call.value.id], call.value.id)
                    continue
                (lam,) = [a for a in call.args if isinstance(a, ast.Lambda)]
                out.append(re.sub(r"\br\.", "", ast.unparse(lam.body)))
            return out
    raise SystemExit(f"trainer/step/{module}.py: no {table} table")


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
