"""The TPU runtime environment (trainer/runtime/tpu_env.py), on the CPU with the TPU side injected:
flag bundles and their merge into LIBTPU_INIT_ARGS / XLA_FLAGS, the refusals (exit 2, one line),
torch-tpu's compilation-cache variables, the cache-miss counter, the profiler choice
(trainer/runtime/profiler.py), the block compile's SPMD annotation, and the per-step scalars that
reach a captured program as inputs.

Nothing here imports torch-tpu; the XLA tier checks the bundles against the runtime's libtpu.so
(tests/xla/test_tpu_flags.py) and the annotation against torch-tpu's SplitCompiler
(tests/xla/test_torch_tpu_path.py, `compile_blocks*`).
"""

from __future__ import annotations

import contextlib
import io
import types

import pytest
import torch

from models.errors import ConfigError
from trainer.runtime import tpu_env
from trainer.runtime.profiler import profile_step, profiler_plan
from trainer.runtime.tpu_env import (
    BUNDLES,
    FLAG_BUNDLES,
    TIER2_CACHE_VAR,
    TIER3_CACHE_VAR,
    CacheMissCounter,
    merge_flags,
    tpu_runtime_env,
)

CF = "--xla_tpu_enable_async_collective_fusion=true"


def _env(**kwargs):
    kwargs.setdefault("device_type", "tpu")
    kwargs.setdefault("generation", "v6e")
    kwargs.setdefault("environ", {})
    kwargs.setdefault("libraries", [])  # no runtime library: no name check (tested below)
    return tpu_runtime_env(**kwargs)


# --- bundles -----------------------------------------------------------------------------------------


def test_a_bundle_per_generation_each_flag_with_its_source():
    assert set(BUNDLES) == {"v4", "v5e", "v5p", "v6e", "v7x"}
    for name, bundle in BUNDLES.items():
        assert bundle.generations == (name,)
        flags = [*bundle.libtpu_init_args, *bundle.xla_flags]
        assert flags, name
        for flag in flags:
            assert bundle.sources[tpu_env.flag_name(flag)].strip(), (name, flag)
    # The scoped VMEM limit never exceeds the core's VMEM (v6e 128 MiB, v7x 64 MiB:
    # jax/_src/pallas/mosaic/tpu_info.py); v4/v5e/v5p keep libtpu's default.
    vmem = {n: [f for f in b.libtpu_init_args if "scoped_vmem_limit_kib" in f] for n, b in BUNDLES.items()}
    assert vmem == {
        "v4": [],
        "v5e": [],
        "v5p": [],
        "v6e": ["--xla_tpu_scoped_vmem_limit_kib=98304"],
        "v7x": ["--xla_tpu_scoped_vmem_limit_kib=65536"],
    }


def test_config_choices_are_the_bundles():
    import dataclasses

    from trainer.config import DeviceConfig

    field = next(f for f in dataclasses.fields(DeviceConfig) if f.name == "flag_bundle")
    assert field.metadata["choices"] == FLAG_BUNDLES == ("auto", "none", *BUNDLES)


def test_auto_takes_the_generations_bundle_and_the_recipe_and_environment_override_it():
    out = _env(
        libtpu_init_args=["--xla_tpu_scoped_vmem_limit_kib=65536", "--xla_foo=1"],
        environ={"LIBTPU_INIT_ARGS": "--xla_foo=2 --xla_bar"},
    )
    flags = out.env["LIBTPU_INIT_ARGS"].split()
    # Bundle order first, then new names; the recipe replaced the bundle's VMEM value, the
    # environment the recipe's --xla_foo.
    assert flags == [
        *BUNDLES["v6e"].libtpu_init_args[:-1],
        "--xla_tpu_scoped_vmem_limit_kib=65536",
        "--xla_foo=2",
        "--xla_bar",
    ]
    assert "XLA_FLAGS" not in out.env
    assert any("bundle v6e" in line for line in out.notes)


def test_none_and_unknown_generation_set_only_the_recipes_flags():
    out = _env(flag_bundle="none", xla_flags=["--xla_dump_to=/tmp/d"])
    assert out.env == {"XLA_FLAGS": "--xla_dump_to=/tmp/d"}
    out = _env(generation=None)
    assert out.env == {} and any("none recorded for an unknown TPU generation" in n for n in out.notes)


