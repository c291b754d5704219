"""Every shipped recipe passes the trainer's rules at the world size it declares.

`plan_job` is the build-free half of `build_job` (trainer/job.py): model args, parallel degrees
checked against the model and the sequence, and every rule of the step plan
(trainer/step/plan.py RULES). A recipe with `[job] target` is checked at that target's device
count and device type (a TPU target: the rules see `tpu`); a recipe without one at the world
its explicit degrees multiply to. The planner's search reads the same rules.
"""

import glob
import os
import re
import subprocess
import sys

import pytest
import torch

import planner
from models.errors import ConfigError
from tools.recipe_check import world_of
from trainer import build_job, plan_job
from trainer.config import build_config
from trainer.step import StepRequest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RECIPES = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


def test_pod_recipes_declare_their_target():
    pods = [r for r in RECIPES if "debug" not in os.path.basename(r)]
    assert pods and all(build_config(r).job.target for r in pods), pods


POD_RECIPES = [r for r in RECIPES if "debug" not in os.path.basename(r)]


@pytest.mark.parametrize("recipe", POD_RECIPES, ids=os.path.basename)
def test_pod_recipes_turn_on_both_compilation_caches(recipe):
    """Compile once on a pod (docs/tpu.md, "Compile cache"): every pod recipe sets torch-tpu's
    persistent cache (a per-host path by default) and the host cache."""
    cfg = build_config(recipe)
    assert cfg.compile.cache_dir and cfg.compile.host_cache, (cfg.compile.cache_dir, cfg.compile.host_cache)


def test_a_pod_recipe_sets_both_cache_variables_before_the_runtime_starts(monkeypatch):
    """The environment `build_job` applies on a TPU for a pod recipe holds both cache variables:
    the recipe's per-host path made absolute, and the same recipe with a shared gs:// folder
    (accepted by the rules, passed through as written)."""
    from trainer.runtime.tpu_env import HOST_CACHE_NAME, TIER2_CACHE_VAR, TIER3_CACHE_VAR, tpu_runtime_env

    monkeypatch.setenv("HOME", "/home/tpu-user")
    recipe = os.path.join(ROOT, "configs", "llama3_8b_128k_v7x.toml")
    for overrides, tier3 in (
        ([], "/home/tpu-user/.cache/titan-tpu/torch_tpu_compile"),
        ([("compile.cache_dir", "gs://bucket/titan-tpu/compile-cache")], "gs://bucket/titan-tpu/compile-cache"),
    ):
        cfg = build_config(recipe, overrides)
        world, device_type, _ = world_of(cfg)
        plan_job(cfg, world_size=world, device_type=device_type)  # the rules accept the folder
        env = tpu_runtime_env(
            device_type=device_type,
            generation="v7x",
            flag_bundle=cfg.device.flag_bundle,
            libtpu_init_args=cfg.device.libtpu_init_args,
            xla_flags=cfg.device.xla_flags,
            cache_dir=cfg.compile.cache_dir,
            host_cache=cfg.compile.host_cache,
            environ={},
            libraries=[],
        )
        assert env.env[TIER3_CACHE_VAR] == tier3 and env.env[TIER2_CACHE_VAR] == HOST_CACHE_NAME, env.env


@pytest.mark.parametrize("recipe", RECIPES, ids=os.path.basename)
def test_recipe_passes_the_rules_at_its_declared_degrees(recipe):
    cfg = build_config(recipe)
    world, device_type, _ = world_of(cfg)
    plan = plan_job(cfg, world_size=world, device_type=device_type)
    dims = plan.parallel_dims
    assert dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp == world
    assert plan.step_plan.mode == cfg.compile.mode
    assert plan.step_plan.scan == (cfg.compile.mode == "graph" and cfg.compile.scan_layers)


