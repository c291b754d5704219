"""Every refusal says what is allowed (CONTRIBUTING.md: `error: KEY: what is wrong; allowed: ...`).

Scans the product's source with `ast` for calls of `ConfigError` (and its subclasses and the
helpers that build one) and fails on a message literal (str, f-string, or a concatenation of
them) with no `allowed:` part. A placeholder that names a string constant of the same module
(`{_ALLOWED}`) counts as its text. A message built entirely at run time is listed in
`RUN_TIME_MESSAGES`, with the reason it is fine.
"""

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("models", "titan_kernels", "parallelisms", "trainer", "planner", "tools", "scripts")
RAISERS = {
    "ConfigError",  # models/errors.py
    "UnmappableAxis",  # parallelisms/tpu_topology.py
    "FolderInUse",  # trainer/runtime/runlock.py
    "EngineError",  # trainer/engine.py
    "CorruptCheckpointError",  # trainer/checkpoint/manifest.py
    "_config_error",  # trainer/runtime/storage.py, trainer/runtime/atomic.py
}
# `allowed:`, or a qualified form the rule table uses: `allowed here:`, `allowed with X = y:`.
ALLOWED = re.compile(r"\ballowed\b[^:;]{0,40}:")

# (file, enclosing function, a fragment of the message expression's source; "" = every raise
# there) -> why that message needs no `allowed:` literal of its own.
RUN_TIME_MESSAGES = {
    ("trainer/runtime/storage.py", "_config_error", "message"): "the helper itself: its callers' literals are checked",
    ("trainer/runtime/atomic.py", "_config_error", "message"): "the helper itself: its callers' literals are checked",
    ("trainer/step/plan.py", "plan_step", "refused[0]"): "a rule table message (test_step_plan checks allowed)",
    ("planner/search.py", "_checked_step", "refused[0]"): "a rule table message (trainer/step/plan.py's refusals)",
    ("tools/recipe_check.py", "check_recipe", "refused[0]"): "a rule table message (a pipelined plan's refusals)",
    ("trainer/checkpoint/manager.py", "_load_local", "first"): "re-raises another rank's ConfigError text",
    ("trainer/engine.py", "_check_usable", "self._unusable"): "`_unusable` is only set to texts with `allowed: ...`",
    (
        "trainer/hf_convert.py",
        "_convert_from_hf",
        "{what}{allowed}",
    ): "adds `allowed:` unless the adapter's text has one",
    ("trainer/config/load.py", "model_args", "e.args[0]"): "re-raises models/'s registry error, which has `allowed:`",
    ("trainer/config/load.py", "model_args", "model.{e}"): (
        "re-raises a model args' own ValueError (models/*/args.py), which names the field; those are not ConfigErrors"
    ),
    # A detail, never shown alone: every caller (manager, initial, local tier, trainer/hf_convert.py)
    # catches CorruptCheckpointError and wraps its text in a message with its own `allowed:`.
    ("trainer/checkpoint/manifest.py", "verify_checkpoint", ""): "a detail every caller wraps with `allowed:`",
    ("trainer/checkpoint/remote.py", "verify_checkpoint", ""): "a detail every caller wraps with `allowed:`",
}


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _text(node: ast.AST, consts: dict[str, str]) -> str | None:
    """The literal text of a message expression, `{}` for a run-time part; None if no literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(
            v.value if isinstance(v, ast.Constant) else consts.get(_name(v.value) or "", "{}") for v in node.values
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mod)):
        left, right = _text(node.left, consts), _text(node.right, consts)
        return None if left is None and right is None else (left or "{}") + (right or "{}")
    if isinstance(node, ast.IfExp):  # each literal branch must say what is allowed
        texts = [t for t in (_text(node.body, consts), _text(node.orelse, consts)) if t is not None]
        if not texts:
            return None
        return next((t for t in texts if not ALLOWED.search(t)), texts[0])
    return None


def _constants(tree: ast.Module) -> dict[str, str]:
    """name -> text of the module's string assignments (`_ALLOWED = "allowed: ..."`, local ones too)."""
    consts: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            text = _text(node.value, {})
            name = node.targets[0].id
            if text is not None and (name not in consts or ALLOWED.search(text)):
                consts[name] = text
    return consts