def test_merging_is_idempotent_so_a_launcher_may_export_it_first():
    first = _env(libtpu_init_args=["--xla_foo=1"])
    again = _env(libtpu_init_args=["--xla_foo=1"], environ=dict(first.env))
    assert again.env == first.env
    assert merge_flags(["--a=1", "TPU_X=1"], ["--a=2"], ["TPU_X=1"]) == ["--a=2", "TPU_X=1"]


def test_a_bundle_of_another_generation_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^device\.flag_bundle: 'v6e' is recorded for v6e, and this host is v5p; "
        r"allowed here: auto, none, v5p$",
    ):
        _env(flag_bundle="v6e", generation="v5p")


@pytest.mark.parametrize("flag", ["xla_foo=1", "-xla_foo", "--", 3])
def test_a_malformed_flag_is_refused(flag):
    with pytest.raises(ConfigError, match=r"^device\.libtpu_init_args: .* is not a flag; allowed:"):
        _env(libtpu_init_args=[flag])


def test_flag_names_are_checked_against_the_runtime_library(tmp_path):
    lib = tmp_path / "libtpu.so"
    names = {tpu_env.flag_name(f) for b in BUNDLES.values() for f in b.libtpu_init_args}
    # As a flag table stores them: NUL-terminated C strings, some sharing a tail with a longer one.
    lib.write_bytes(b"\0garbage\0" + b"\0".join(n.encode() for n in sorted(names)) + b"\0my_xla_tail_flag\0")
    ok = _env(libraries=[lib], libtpu_init_args=["--xla_tail_flag=1"])
    assert "--xla_tail_flag=1" in ok.env["LIBTPU_INIT_ARGS"]
    with pytest.raises(
        ConfigError,
        match=r"^device\.libtpu_init_args: '--xla_tpu_scoped_vmem_limit=1' is not a flag "
        r"of the installed TPU runtime",
    ):
        _env(libraries=[lib], libtpu_init_args=["--xla_tpu_scoped_vmem_limit=1"])
    with pytest.raises(ConfigError, match=r"^LIBTPU_INIT_ARGS \(bundle or environment\): '--typo_flag'"):
        _env(libraries=[lib], environ={"LIBTPU_INIT_ARGS": "--typo_flag"})


def test_nothing_is_set_on_cpu_and_the_settings_are_named():
    out = tpu_runtime_env(
        device_type="cpu", generation=None, flag_bundle="v6e", libtpu_init_args=["--a=1"], cache_dir="/x", environ={}
    )
    assert out.env == {}
    assert out.notes == ["titan-tpu: flag_bundle, libtpu_init_args, cache_dir not applied on cpu (TPU only)"]
    assert tpu_runtime_env(device_type="cuda", generation=None, environ={}).notes == []


# --- compilation cache ---------------------------------------------------------------------------------


