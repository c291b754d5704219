"""The house's import graph: layered, without cycles, and with faces that hold.

Read from the source with `ast` (nothing is imported), counting every import, the function-local
ones too (they hide the dependency graph, not remove it):
- the layering is tools -> planner -> trainer -> parallelisms -> titan_kernels -> models, with
  nothing running back up, and no product package imports `tools` (tests and scripts only);
- no import cycle between modules of the product;
- no private name (`_x`) is imported across packages (trainer's subpackages count as packages);
- each trainer subpackage has a face: an `__init__` with a docstring;
- the rooms of the periphery: nothing in the product or in scripts/ imports `tests` (test helpers
  stay on the test side), no script or tool inserts into `sys.path` (the project is installed
  editable in every venv scripts/env.sh makes), and the top level of scripts/ holds only the
  commands a user runs (`USER_COMMANDS`; data builders in scripts/data/, benchmarks and their
  helpers in scripts/bench/, developer tools in scripts/dev/).
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


# ------------------------------------------------------------------------- the rooms of trainer/

TRAINER_LAYERS = (  # bottom to top; the rooms of one layer do not import each other
    (
        "runtime",
        "platforms",
    ),  # device, process group, atomic writes, the storage seam, the run lock; the job's shape per platform
    ("checkpoint", "data", "optim", "step"),  # checkpoints, text data, optimizers, the step's plan and loss
    ("flux_data",),  # the FLUX data set: build and loader (reads data's tokenizer)
    ("graph", "tasks"),  # the captured step; the tasks (lm, flow) with their data and loss
    ("config",),  # the recipe: names the choices its rooms own (they never read a Config back)
    ("job_plan",),  # build_job's step 2: the run decided and checked (plan_job, step_request, batch_split)
    ("callbacks", "job"),  # build_job and its named phases
    # the entry points (hf_convert: scripts/convert.py's conversions), and the face (trainer/__init__)
    ("engine", "flux_run", "hf_convert", "launch", "train", "trainer"),
)
"""The rooms of trainer/ (its subpackages and top-level modules), layered like LAYERS."""
ROOM_LAYER = {room: i for i, rooms in enumerate(TRAINER_LAYERS) for room in rooms}


def _room(module: str) -> str:
    """trainer.X.Y and trainer.X -> X; the face `trainer` itself -> trainer."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_room_imports(edges: dict[str, set[str]]) -> list[str]:
    """`module -> target` of each import inside trainer/ that points to a room of the same or a higher
    layer (another room), or from or to a room TRAINER_LAYERS does not place."""
    bad = []
    for module, targets in sorted(edges.items()):
        if module.split(".")[0] != "trainer":
            continue
        for target in sorted(targets):
            a, b = _room(module), _room(target)
            if target.split(".")[0] != "trainer" or a == b:
                continue
            if a not in ROOM_LAYER or b not in ROOM_LAYER or ROOM_LAYER[b] >= ROOM_LAYER[a]:
                bad.append(f"{module} -> {target}")
    return bad