def scan(source: str, path: str, raisers=frozenset(RAISERS)) -> tuple[int, list[str], list[str]]:
    """(raises found, literal messages with no `allowed:`, run-time messages not in the allow-list)."""
    tree = ast.parse(source)
    consts = _constants(tree)
    found, missing, unlisted = 0, [], []

    def visit(node: ast.AST, function: str) -> None:
        nonlocal found
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function = node.name
        if isinstance(node, ast.Call) and _name(node.func) in raisers and node.args:
            found += 1
            text = _text(node.args[0], consts)
            where = f"{path}:{node.lineno} ({function})"
            expression = ast.unparse(node.args[0])
            if any((p, f) == (path, function) and fragment in expression for p, f, fragment in RUN_TIME_MESSAGES):
                pass
            elif text is None:
                unlisted.append(f"{where}: {expression}")
            elif not ALLOWED.search(text):
                missing.append(f"{where}: {text[:120]}")
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "<module>")
    return found, missing, unlisted


def _product_files() -> list[Path]:
    return sorted(p for root in PRODUCT for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)


def test_every_config_error_says_what_is_allowed():
    found, missing, unlisted = 0, [], []
    for file in _product_files():
        n, m, u = scan(file.read_text(), file.relative_to(REPO).as_posix())
        found, missing, unlisted = found + n, missing + m, unlisted + u
    assert found > 300, f"found only {found} ConfigError raises; did the scan miss a folder?"
    assert not missing, "ConfigError messages without `allowed: ...`:\n" + "\n".join(missing)
    assert not unlisted, "messages built at run time; say why each is fine in RUN_TIME_MESSAGES:\n" + "\n".join(
        unlisted
    )


# Config-facing paths whose user errors are plain ValueErrors (models/ imports only torch, DESIGN.md):
# their messages reach the user as `error:` lines, so they say what is allowed too.
VALUE_ERROR_PATHS = {
    "models/": "model args, flavors and HF state dicts / configs: trainer/config/load.py `model_args` and the "
    "initial loads print them as `error: model.<field>: ...`",
}


def test_every_model_value_error_says_what_is_allowed():
    """`raise ValueError("...")` in a config-facing path (VALUE_ERROR_PATHS) says what is allowed."""
    found, missing, unlisted = 0, [], []
    for root in VALUE_ERROR_PATHS:
        for file in sorted((REPO / root).rglob("*.py")):
            n, m, u = scan(file.read_text(), file.relative_to(REPO).as_posix(), RAISERS | {"ValueError"})
            found, missing, unlisted = found + n, missing + m, unlisted + u
    assert found > 80, f"found only {found} raises in {list(VALUE_ERROR_PATHS)}; did the scan miss a folder?"
    assert not missing, "ValueError messages without `allowed: ...`:\n" + "\n".join(missing)
    assert not unlisted, "ValueError messages built at run time:\n" + "\n".join(unlisted)


def test_allow_list_has_no_stale_entries():
    """Each allow-listed function still raises a run-time message (no entry outlives its raise)."""
    raised: set[tuple[str, str]] = set()
    for file in _product_files():
        path = file.relative_to(REPO).as_posix()
        if not any(path == p for p, _, _ in RUN_TIME_MESSAGES):
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if any(isinstance(c, ast.Call) and _name(c.func) in RAISERS for c in ast.walk(node)):
                    raised.add((path, node.name))
    listed = {(p, f) for p, f, _ in RUN_TIME_MESSAGES}
    assert listed <= raised, listed - raised


def test_the_scan_fails_on_a_message_without_allowed():
    """The check can fail: each literal form without `allowed:` is found, and the allowed forms pass."""
    bad = (
        'raise ConfigError("training.steps: must be >= 1")\n'
        'raise ConfigError(f"{key}: {value!r} unknown")\n'
        'raise UnmappableAxis("x: " + f"{n} does not divide", axis="x", size=1, split=False)\n'
        'raise _config_error(f"{key}: cannot create" if a else "b; allowed: c")\n'
    )
    assert len(scan(bad, "x.py")[1]) == 4
    good = (
        '_ALLOWED = "allowed: a positive integer"\n'
        'raise ConfigError(f"training.steps: {n}; {_ALLOWED}")\n'
        'raise ConfigError("device.type: cuda; allowed here: cpu, auto")\n'
        'raise EngineError("engine.x: " + f"{n}; allowed: 1")\n'
    )
    assert scan(good, "x.py") == (3, [], [])
    assert scan("raise ConfigError(message)\n", "x.py")[2] == ["x.py:1 (<module>): message"]


