"""What the pre-flight compile tools report when the compile does not simply fit (issue 50), and
that the per-device program's kernels take the target's tile-table blocks.

- scripts/estimate_xla.py `--json` prints one JSON line for every outcome: a program the compiler
  refused (CompileTimeHbmOom: "does not fit", exit 0), a worker that died or ran out of time
  ("failed", exit 1), a bad input ("refused", exit 2). It printed none for the refused 128k
  programs, and scripts/mfu_suite.py read "estimate_xla exited 0".
- tools/tpu_compile.py `compile_recipe` names libtpu's own check lines when the worker aborts,
  where it kept only the crash handler's last line ("Raising signal 6 with default behavior").
- tools/tpu_compile.py lowers every kernel op with the target's generation (tiles.toml's
  blocks): the causal splash took the default blocks, which hid the v6e splash backward's
  CompileTimeScopedVmemOom from `check_recipe.py --compile`.

The workers are stand-ins (`subprocess.run` answers with a canned result): no venv, no compile.
"""

import importlib.util
import json
import subprocess
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEBUG = str(ROOT / "configs" / "llama3_debug.toml")

# libtpu 0.0.52's abort of flux_dev_v7x's compile (docs/results/flux_dev_v7x_abort_2026-12-06_835223d.txt),
# shortened: the check line, its repeat in the crash report, the crash handler's RAW lines last.
CHECK = (
    "fusion_emitter.cc:13652] Check failed: rank == best_window_bounds_in_chunks.size() Cannot find a valid "
    "window for %bitcast_add_fusion.68 = bf16[18432,3072]{1,0:T(16,128)(2,1)} fusion(%param.0, %param.1)"
)
ABORT_STDERR = "\n".join(
    [
        "W1206 13:32:20.647144   26372 tpu_latency_hiding_scheduler_utils.cc:119] CostModel::GetCycles cannot "
        "model bitcast_add_fusion.68 in module jit_per_device; using fallback scheduling cost.",
        "I1206 13:32:30.703656   26372 deepsea_compiler_hlo_passes.cc:6905] HLO_PASSES stage duration: 56.6s",
        f"F1206 13:58:24.067303   28899 {CHECK}",
        "*** Check failure stack trace: ***",
        "    @     0x7f3c1a2b3c4d  (unknown)",
        "*** SIGABRT received by PID 28899 (TID 28899) on cpu 1 from PID 28899; stack trace: ***",
        f"F1206 13:58:24.067303   28899 {CHECK}",
        "E1206 13:58:24.716901   28899 coredump_hook.cc:301] RAW: Remote crash data gathering hook invoked.",
        "E1206 13:58:24.717057   28899 process_state.cc:796] RAW: Raising signal 6 with default behavior",
    ]
)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_reports_test", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _worker(monkeypatch, returncode: int = 0, stdout: str = "", stderr: str = "", raises=None) -> list:
    """`subprocess.run` as a stand-in worker (xla_env.sh answers a venv path); the worker calls."""
    calls = []

    def run(cmd, *a, **kw):
        if cmd[0] == "bash":
            return subprocess.CompletedProcess(cmd, 0, stdout="/nonexistent/.venv-ttpu\n", stderr="")
        calls.append(cmd)
        if raises is not None:
            raise raises
        return subprocess.CompletedProcess(cmd, returncode, stdout=stdout, stderr=stderr)

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def _json_lines(out: str) -> list[dict]:
    return [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]


