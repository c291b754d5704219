"""The house's import graph: layered, without cycles, and with faces that hold.

Read from the source with `ast` (nothing is imported), counting every import, the function-local
ones too (they hide the dependency graph, not remove it):
- the layering is tools -> planner -> trainer -> parallelisms -> titan_kernels -> models, with
  nothing running back up, and no product package imports `tools` (tests and scripts only);
- no import cycle between modules of the product;
- no private name (`_x`) is imported across packages (trainer's subpackages count as packages);
- each trainer subpackage has a face: an `__init__` with a docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ("models", "titan_kernels", "parallelisms", "trainer", "planner", "tools")  # bottom to top
RANK = {name: i for i, name in enumerate(LAYERS)}


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in LAYERS:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path):
    """(imported module, imported name or None) for every absolute import in the file."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name


def _edges() -> dict[str, set[str]]:
    edges = {}
    for module, path in MODULES.items():
        targets = set()
        for imported, name in _imports(path):
            full = f"{imported}.{name}" if name else imported
            target = full if full in MODULES else _resolve(imported)
            if target and target != module:
                targets.add(target)
        edges[module] = targets
    return edges


def _package(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "trainer" and len(parts) > 2 else parts[0]


def test_layers_only_point_down_and_tools_stay_out_of_the_product():
    upward = [
        (m, t) for m, targets in _edges().items() for t in targets if RANK[t.split(".")[0]] > RANK[m.split(".")[0]]
    ]
    assert not upward, upward


def test_no_import_cycles():
    edges, index, low, stack, on_stack, cycles = _edges(), {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in edges:
        if v not in index:
            visit(v)
    assert not cycles, cycles


def test_no_private_names_imported_across_packages():
    bad = []
    for module, path in MODULES.items():
        for imported, name in _imports(path):
            source = _resolve(imported)
            if name and name.startswith("_") and source and _package(source) != _package(module):
                bad.append(f"{module}: from {imported} import {name}")
    assert not bad, bad


def test_trainer_packages_have_a_face():
    packages = [p for p in (ROOT / "trainer").iterdir() if (p / "__init__.py").is_file()]
    assert {p.name for p in packages} >= {"step", "graph", "tasks", "data", "checkpoint", "runtime"}
    for package in [ROOT / "trainer", *packages]:
        tree = ast.parse((package / "__init__.py").read_text())
        assert ast.get_docstring(tree), f"{package.relative_to(ROOT)}/__init__.py has no docstring"


def test_the_checks_can_fail(tmp_path, monkeypatch):
    """Fake product modules that import upward, in a circle and a private name: each check fails."""
    import pytest

    (tmp_path / "a.py").write_text("import models.fake_b\nfrom trainer.job import build_job\n")
    (tmp_path / "b.py").write_text("def f():\n    from models.fake_a import x\n    from trainer.job import _y\n")
    monkeypatch.setitem(MODULES, "models.fake_a", tmp_path / "a.py")
    monkeypatch.setitem(MODULES, "models.fake_b", tmp_path / "b.py")
    for check in (
        test_layers_only_point_down_and_tools_stay_out_of_the_product,
        test_no_import_cycles,
        test_no_private_names_imported_across_packages,
    ):
        with pytest.raises(AssertionError):
            check()


def test_top_level_packages_shadow_no_installed_distribution():
    """Our top-level package names must not be another distribution's import name: transformers
    5.25 made Hugging Face's `kernels` a dependency, and our package then called `kernels` shadowed
    it (`from kernels import CUDAProperties` failed inside `import transformers.activations`). Checked
    against every distribution installed next to us (the [dev] extras pull transformers, diffusers,
    datasets and their trees) and against a few import names of that ecosystem that are easy to take."""
    import importlib.metadata

    owners = importlib.metadata.packages_distributions()
    taken = {"kernels", "accelerate", "peft", "optimum", "torchtitan", "torchax", "torch_xla"}
    for pkg in LAYERS:
        others = sorted(d for d in owners.get(pkg, []) if d.lower().replace("_", "-") != "titan-tpu")
        assert not others, f"top-level package {pkg!r} is also the import name of {others}"
        assert pkg not in taken, f"top-level package {pkg!r} is a known import name of another project"