# --- The refusal table closes both ways (DESIGN.md: every refusal of a combination lives in one
# table). A ConfigError is raised by a rule of `trainer/step/plan.py: RULES`, by a function that
# `trainer/step/checks.py: BUILD_CHECKS` names, or in one of the modules below, whose refusals each
# judge one key's own value or one input file / folder / environment variable, never a combination.
# tools/ (the pre-flight package) is in scope too: its refusals of a recipe's combination are rules
# (the recipe check's slice count against job.target is one); what is left there is listed in
# SINGLE_KEY_MODULES (one key) or TOOL_ONLY (not a recipe's combination).
TABLE_SCOPE = ("trainer", "parallelisms", "planner", "models", "titan_kernels", "tools")
RULE_TABLE_MODULES = ("trainer/step/plan.py", "trainer/step/checks.py")
SINGLE_KEY_MODULES = {
    # A folder ("x/"), a module, or "module path:function": what its refusals judge, one thing each.
    "models/errors.py": "check_choice: the one refusal of a value outside its key's choices",
    "parallelisms/device_order.py:check_spec": "parallelism.device_order's own form (its fit to the world: BUILD_CHECKS)",
    "models/hf/model.py": "model.hf_config: what its config.json describes (its scan form: BUILD_CHECKS)",
    "models/flux/conditioning.py": "the FLUX encoders' folders (files)",
    "planner/targets.py": "job.target / --target: one target's name",
    "tools/tpu_compile.py:topology_name": "job.target: one target's compile-only topology",
    "tools/tpu_compile.py:_recipe_target": "job.target: the TPU compile needs one, of a TPU",
    "tools/xla_estimate_run.py:recipe_target": "job.target / --target: the compile estimate needs one",
    "trainer/config/load.py": "the recipe file and the CLI: a key's own type, choice and range, unknown keys",
    "trainer/config/placeholders.py": "checkpoint.folder: a shipped recipe's placeholder bucket",
    "trainer/launch.py": "the launcher's own command line",
    "trainer/platforms.py": "the scheduler's or TPU VM's variables (the launch plan per platform)",
    "trainer/data/": "data set, tokenizer and shard files, and a data loader's saved state (files)",
    "trainer/flux_data/": "the FLUX data builder's own parameters, a built data set's files and a loader's state",
    "trainer/checkpoint/": "checkpoint folders and files: their presence, format and contents",
    "trainer/runtime/storage.py": "a storage path (gs:// bucket, shared folder)",
    "trainer/runtime/atomic.py": "a folder that cannot be made or written",
    "trainer/runtime/runlock.py": "a run folder another run holds, or whose lock (a file, a gs:// object) cannot be made",
    "trainer/runtime/tpu_env.py:check_flags": "a [device] flag's own form (--name[=value])",
    "trainer/engine.py": "the engine's API: its caller's arguments (EngineError) and the folder it loads",
    "trainer/tasks/flux_sample.py": "the sampler's own arguments (steps, guidance scale)",
    "trainer/flux_run.py": "the sampler's command line: a training run's folder and its checkpoints",
    "trainer/hf_convert.py": "the converter's input and output: a checkpoint or Hugging Face folder and its files, "
    "the destination folder, --hf-format's own value and the model family's FP8 hub format",
}
TOOL_ONLY = {
    # "module path:function" in tools/: raises that are not a recipe's combination, so no rule.
    "tools/recipe_check.py:check_recipe": "re-raises the first RULES refusal the planner noted (a pipelined plan)",
    "tools/recipe_check.py:tpu_mesh_check": "torch-tpu's own verdict on the mesh (its venv), the pre-flight "
    "form of BUILD_CHECKS' parallelisms.parallel_dims:_tpu_rank_grid",
    "tools/xla_estimate_run.py:estimate": "the compile estimate's own scope: it captures the LM step (model.name's "
    "task), a limit of the tool, not of the recipe",
    "tools/xla_estimate_run.py:expert_parallel_program": "estimate_xla's own flags (--dump-hlo, --csv, ...) that its "
    "EP path does not take: a combination of the tool's flags",
}