def test_estimate_xla_json_has_one_line_for_every_outcome(monkeypatch, capsys):
    """Before the change the refused program printed its verdict but no JSON line (exit 0), and the
    other three outcomes printed none either."""
    estimate_xla = _script("estimate_xla")
    argv = ["--config", DEBUG, "--target", "v6e-4", "--json"]
    oom = {"required": 171.01 * 2**30, "available": 31.24 * 2**30, "message": "CompileTimeHbmOom: ..."}
    refused = dict(devices=4, device_kind="TPU v6 lite", capture_s=1.0, lower_s=2.0, compile_s=3.0, oom=oom)
    _worker(monkeypatch, stdout=json.dumps(refused) + "\n")
    assert estimate_xla.main(argv) == 0
    out = capsys.readouterr().out
    assert "verdict (compiler, 6 layers): does not fit" in out  # the human line stays
    (line,) = _json_lines(out)
    assert line["verdict"] == "does not fit" and line["target"] == "v6e-4" and line["topology"] == "v6e:2x2"
    assert "CompileTimeHbmOom" in line["reason"] and "171.01 GiB" in line["reason"] and line["oom"] == oom
    assert out.strip().splitlines()[-1].startswith("{")  # the last line, as --json promises

    _worker(monkeypatch, returncode=-6, stderr=ABORT_STDERR)
    assert estimate_xla.main(argv) == 1
    (line,) = _json_lines(capsys.readouterr().out)
    assert line["verdict"] == "failed" and CHECK[:120] in line["reason"] and "Raising signal" not in line["reason"]

    _worker(monkeypatch, raises=subprocess.TimeoutExpired(["worker"], 5))
    assert estimate_xla.main([*argv, "--timeout", "5"]) == 1
    (line,) = _json_lines(capsys.readouterr().out)
    assert line["verdict"] == "failed" and line["reason"] == "the compile took longer than 5 s"

    calls = _worker(monkeypatch)
    assert estimate_xla.main(["--config", DEBUG, "--json"]) == 2  # llama3_debug names no [job] target
    captured = capsys.readouterr()
    (line,) = _json_lines(captured.out)
    assert line == {"verdict": "refused", "reason": captured.err.removeprefix("error: ").strip()}
    assert line["reason"].startswith("job.target: the recipe names no target") and not calls


def test_compile_recipe_names_libtpus_check_line_when_the_worker_aborts(monkeypatch):
    """Before the change the report's error was the last stderr line, the crash handler's."""
    from tools.tpu_compile import compile_recipe

    _worker(monkeypatch, returncode=-6, stderr=ABORT_STDERR)
    report = compile_recipe(DEBUG, overrides=[("job.target", "v6e-8")], python=sys.executable)
    assert report.verdict == "failed"
    assert report.error.startswith(f"RuntimeError: compile worker: exit -6: F {CHECK[:200]}")
    assert report.error.count("Cannot find a valid window") == 1  # the crash report's repeat dropped
    assert "Raising signal" not in report.error and "RAW:" not in report.error
    # a stderr without libtpu's check lines: its last line, as before
    _worker(monkeypatch, returncode=1, stderr="Traceback (most recent call last):\nImportError: no torchax\n")
    report = compile_recipe(DEBUG, overrides=[("job.target", "v6e-8")], python=sys.executable)
    assert report.error == "RuntimeError: compile worker: ImportError: no torchax"
    # a capture that failed inside the worker: its error, where a capture-only report had none
    refusal = "ValueError: compile.mode: eager: the TPU program compile takes graph-mode recipes"
    _worker(monkeypatch, stdout=json.dumps({"error": refusal}) + "\n")
    report = compile_recipe(DEBUG, overrides=[("job.target", "v6e-8")], python=sys.executable, capture_only=True)
    assert report.error == refusal and report.verdict == "failed"


CAPTURE_OPS = [f"splash{kind}_{way}" for kind in ("", "_seg", "_full") for way in ("fwd", "bwd")]
CAPTURE_OPS += [f"sink{kind}_{way}" for kind in ("", "_seg") for way in ("fwd", "bwd")]
CAPTURE_OPS += ["gmm", "gmm_bwd", "ce_fwd", "ce_bwd", "gated_delta_fwd", "gated_delta_bwd"]
CAPTURE_OPS += [f"q{kind}_{way}" for kind in ("linear", "linear_w8", "gmm") for way in ("fwd", "bwd")]
"""Every op of titan_kernels/tpu/capture.py (`_define`)."""


KERNEL_MODULES = ("splash", "gmm", "fused_ce", "delta_rule", "qmatmul", "qgmm")
# delta_rule's (its chunk is fixed), and the low-precision matmuls' (plain XLA dots: no blocks)
NO_GENERATION = {"forward", "backward", "forward_w8", "backward_w8"}


class _Arg:
    """A stand-in tensor of the lowering rules (the group sizes' `astype` included)."""

    def astype(self, dtype):
        return self

    def __iter__(self):  # a kernel's tuple of outputs
        return iter((self,))