def test_scan_with_tensor_parallelism_is_accepted():
    """The 405B recipe once set TP 2 with layer scan, which the rules refused; the scan body now
    runs tensor-parallel blocks (parallelisms/scan.py), so plan_job and the planner accept it."""
    overrides = [("parallelism.tensor_parallel_degree", "2")]
    cfg = build_config(os.path.join(ROOT, "configs", "llama3_405b_v7x.toml"), overrides)
    plan = plan_job(cfg, world_size=512, device_type="tpu")
    assert plan.parallel_dims.tp == 2 and plan.step_plan.scan

    inputs = planner.PlanInputs(
        family=None,
        args=None,
        model_name="405B",
        seq_len=8192,
        local_batch_size=1,
        step=StepRequest(mode="graph", scan_layers=True),
    )
    target = planner.parse_target("v7x-512")
    assert not inputs.refusals(tp=2, ac_mode="full", target=target)
    assert not inputs.refusals(tp=1, ac_mode="full", target=target)


def test_a_refused_plan_builds_nothing(monkeypatch):
    """A combination the rules refuse (here the fused loss with TP) fails in build_job before the
    task, the mesh or the model exist; the planner skips it too."""
    inputs = planner.PlanInputs(
        family=None,
        args=None,
        model_name="405B",
        seq_len=8192,
        local_batch_size=1,
        step=StepRequest(mode="graph", fused_loss="on", model_has_hidden=True),
    )
    target = planner.parse_target("v7x-512")
    assert inputs.refusals(tp=2, ac_mode="full", target=target)
    assert not inputs.refusals(tp=1, ac_mode="full", target=target)

    import trainer.job as job_module

    def must_not_run(*a, **k):
        raise AssertionError("built something after a refused plan")

    for name in ("build_task", "build_mesh", "build_model", "build_optimizer_for"):
        monkeypatch.setattr(job_module, name, must_not_run)
    small = build_config(
        os.path.join(ROOT, "configs", "llama3_debug.toml"),
        [
            ("training.fused_loss", "on"),
            ("parallelism.tensor_parallel_degree", "2"),
            ("parallelism.data_parallel_shard_degree", "1"),
        ],
    )
    monkeypatch.setattr(
        job_module, "init_distributed", lambda device, **_: job_module.DistInfo(rank=0, world_size=2, local_rank=0)
    )
    with pytest.raises(ConfigError, match="training.fused_loss: on needs the whole vocabulary"):
        build_job(small)


# --- the recipe check: the trainer's start-up on the target's fake world (tools/recipe_check.py)


# Start-ups of a minute or more on 2 cores (61 MLA blocks captured on 512 / 1024 fake ranks: ~70 s each).
# Kimi K2 is DeepSeek-V3's architecture with other sizes: the default run starts the 671B recipe,
# the scheduled tier (TITAN_TEST_EXHAUSTIVE=1) Kimi K2 too; tests/unit/test_planner_deepseek.py plans both.
SLOW_STARTS = {"deepseek_v3_671b_v7x.toml": pytest.mark.slow, "kimi_k2_v7x.toml": pytest.mark.exhaustive}


@pytest.mark.parametrize(
    "recipe",
    [
        pytest.param(r, marks=SLOW_STARTS[os.path.basename(r)]) if os.path.basename(r) in SLOW_STARTS else r
        for r in RECIPES
    ],
    ids=os.path.basename,
)
def test_recipe_starts_on_its_target(recipe):
    """`check_recipe`: build_job (purpose check) at the target's world size on meta tensors, the
    step captured once, the planner's per-device memory within the usable HBM. On a TPU target a
    scanned step reaches the compiler with no flipped copies (torch-tpu's reverse-tagged scan)."""
    from tools.recipe_check import check_recipe

    r = check_recipe(recipe)
    assert r.ok, f"{os.path.basename(recipe)}: {r.error or f'{r.planned_gib:.1f} GiB > {r.hbm_gib:.1f} GiB usable'}"
    cfg = build_config(recipe)
    if cfg.compile.mode == "graph":
        assert "nodes" in r.capture and r.flips_gib == 0.0, r.capture
    if cfg.job.target:
        assert r.devices == planner.parse_target(cfg.job.target).devices