def _module_name(path: str) -> str:
    name = path.removesuffix(".py").replace("/", ".")
    return name.removesuffix(".__init__")


def raise_sites(source: str, path: str) -> list[tuple[str, int]]:
    """("module:Qual.name", line) of every `raise` of a RAISERS call in `source`."""
    sites = []

    def visit(node: ast.AST, qual: tuple[str, ...]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            qual = (*qual, node.name)
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and _name(node.exc.func) in RAISERS:
            sites.append((f"{_module_name(path)}:{'.'.join(qual)}", node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, qual)

    visit(ast.parse(source), ())
    return sites


def refusals_outside_the_tables(files: dict[str, str], build_checks: set[str]) -> list[str]:
    """`path:line (module:function)` of each raise that is neither a rule, in a BUILD_CHECKS
    function (or one nested in it), nor in a SINGLE_KEY_MODULES module."""
    out = []
    for path, source in files.items():
        if path in RULE_TABLE_MODULES or _listed(path, SINGLE_KEY_MODULES):
            continue
        for where, line in raise_sites(source, path):
            function = where.partition(":")[2]
            if f"{path}:{function.split('.')[0]}" in SINGLE_KEY_MODULES | TOOL_ONLY:
                continue
            if not any(where == w or where.startswith(w + ".") for w in build_checks):
                out.append(f"{path}:{line} ({where})")
    return out


def _listed(path: str, entries) -> bool:
    return path in entries or any(e.endswith("/") and path.startswith(e) for e in entries)


def _table_scope_files() -> dict[str, str]:
    files = sorted(p for root in TABLE_SCOPE for p in (REPO / root).rglob("*.py") if ".venv" not in p.parts)
    return {p.relative_to(REPO).as_posix(): p.read_text() for p in files}


def test_every_refusal_lives_in_a_table_or_a_single_key_module():
    """A ConfigError raised outside RULES, BUILD_CHECKS' functions, SINGLE_KEY_MODULES and TOOL_ONLY
    is a refusal no table names: move it into RULES (config only) or name it in BUILD_CHECKS (the
    recipe check's slice count against job.target, tools/recipe_check.py world_of, was one)."""
    from trainer.step.checks import BUILD_CHECKS

    files = _table_scope_files()
    offenders = refusals_outside_the_tables(files, {c.where for c in BUILD_CHECKS})
    assert not offenders, "refusals outside RULES / BUILD_CHECKS / SINGLE_KEY_MODULES:\n" + "\n".join(offenders)

    def raises(entry: str) -> bool:
        path, _, function = entry.partition(":")
        sites = [
            w
            for p in files
            if p == path or (path.endswith("/") and p.startswith(path))
            for w, _ in raise_sites(files[p], p)
        ]
        return any(not function or w.partition(":")[2].split(".")[0] == function for w in sites)

    stale = [e for e in SINGLE_KEY_MODULES | TOOL_ONLY if not raises(e)]
    assert not stale, f"SINGLE_KEY_MODULES / TOOL_ONLY entries that raise nothing: {stale}"


def test_the_table_scan_fails_on_a_refusal_outside_the_tables():
    """The reverse check can fail: a raise in an unlisted module is found, a BUILD_CHECKS function's
    (and a function nested in it) is not."""
    source = (
        "class A:\n"
        "    def check(self):\n"
        "        def inner():\n"
        '            raise ConfigError("k: x; allowed: y")\n'
        "def other():\n"
        '    raise ConfigError("k: x; allowed: y")\n'
    )
    assert refusals_outside_the_tables({"trainer/x.py": source}, {"trainer.x:A.check"}) == [
        "trainer/x.py:6 (trainer.x:other)"
    ]
    assert refusals_outside_the_tables({"trainer/step/plan.py": source}, set()) == []
    # tools/ is in the scan's scope: a new raise there is found unless its function is listed.
    assert refusals_outside_the_tables({"tools/recipe_check.py": source}, set()) == [
        "tools/recipe_check.py:4 (tools.recipe_check:A.check.inner)",
        "tools/recipe_check.py:6 (tools.recipe_check:other)",
    ]
    assert "tools" in TABLE_SCOPE