def test_every_kernel_op_is_lowered_with_the_targets_generation(monkeypatch):
    """The torchax rules of the per-device program, run on stand-in jax / torchax / kernel modules
    that record the `generation` each kernel is called with. Before the change the causal splash
    (with and without segment ids, forward and backward) was called without one: the default
    blocks, not tiles.toml's for the target."""
    import titan_kernels.tpu as tpu
    from titan_kernels.tpu import capture
    from tools import tpu_compile

    seen: dict[str, list] = {}

    def kernel(name):
        def fn(*args, generation=None, **kw):
            seen.setdefault(name, []).append(generation)
            return args[0]

        return fn

    class Kernels(types.SimpleNamespace):  # every function of a kernel module records its generation
        def __getattr__(self, name):
            return kernel(name)

    fakes = {
        "jax.numpy": types.SimpleNamespace(int32="int32"),
        "torchax.interop": types.SimpleNamespace(call_jax=lambda fn, *args: fn(*args)),
        **{f"titan_kernels.tpu.{name}": Kernels() for name in KERNEL_MODULES},
    }
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(
        sys.modules,
        "jax",
        types.SimpleNamespace(vjp=lambda f, *xs: (f(*xs), lambda d: xs), numpy=sys.modules["jax.numpy"], lax=None),
    )
    monkeypatch.setitem(sys.modules, "torchax", types.SimpleNamespace(interop=sys.modules["torchax.interop"]))
    for name in KERNEL_MODULES:
        monkeypatch.setattr(tpu, name, sys.modules[f"titan_kernels.tpu.{name}"], raising=False)
    capture._define()
    tpu_compile._define_program_ops()
    rules = {}
    env = types.SimpleNamespace(override_op_definition=lambda op, fn: rules.__setitem__(op, fn))
    tpu_compile._lowerings(env, axis_names=["a0"], groups={"0": [0]}, radices=[1], generation="v6e")

    ops = [op for op in rules if op._schema.name.startswith("titan_capture::")]
    assert {op._schema.name.split("::")[1] for op in ops} >= set(CAPTURE_OPS)
    for op in ops:
        seen.clear()
        n_args = len(op._schema.arguments)
        rules[op](*[_Arg() for _ in range(n_args)])
        assert seen, op
        # The delta rule's kernel and the float8 / int8 dots have no blocks to choose: no generation.
        assert all(gens == ["v6e"] for name, gens in seen.items() if name not in NO_GENERATION), (op, seen)


def _stand_in_worker(monkeypatch) -> list[dict]:
    """subprocess.run stood in for compile_recipe: the venv lookup answers, the worker fails at
    import; returns the list the worker's environments are appended to."""
    envs = []

    def run(cmd, *a, **kw):
        if cmd[0] == "bash":
            return subprocess.CompletedProcess(cmd, 0, stdout="/nonexistent/.venv-ttpu\n", stderr="")
        envs.append(kw["env"])
        return subprocess.CompletedProcess(cmd, 1, stdout="", stderr="ImportError: stand-in\n")

    monkeypatch.setattr(subprocess, "run", run)
    return envs