def test_the_rooms_of_trainer_only_point_down():
    rooms = {p.stem for p in (ROOT / "trainer").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    rooms = {"trainer" if r == "__init__" else r for r in rooms}
    assert rooms == set(ROOM_LAYER), f"place each room of trainer/ in TRAINER_LAYERS: {rooms ^ set(ROOM_LAYER)}"
    upward = upward_room_imports(_edges())
    assert not upward, upward


def test_the_room_check_can_fail():
    edges = {
        "trainer.runtime.storage": {"trainer.checkpoint.manifest", "trainer.runtime.atomic", "models.errors"},
        "trainer.data.flux": {"trainer.flux_data.build"},
        "trainer.checkpoint.local": {"trainer.data.text"},  # a neighbour of the same layer
        "trainer.job": {"trainer.step.plan", "trainer.nowhere"},  # a room no layer places
        "trainer.tasks.lm": {"trainer.step.loss", "trainer.tasks"},
    }
    assert upward_room_imports(edges) == [
        "trainer.checkpoint.local -> trainer.data.text",
        "trainer.data.flux -> trainer.flux_data.build",
        "trainer.job -> trainer.nowhere",
        "trainer.runtime.storage -> trainer.checkpoint.manifest",
    ]


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


# ------------------------------------------------------------------------- the periphery's rooms

PRODUCT_AND_SCRIPTS = (*LAYERS, "scripts")
USER_COMMANDS = {
    "train.sh": "train a recipe (README)",
    "test.sh": "run the test tiers (README, docs/testing.md)",
    "env.sh": "make or enter a venv: dev, tpu (docs/tpu.md)",
    "launch_pod.sh": "launch on a pod or locally (docs/launch.md)",
    "tpu_smoke.sh": "first contact with a TPU VM (docs/tpu.md)",
    "xla_env.sh": "the XLA tier's venvs for compiling without a TPU (docs/tpu.md)",
    "benchmark.py": "throughput and MFU of the variants, the TorchTitan peer (docs/benchmarks.md)",
    "check_recipe.py": "would a recipe start / compile on its target (docs/recipe_check.md)",
    "convert.py": "Hugging Face <-> DCP checkpoints (docs/checkpointing.md)",
    "estimate.py": "the pod planner (docs/planner.md)",
    "estimate_xla.py": "a recipe's program lowered and compiled for a TPU (docs/tpu.md)",
    "mfu_suite.py": "the MFU suite over the pod recipes (docs/benchmarks.md)",
    "sample.py": "images from a trained FLUX run (docs/flux_sampling.md)",
    "eval_flux.py": "a FLUX run's held-out prompt accuracy (docs/flux_sampling.md)",
}
"""The top level of scripts/: the commands a user runs, each documented in README.md or docs/."""
SYS_PATH_EXCEPTIONS = {
    # Run in venvs that do not install this project (so its packages are not importable there).
    "scripts/bench/reference_torchtitan.py": "runs in the TorchTitan peer venv (scripts/bench/peer_env.sh)",
    "scripts/bench/peer/torchtitan_cpu_shim.py": "TorchTitan imports it by module name in the peer venv",
    "scripts/bench/sweep_kernel_tiles.py": "runs in the XLA tier's jax venvs (scripts/xla_env.sh)",
}
"""Files of scripts/ and tools/ that must edit `sys.path`, and why."""


def _python_files(*tops: str) -> list[Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts)


def imports_tests(path: Path) -> list[str]:
    """The `tests` imports of a file (any form, function-local ones too)."""
    return [
        f"{module}.{name}" if name else module for module, name in _imports(path) if module.split(".")[0] == "tests"
    ]


def sys_path_edits(path: Path) -> list[int]:
    """Lines where a file changes `sys.path` (insert, append, extend, assignment) or adds a site dir."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        target = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("insert", "append", "extend"):
                target = node.func.value
            elif node.func.attr == "addsitedir":
                lines.append(node.lineno)
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        if isinstance(target, ast.Attribute) and target.attr == "path" and getattr(target.value, "id", "") == "sys":
            lines.append(node.lineno)
    return sorted(lines)


def test_nothing_in_the_product_or_scripts_imports_tests():
    bad = {str(p.relative_to(ROOT)): imports_tests(p) for p in _python_files(*PRODUCT_AND_SCRIPTS)}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_scripts_and_tools_do_not_insert_into_sys_path():
    edits = {str(p.relative_to(ROOT)): sys_path_edits(p) for p in _python_files("scripts", "tools")}
    found = {k: v for k, v in edits.items() if v}
    assert set(found) - set(SYS_PATH_EXCEPTIONS) == set(), {k: found[k] for k in set(found) - set(SYS_PATH_EXCEPTIONS)}
    stale = set(SYS_PATH_EXCEPTIONS) - set(found)
    assert not stale, f"no sys.path edit left in {sorted(stale)}: drop them from SYS_PATH_EXCEPTIONS"


def test_the_top_level_of_scripts_holds_only_user_commands():
    top = {p.name for p in (ROOT / "scripts").iterdir() if p.is_file()}
    assert top == set(USER_COMMANDS), (
        f"not user commands: {sorted(top - set(USER_COMMANDS))} (move them to scripts/data, scripts/bench or "
        f"scripts/dev); listed but missing: {sorted(set(USER_COMMANDS) - top)}"
    )
    docs = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    text = "\n".join(p.read_text() for p in docs)
    assert not [n for n in USER_COMMANDS if f"scripts/{n}" not in text], "a user command no page documents"


def test_the_periphery_checks_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import sys\nfrom tests.support import tiers\nsys.path.insert(0, 'x')\n"
        "def f():\n    import tests\n    sys.path.append('y')\n    sys.path[:0] = ['z']\n"
    )
    assert imports_tests(bad) == ["tests.support.tiers", "tests"]
    assert sys_path_edits(bad) == [3, 6, 7]
    good = tmp_path / "good.py"
    good.write_text(
        "import sys\nimport testsuite\nfrom trainer import tests\nprint(sys.path)\nx = [1]\nx.insert(0, 2)\n"
    )
    assert imports_tests(good) == [] and sys_path_edits(good) == []
