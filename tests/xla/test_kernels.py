"""Pallas kernels (titan_kernels/tpu) against the torch references of the ops they serve, without a TPU.

Four kinds of checks, each probe in its own subprocess (tests/xla/probes/kernels_*.py):
- interpret mode (xla venv): forward and backward of each kernel run in Pallas' interpreter on
  the CPU, float32, odd sizes (splash also with its full mask, the op `attention`: a padded
  length whose padded keys no real query may see); the same inputs go through the op's torch reference
  (models/common/ops.py), and both are compared with that reference in float64. Splash's
  backward is the residual one (titan_kernels/tpu/splash.py `backward`), and its lowered backward
  holds the backward kernel alone (the names of the Pallas calls in its jaxpr).
- the start-up self-check (titan_kernels/tpu/selfcheck.py) with the real kernels in interpret mode,
  bf16, as its implementations: it must pass them (the tolerance is argued there; the measured
  errors are recorded in docs/tpu.md).
- deviceless TPU compile (ttpu venv: libtpu 0.0.52, the one torch-tpu 0.2.0 runs): forward +
  backward of each kernel with each generation's tiles (titan_kernels/tpu/tiles.py), bf16, lowered
  with Mosaic and compiled by XLA:TPU for v4, v5e, v5p, v6e and TPU7x compile-only devices.
- torch-tpu registration (ttpu venv): the torch ops of titan_kernels/tpu/register.py defined
  through `jax_op`, run forward and backward on fake tensors.

Bound: a float32 sum of n products carries a rounding error of at most about n * u * (sum of
magnitudes), u = 2^-24; with the output's largest magnitude as the scale and a factor 2 for
the two sides (kernel vs reference each round), |x - exact| <= 2 * n * u * max|exact|, where n
is the case's longest reduction (attention: seq + head_dim; gmm: max(M, K, N); loss: N + vocab
+ dim). Measured errors sit 10-100x below it; a wrong mask, group or label costs O(scale).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24
GENERATIONS = ("v4", "v5e", "v5p", "v6e", "v7x")
KERNELS = ("splash", "splash_full", "gmm", "fused_ce")
RUNTIME_LIBTPU = "0.0.52"  # what torch-tpu 0.2.0 pins (its wheel's metadata; scripts/xla_env.sh ttpu)


@pytest.fixture(scope="module")
def interpreted_all(probe):
    """One probe process runs every kernel's cases (one jax + torch start-up)."""
    return probe("xla", "kernels_interpret.py", *KERNELS, "selfcheck", "splash_structure")


@pytest.fixture(scope="module")
def interpreted(interpreted_all):
    return interpreted_all["kernels"]


@pytest.mark.parametrize("kernel", KERNELS)
def test_interpret_matches_torch_reference(interpreted, kernel):
    cases = interpreted[kernel]
    assert len(cases) >= 2
    for case in cases:
        for name, out in case["outputs"].items():
            bound = 2 * case["n"] * U_FP32 * out["scale"]
            where = f"{kernel} {case['case']} {name}"
            assert out["scale"] > 0, f"{where}: all-zero reference, nothing compared"
            assert out["pallas_err"] <= bound, f"{where}: Pallas error {out['pallas_err']:.3g} > {bound:.3g}"
            assert out["torch_err"] <= bound, f"{where}: torch fp32 error {out['torch_err']:.3g} > {bound:.3g}"


def test_selfcheck_passes_the_real_kernels_in_bf16(interpreted_all):
    """The self-check's tolerance (2^-5 of scale) is argued from bf16 rounding; the real kernels,
    bf16 in and float32 accumulation as on the MXU, must pass it, with room to spare."""
    verdicts = interpreted_all["selfcheck"]
    assert set(verdicts) == {"causal_attention", "attention", "grouped_mm", "linear_cross_entropy"}
    for op, v in verdicts.items():
        assert v["ok"], f"{op}: {v['reason']}"
        assert 0 < v["worst"] < v["tolerance"] / 2, (op, v)


@pytest.mark.parametrize("mask", ["causal", "segments", "full"])
def test_splash_backward_runs_only_the_backward_kernel(interpreted_all, mask):
    """The forward saves (out, lse); the backward op calls the fused dq/dkv kernel on them, not
    the forward kernel again (as `jax.vjp` of the forward did)."""
    calls = interpreted_all["splash_structure"][mask]
    assert len(calls["forward"]) == 1 and "fwd" in calls["forward"][0] and "residuals" in calls["forward"][0], calls
    assert len(calls["backward"]) == 1 and "dkv" in calls["backward"][0], calls
    assert not any("fwd" in name for name in calls["backward"]), calls


@pytest.fixture(scope="module")
def compiled(probe):
    return probe("ttpu", "kernels_compile.py", "--cases", "small", *GENERATIONS, timeout=900)