def test_compilation_cache_variables(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = _env(cache_dir="cache/tpu", host_cache=True)
    assert out.env[TIER3_CACHE_VAR] == str(tmp_path / "cache" / "tpu")
    assert out.env[TIER2_CACHE_VAR] == "titan-tpu"
    assert _env(cache_dir="gs://bucket/cc").env[TIER3_CACHE_VAR] == "gs://bucket/cc"
    # Unset keys leave what the environment exports, and the banner says what is in effect.
    kept = _env(environ={TIER3_CACHE_VAR: "/shared/cc"})
    assert TIER3_CACHE_VAR not in kept.env
    assert (
        f"titan-tpu: compilation cache: tier 1 in memory; tier 2 host cache off (torch-tpu turns it off in a "
        f"world of 1); tier 3 persistent cache on ({TIER3_CACHE_VAR}=/shared/cc)" in kept.notes
    )
    assert any(
        n.endswith("tier 2 host cache off (torch-tpu turns it off in a world of 1); tier 3 off") for n in _env().notes
    )


def test_the_banner_says_tier_2_is_on_in_every_multi_process_run():
    """torch-tpu enables its host cache itself ('default') whenever the world has more than one
    process; host_cache only names it. The banner said "in memory only" for such a run."""
    line = [n for n in _env(environ={"WORLD_SIZE": "8"}).notes if "compilation cache" in n][0]
    assert "tier 2 host cache on (torch-tpu's default for 8 processes, name 'default'); tier 3 off" in line
    named = [n for n in _env(host_cache=True, environ={"WORLD_SIZE": "8"}).notes if "compilation cache" in n][0]
    assert f"tier 2 host cache on ({TIER2_CACHE_VAR}=titan-tpu)" in named
    assert "in memory only" not in line


def test_compile_cache_dir_takes_gs_paths(tmp_path):
    """docs/tpu.md and docs/config.md give pods `compile.cache_dir = "gs://..."`: the key takes it
    (torch-tpu's tier-3 root reads gs://); a malformed URL is one error naming the key."""
    from models.errors import ConfigError
    from trainer.config import build_config
    from trainer.runtime.storage import check_storage_paths

    check_storage_paths(build_config("configs/llama3_debug.toml", [("compile.cache_dir", "gs://bucket/cc")]))
    with pytest.raises(ConfigError, match=r"^compile\.cache_dir: 'gs://Bad_Bucket/cc' is a malformed gs:// URL"):
        check_storage_paths(build_config("configs/llama3_debug.toml", [("compile.cache_dir", "gs://Bad_Bucket/cc")]))


def test_apply_sets_the_process_environment():
    environ = {"KEEP": "1"}
    _env(cache_dir="gs://b/c").apply(environ)
    assert environ[TIER3_CACHE_VAR] == "gs://b/c" and environ["KEEP"] == "1"


def test_cache_miss_counter_reports_growth_only():
    reads = iter([5, 9, 9, 10])
    counter = CacheMissCounter("tpu", read=lambda: next(reads))
    assert counter.total == 5
    line = counter.step_done(1)
    assert line == "titan-tpu: compile cache misses at step 1: +4 (total 9)" and line.startswith(
        tpu_env.CACHE_MISS_LINE
    )
    assert counter.step_done(2) is None and counter.total == 9
    assert counter.step_done(3) == "titan-tpu: compile cache misses at step 3: +1 (total 10)"
    off = CacheMissCounter("cpu")
    assert off.total is None and off.step_done(1) is None and off.compiled() is None


def test_compilations_read_torch_tpus_cache_stats():
    """`compilations` (metrics.jsonl) is torch-tpu's `_get_cache_stats().num_compilations` (a
    PerfStats with num_cache_hits / num_cache_reqs / num_compilations in the 0.2.0 wheel)."""
    stats = types.SimpleNamespace(num_cache_hits=3, num_cache_reqs=10, num_compilations=7)
    assert tpu_env.compilations("tpu", types.SimpleNamespace(_get_cache_stats=lambda: stats)) == 7
    assert tpu_env.compilations("tpu", types.SimpleNamespace()) is None  # a torch-tpu without the stats
    assert tpu_env.compilations("cpu") is None
    counter = CacheMissCounter("tpu", read=lambda: 4, read_compiled=lambda: 2)
    assert counter.total == 4 and counter.compiled() == 2


def test_cache_misses_read_torch_tpus_counter():
    fake = types.SimpleNamespace(_get_cache_misses=lambda: 7)
    assert tpu_env.compile_cache_misses("tpu", tpu_module=fake) == 7
    assert tpu_env.compile_cache_misses("tpu", tpu_module=types.SimpleNamespace()) is None
    assert tpu_env.compile_cache_misses("cpu", tpu_module=fake) is None


# --- profiling -------------------------------------------------------------------------------------------


class _FakeTpuProfilerConfig(torch.profiler._ExperimentalConfig):
    calls: list = []

    def __init__(self, **kwargs):
        super().__init__()
        type(self).calls.append(kwargs)


def test_tpu_profiling_uses_torch_tpus_profiler_config():
    fake_tpu = types.SimpleNamespace(profiler=types.SimpleNamespace(TpuProfilerConfig=_FakeTpuProfilerConfig))
    plan = profiler_plan("tpu", folder="/out/step-3", rank=5, tpu_module=fake_tpu)
    assert _FakeTpuProfilerConfig.calls[-1] == {"run_dir": "/out/step-3", "worker_rank": "5"}
    assert isinstance(plan.kwargs["experimental_config"], _FakeTpuProfilerConfig)
    assert plan.kwargs["activities"] == [
        torch.profiler.ProfilerActivity.CPU,
        torch.profiler.ProfilerActivity.PrivateUse1,
    ]
    assert not plan.chrome_trace


def test_cpu_profiling_writes_a_chrome_trace(tmp_path):
    plan = profiler_plan("cpu", folder=str(tmp_path), rank=0)
    assert plan.chrome_trace and "experimental_config" not in plan.kwargs
    trace = tmp_path / "step-1" / "rank0_trace.json"
    with profile_step(plan, trace_path=str(trace)):
        torch.ones(4) @ torch.ones(4)
    assert trace.stat().st_size > 0


# --- compile mode: the SPMD annotation -------------------------------------------------------------------


def test_compile_mode_traces_each_block_under_the_annotation():
    """`apply_compile(spmd_safe=...)` wraps each block's forward inside the compiled region (a
    stand-in of torch-tpu's decorator: `torch.fx.traceback.annotate` under compile, as torch-tpu
    0.2.0's does), keeping module paths; the forward of every block is the annotated one."""
    from models.llama3.plan import PLAN
    from parallelisms.compile import apply_compile
    from tests.support.graph_common import build_model

    def spmd_safe(fn):
        def wrapper(*args, **kwargs):
            with torch.fx.traceback.annotate({"spmd_safe": True}):
                return fn(*args, **kwargs)

        return wrapper

    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = build_model(2)
    keys = list(model.state_dict())
    reference = build_model(2)
    apply_compile(model, plan=PLAN, backend=backend, spmd_safe=spmd_safe)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)
    assert list(model.state_dict()) == keys
    assert graphs, "no block was compiled"
    for gm in graphs:
        ops = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
        assert ops and all(n.meta.get("custom", {}).get("spmd_safe") for n in ops), gm.graph
    torch._dynamo.reset()