def test_the_runs_libtpu_flags_reach_the_compile_worker(monkeypatch):
    """The worker's LIBTPU_INIT_ARGS is what the run's first compile gets (trainer/runtime/tpu_env.py):
    the generation's flag bundle (`[device] flag_bundle = "auto"`, the default), then the recipe's
    own flags (flux_dev_v7x's: libtpu 0.0.52 aborts without it), then the caller's exported ones (the
    caller wins for the same flag); `flag_bundle = "none"` and no flags add nothing. Before, the
    bundle was left out, so a bundle flag libtpu refuses for the chip (the all-gather continuation
    fusion on v6e / v7x) passed the check and stopped the run at step 1."""
    from tools.tpu_compile import compile_recipe
    from trainer.runtime.tpu_env import BUNDLES

    envs = _stand_in_worker(monkeypatch)
    v7x = list(BUNDLES["v7x"].libtpu_init_args)
    flag = "--xla_tpu_control_large_2nd_minor_layout_for_x16=false"
    vmem = "--xla_tpu_scoped_vmem_limit_kib=32768"
    monkeypatch.setenv("LIBTPU_INIT_ARGS", vmem)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    compile_recipe(str(ROOT / "configs" / "flux_dev_v7x.toml"), python=sys.executable)
    # The bundle's scoped-VMEM flag is replaced in place by the caller's value; the recipe's flag follows.
    assert envs[-1]["LIBTPU_INIT_ARGS"].split() == [f if "scoped_vmem" not in f else vmem for f in v7x] + [flag]
    monkeypatch.setenv("LIBTPU_INIT_ARGS", flag.replace("false", "true"))
    compile_recipe(str(ROOT / "configs" / "flux_dev_v7x.toml"), python=sys.executable)
    assert envs[-1]["LIBTPU_INIT_ARGS"].split() == [*v7x, flag.replace("false", "true")]
    monkeypatch.delenv("LIBTPU_INIT_ARGS")
    compile_recipe(DEBUG, overrides=[("job.target", "v6e-8")], python=sys.executable)
    assert envs[-1]["LIBTPU_INIT_ARGS"].split() == list(BUNDLES["v6e"].libtpu_init_args)
    compile_recipe(DEBUG, overrides=[("job.target", "v6e-8"), ("device.flag_bundle", "none")], python=sys.executable)
    assert "LIBTPU_INIT_ARGS" not in envs[-1] and "XLA_FLAGS" not in envs[-1]


def test_a_callers_xla_flags_layer_over_the_recipes(monkeypatch):
    """`compile_recipe`'s `extra_env` (the projection's `--xla_dump_to`) is layered over the recipe's
    flags (tools/tpu_compile.py `layer_worker_env`): the recipe's first, the caller's after, a flag
    named in both the caller's; other variables are the caller's. Before, the caller's XLA_FLAGS
    replaced the recipe's `[device] xla_flags`, so a dumped compile was not the recipe's program."""
    from tools.tpu_compile import compile_recipe, layer_worker_env

    recipe = {"XLA_FLAGS": "--xla_a=1 --xla_b=2", "LIBTPU_INIT_ARGS": "--xla_tpu_c=1"}
    env = layer_worker_env(recipe, {"XLA_FLAGS": "--xla_b=3 --xla_dump_to=/d", "OTHER": "x"})
    assert env == {
        "XLA_FLAGS": "--xla_a=1 --xla_b=3 --xla_dump_to=/d",
        "LIBTPU_INIT_ARGS": "--xla_tpu_c=1",
        "OTHER": "x",
    }
    assert layer_worker_env({}, {"XLA_FLAGS": "--xla_d=1"}) == {"XLA_FLAGS": "--xla_d=1"}
    assert layer_worker_env(recipe, None) == recipe
    # Through compile_recipe, with the worker stood in (as above).
    envs = _stand_in_worker(monkeypatch)
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    overrides = [("job.target", "v6e-8"), ("device.xla_flags", '["--xla_a=1", "--xla_b=2"]')]
    report = compile_recipe(DEBUG, overrides=overrides, python=sys.executable, extra_env={"XLA_FLAGS": "--xla_b=3"})
    assert envs[-1]["XLA_FLAGS"] == "--xla_a=1 --xla_b=3", envs[-1]["XLA_FLAGS"]
    assert report.flags["XLA_FLAGS"] == "--xla_a=1 --xla_b=2"  # the run's flags, as recorded


def test_no_bundle_asks_for_the_all_gather_continuation_fusion_off_v5e():
    """libtpu 0.0.52 refuses `--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true` at the
    first compile on every generation but v5e (FAILED_PRECONDITION 'Continuation fusion for AllGather
    ... not supported/recommended on platforms other than TPU v5e', deviceless v6e and v7x compiles;
    tests/xla/test_tpu_program.py compiles each bundle). The shipped v6e and v7x bundles asked for it."""
    from trainer.runtime.tpu_env import BUNDLES

    fusion = "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=true"
    asking = sorted(name for name, b in BUNDLES.items() if fusion in b.libtpu_init_args)
    assert all(set(BUNDLES[n].generations) == {"v5e"} for n in asking), asking