def test_the_check_counts_the_scans_flipped_copies_only():
    """`_flip_bytes` (the capture column's flips): `flip(x, [0])` feeding a scan and taken of a scan's
    output count; a flip of the model's own math (cumsum's backward: Qwen 3.5's chunked delta rule,
    an unscanned recipe) does not."""
    import operator

    from torch import fx

    from tools.recipe_check import _flip_bytes

    aten, g = torch.ops.aten, fx.Graph()

    def node(target, args, shape):
        n = g.call_function(target, args)
        n.meta["val"] = torch.empty(shape)
        return n

    x = g.placeholder("x")
    into = node(aten.flip.default, (x, [0]), (4, 8))  # 128 bytes
    scan = g.call_function(torch.ops.higher_order.scan, (None, [], [into], []))
    node(aten.flip.default, (g.call_function(operator.getitem, (scan, 0)), [0]), (4, 2))  # 32 bytes
    node(aten.flip.default, (node(aten.cumsum.default, (x, 0), (4, 8)), [0]), (4, 8))  # the model's own
    assert _flip_bytes(fx.GraphModule(torch.nn.Module(), g)) == 4 * (4 * 8 + 4 * 2)


def test_the_check_names_the_recipe_and_the_rule_or_the_shortfall(tmp_path):
    """scripts/check_recipe.py exits 1 with one `error:` line per recipe that would not start:
    the rule's key for a refusal, the GiB for a plan that does not fit; 0 when all pass. The four
    runs fork from one process that imported torch once (tests/support/contract_inputs.py)."""
    import json

    recipe = os.path.join("configs", "llama3_70b_v6e.toml")
    argvs = [
        [recipe],
        [recipe, "--parallelism.tensor_parallel_degree=2", "--training.fused_loss=on"],
        [recipe, "--training.local_batch_size=8"],
        [os.path.join("configs", "nope.toml")],
    ]
    cases = [{"argv": ["scripts/check_recipe.py", "--no-capture", *argv], "env": {}} for argv in argvs]
    todo, done = str(tmp_path / "cases.json"), str(tmp_path / "results.json")
    with open(todo, "w") as f:
        json.dump(cases, f)
    subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "support", "contract_inputs.py"), todo, done, str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT},
        check=True,
        timeout=600,
    )
    with open(done) as f:
        ok, refused, too_big, bad = json.load(f)

    assert ok["rc"] == 0, ok["stderr"]
    assert "llama3_70b_v6e.toml" in ok["stdout"] and "starts" in ok["stdout"]
    assert refused["rc"] == 1
    assert "error: configs/llama3_70b_v6e.toml: training.fused_loss:" in refused["stderr"]
    assert too_big["rc"] == 1
    assert re.search(
        r"error: configs/llama3_70b_v6e.toml: needs [\d.]+ GiB per device, 28.8 GiB usable on v6e-256",
        too_big["stderr"],
    ), too_big["stderr"]
    assert bad["rc"] == 2 and bad["stderr"].startswith("error:") and "Traceback" not in bad["stderr"]


def test_recipes_checked_in_one_process_do_not_leak_into_each_other():
    """`check_recipe.py --all` runs every recipe in one process: a context-parallel job serves
    `causal_attention` with a closure bound to its (fake) cp group, and the next job, in a new
    fake world, must not call it (before: `Could not resolve the process group registered under
    the name ...` for every recipe after a CP one). Each build_job starts from a clean op table."""
    from models.common import ops
    from tools.recipe_check import check_recipe

    debug = os.path.join(ROOT, "configs", "llama3_debug.toml")
    cp = check_recipe(
        debug, overrides=[("parallelism.context_parallel_degree", "2"), ("parallelism.data_parallel_shard_degree", "2")]
    )
    assert cp.ok and "cp 2" in cp.mesh, cp.error
    plain = check_recipe(debug)
    assert plain.ok, plain.error
    assert all(ops._impls.get(op) is None for op in ops.OPS)  # nothing left bound after the check