# --- per-step scalars reach the programs as data ---------------------------------------------------------


def _trace(fn, *args):
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn)(*args)


def test_nonfinite_tracker_step_is_device_data():
    """The tracker's update is the same program at every step: the step number is a device tensor
    it counts, not a constant. The control (a Python int step, as before) gives a program per step."""
    from trainer.callbacks import NonFiniteTracker

    def traced_update(start_step):
        tracker = NonFiniteTracker(torch.device("cpu"), start_step)

        def update(norm, step, first, skipped):
            tracker.step, tracker.first_bad_step, tracker.skipped = step, first, skipped
            tracker.update(norm)
            return tracker.step, tracker.first_bad_step, tracker.skipped

        return _trace(update, torch.tensor(float("nan")), tracker.step, tracker.first_bad_step, tracker.skipped)

    assert traced_update(3).code == traced_update(4).code
    assert not [n for n in traced_update(3).graph.nodes if n.op == "get_attr"]

    def old_update(step):
        return lambda norm, first: torch.where(~torch.isfinite(norm) & (first == 0), step, first)

    control = [_trace(old_update(s), torch.tensor(1.0), torch.zeros((), dtype=torch.int64)).code for s in (3, 4)]
    assert control[0] != control[1]

    tracker = NonFiniteTracker(torch.device("cpu"), start_step=10)
    for norm in (1.0, float("inf"), 2.0, float("nan")):
        tracker.update(torch.tensor(norm))
    assert tracker.read() == (12, 2) and int(tracker.step) == 14


def test_graph_step_takes_the_lr_as_an_input():
    """Three steps at three learning rates: one captured graph, whose inputs include a 0-dim fp32
    tensor (the lr) and in which none of the three values is a constant."""
    from tests.support.graph_common import PLAN, batches, build_model, build_opt
    from trainer.graph import build_graph_step

    model = build_model(1)
    step = build_graph_step(model=model, optimizer=build_opt(model), max_norm=1.0, backend="aot_eager", plan=PLAN)
    lrs = (1e-4, 2.5e-4, 7.5e-5)
    for data, lr in zip(batches(3), lrs):
        step(data, lr)
    assert step.capture.num_graphs == 1
    gm = step.graph_module
    scalars = [
        n
        for n in gm.graph.nodes
        if n.op == "placeholder"
        and isinstance(n.meta.get("val"), torch.Tensor)
        and n.meta["val"].dim() == 0
        and n.meta["val"].dtype == torch.float32
    ]
    assert scalars, "no 0-dim fp32 input"
    constants = [a for n in gm.graph.nodes for a in (*n.args, *n.kwargs.values()) if isinstance(a, float)]
    assert not any(c == pytest.approx(lr, rel=1e-9) for c in constants for lr in lrs), constants
    assert float(step._lr) == pytest.approx(lrs[-1])


# --- the trainer's refusal ---------------------------------------------------------------------------------


def test_bad_flag_bundle_is_one_error_line_exit_2():
    from trainer.train import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--device.flag_bundle=v9", "--print-config"])
    assert code == 2
    assert err.getvalue() == (
        "error: device.flag_bundle: 'v9' is not allowed; allowed: auto, none, v4, v5e, v5p, v6e, v7x\n"
    )
