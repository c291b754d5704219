"""The docs stay true to the code: generated blocks are current, and cited code exists.

- README.md's layout and recipe-section blocks and docs/training.md's rule table are generated
  (scripts/dev/gen_doc_blocks.py); a stale block fails here, as docs/config.md fails in
  tests/unit/test_config.py.
- Every page under docs/ is in README's documentation table.
- Every code name the docs cite as a dotted path (`trainer.step.plan_step`) or a file
  (`trainer/job.py`, `trainer/job.py: batch_split`) exists: read with `ast`, nothing imported.
  This is the check that catches a doc left behind when a module moves or a name is renamed.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "models", "parallelisms", "planner", "tools", "titan_kernels")
FILE_ROOTS = PACKAGES + ("scripts", "tests", "examples", "configs")
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def test_generated_doc_blocks_are_current():
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    r = subprocess.run(
        [sys.executable, "scripts/dev/gen_doc_blocks.py", "--check"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr or "stale: run python scripts/dev/gen_doc_blocks.py"


def test_every_docs_page_is_in_the_readme_table():
    readme = (ROOT / "README.md").read_text()
    missing = [p.name for p in PAGES[1:] if f"](docs/{p.name})" not in readme]
    assert not missing, f"docs pages missing from README's documentation table: {missing}"


def _module_path(parts: list[str]) -> tuple[Path, int] | None:
    """(file, number of parts it covers) of the longest module prefix of `parts`, or None."""
    for k in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:k])
        if base.with_suffix(".py").is_file():
            return base.with_suffix(".py"), k
        if (base / "__init__.py").is_file():
            return base / "__init__.py", k
    return None


def _statements(body):
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(node, field, []):
                    yield from _statements(
                        getattr(child, "body", [child]) if isinstance(child, ast.ExceptHandler) else [child]
                    )


def _defined(body) -> dict[str, ast.AST]:
    names: dict[str, ast.AST] = {}
    for node in _statements(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for n in ast.walk(target):
                    if isinstance(n, ast.Name):
                        names[n.id] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = node
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


@functools.cache
def _module_names(path: Path) -> dict[str, ast.AST]:
    return _defined(ast.parse(path.read_text()).body)


def _missing_dotted(name: str) -> str | None:
    parts = name.split(".")
    found = _module_path(parts)
    if found is None:
        return "no such module"
    path, k = found
    attrs = parts[k:]
    if not attrs or attrs[0] in ("py", "md", "toml", "json"):
        return None
    names = _module_names(path)
    if attrs[0] not in names:
        return f"{attrs[0]} is not defined in {path.relative_to(ROOT)}"
    node = names[attrs[0]]
    if len(attrs) > 1 and isinstance(node, ast.ClassDef) and attrs[1] not in _defined(node.body):
        return f"{attrs[0]} has no {attrs[1]} in {path.relative_to(ROOT)}"
    return None


DOTTED = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})(?:\.[A-Za-z_]\w*)+)")
FILE = re.compile(rf"(?<![\w./-])((?:{'|'.join(FILE_ROOTS)})/[\w./-]*\.(?:py|toml|sh))(?::\s?`?([A-Za-z_]\w*))?")
FOLDER = re.compile(rf"(?<![\w./-])((?:{'|'.join(PACKAGES)})/(?:\w+/)+)(?![\w.<])")


def _stale_citations() -> list[str]:
    out = []
    for page in PAGES:
        for i, line in enumerate(page.read_text().splitlines(), 1):
            where = f"{page.relative_to(ROOT)}:{i}"
            for m in DOTTED.finditer(line):
                why = _missing_dotted(m.group(1))
                if why:
                    out.append(f"{where}: `{m.group(1)}`: {why}")
            for m in FILE.finditer(line):
                path, name = ROOT / m.group(1), m.group(2)
                if not path.exists():
                    out.append(f"{where}: {m.group(1)} does not exist")
                elif name and not re.search(rf"\b{name}\b", path.read_text()):
                    out.append(f"{where}: {m.group(1)} has no {name}")
            for m in FOLDER.finditer(line):
                if not (ROOT / m.group(1)).is_dir():
                    out.append(f"{where}: folder {m.group(1)} does not exist")
    return out


def test_cited_code_exists():
    stale = _stale_citations()
    assert not stale, "docs cite code that is not there:\n" + "\n".join(stale)


def test_every_build_graph_step_keyword_is_documented():
    """build_graph_step's docstring points to docs/graph_trainer.md "The interface" for its keywords:
    the list there names each keyword of the signature (read with `ast`), and nothing else."""
    tree = ast.parse((ROOT / "trainer" / "graph" / "step.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "build_graph_step")
    keywords = {a.arg for a in fn.args.kwonlyargs}
    page = (ROOT / "docs" / "graph_trainer.md").read_text()
    section = page[page.index("## The interface") : page.index("\n## ", page.index("## The interface") + 1)]
    listed = set(re.findall(r"^- `(\w+)", section, re.M))
    assert len(keywords) >= 18, keywords
    assert listed == keywords, f"missing: {sorted(keywords - listed)}, not keywords: {sorted(listed - keywords)}"