def test_deviceless_tpu_compile_per_generation_with_the_runtime_libtpu(compiled):
    assert compiled["versions"]["libtpu"] == RUNTIME_LIBTPU, compiled["versions"]
    assert compiled["devices"] == {
        "v4": "TPU v4",
        "v5e": "TPU v5 lite",
        "v5p": "TPU v5",
        "v6e": "TPU v6 lite",
        "v7x": "TPU7x",
    }
    # Mosaic calls in the compiled program: splash forward + fused backward; its backward op
    # from residuals: the backward kernel alone; gmm: gmm, gmm (dx), tgmm (dw); the loss: 3.
    expected = {"splash": 2, "splash_bwd": 1, "gmm": 3, "fused_ce": 3, "fused_ce_8b": 3}
    for gen in GENERATIONS:
        for case, calls in expected.items():
            out = compiled["compiles"][f"{case}@{gen}"]
            assert "error" not in out, f"{case} on {gen} ({out.get('tiles')}): {out['error']}"
            assert out["mosaic_calls"] == calls, f"{case} on {gen}: {out}"


def test_each_generation_gets_its_own_tiles(compiled):
    # The 8B head's loss blocks follow each chip's VMEM: v4 (16 MiB) the smallest.
    blocks = {gen: compiled["compiles"][f"fused_ce_8b@{gen}"]["tiles"] for gen in GENERATIONS}
    assert blocks["v4"] == "block_n 128 block_v 128", blocks
    assert blocks["v5e"] != blocks["v4"], blocks
    for gen in GENERATIONS:
        out = compiled["compiles"][f"fused_ce_8b@{gen}"]
        assert out["est_vmem_mib"] <= out["limit_mib"], (gen, out)


def test_kernels_export_without_a_device(compiled):
    # torch-tpu's jax_op exports each kernel for "tpu" with no device at registration.
    for case, out in compiled["exports"].items():
        assert out["ok"], f"{case}: deviceless jax.export failed: {out}"


def test_torch_tpu_jax_op_registration(probe):
    """titan_kernels/tpu/register.py under torch-tpu 0.2.0 (no TPU): the ops are defined through
    jax_op, and each model-op implementation runs forward and backward on fake tensors (shapes
    and dtypes from jax_op's fake kernels, i.e. `jax.export` of the kernels for TPU)."""
    result = probe("ttpu", "kernels_register.py")
    expected = {
        "splash_fwd",
        "splash_bwd",
        "splash_seg_fwd",
        "splash_seg_bwd",
        "splash_full_fwd",
        "splash_full_bwd",
        "gmm",
        "gmm_bwd",
        "gmm_t",
        "gmm_t_bwd",
        "linear_ce_fwd",
        "linear_ce_bwd",
    }
    assert expected <= set(result["ops"]), result["ops"]
    for name, status in result["checks"].items():
        assert status == "ok", f"{name}: {status}"


def test_sweep_compile_mode_compiles_candidates_and_writes_the_table(tmp_path):
    """scripts/bench/sweep_kernel_tiles.py's compile mode (no TPU): three gmm candidates at a small
    fixed shape compiled for v6e with the runtime libtpu; each gets libtpu's static-profile cycles
    (which differ between the tiles), the pick is the cheapest, and the table records it. (v5e: the
    profiler aborts the process on the gmm's gather/scatter fusions, docs/tpu.md.)"""
    import json
    import subprocess

    from tests.xla.conftest import ROOT, _probe_env, xla_python

    out = tmp_path / "tiles.toml"
    run = subprocess.run(
        [
            str(xla_python("ttpu")),
            str(ROOT / "scripts" / "bench" / "sweep_kernel_tiles.py"),
            *("--mode", "compile", "--generation", "v6e", "--kernel", "gmm", "--shapes", "fixed"),
            *("--shape-class", "768x2048", "--gmm-rows", "4096", "--groups", "4", "--max-candidates", "3"),
            *("--out", str(out), "--json"),
        ],
        capture_output=True,
        text=True,
        env=_probe_env(),
        cwd=ROOT,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (result,) = json.loads(run.stdout.strip().splitlines()[-1])["results"]
    rows = result["candidates"]
    assert len(rows) == 3 and all(row["compiled"] and row["cycles"] > 0 for row in rows), rows
    assert len({row["cycles"] for row in rows}) > 1, rows  # the compiled cost depends on the tiles
    assert result["pick"] == min(rows, key=lambda r: r["cycles"])["tiles"]
    assert result["before"] == rows[0]["tiles"]  # today's pick is compiled first, for the ratio
    text = out.read_text()
    assert '"768x2048" = ' + json.dumps(result["pick"]) in text
    assert "--mode compile" in text and "static LLO profile" in text
