"""Splash attention with sinks and a sliding window (the op `sink_attention`: gpt-oss) without a TPU.

The probe tests/xla/probes/sink_splash.py runs `splash.splash_sink_attention` (JAX's splash with
its own sinks, a `LocalMask` window or the causal mask, the residual backward, dsinks in float32)
in Pallas' interpreter on the CPU in float32, forward and backward (q, k, v, sinks), against the
op's torch reference `ops.sdpa_sink_attention` (gpt-oss's formulation); both are compared with
that reference in float64. Cases: GQA and MQA, lengths of 200 and 300 (padded to the 128
tile), windows of 48 and 100, a full layer, documents (segment ids), and the traced window
(an int32 array that picks the sliding or the causal kernel on the device, as gpt-oss's per-layer
buffer under a layer scan). `compile`: the Mosaic kernels (forward, backward from residuals, both
windows behind the device-side pick) compiled deviceless for v6e and TPU7x at gpt-oss's head
width (64), GQA 8 / 2, 1000 tokens, window 128, bf16. `register`: the torch-tpu ops of
titan_kernels/tpu/register.py on fake tensors (the ttpu venv, no TPU). `selfcheck`: the start-up
self-check with the real kernel (interpret mode, bf16) as its implementation.

Bound, as tests/xla/test_kernels.py: a float32 sum of n products is off by at most about
n u (sum of magnitudes), u = 2^-24; with the output's largest magnitude as the scale and a factor
2 for the two sides, |x - exact| <= 2 n u max|exact|, n the longest reduction (a row: s keys
and d channels; dsinks: b s rows, each a d-term row sum). Measured errors sit 10-100x below it
(docs/kernels.md); a wrong window, a dropped sink or a wrong kernel picked moves outputs by
O(scale).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24


def _check(result: dict, n_cases: int) -> None:
    assert len(result["cases"]) == n_cases, result
    for case in result["cases"]:
        for name, out in case["outputs"].items():
            bound = 2 * case["n"][name] * U_FP32 * out["scale"]
            where = f"{case['case']} {name}"
            assert out["scale"] > 0, f"{where}: all-zero reference, nothing compared"
            assert out["pallas_err"] <= bound, f"{where}: Pallas error {out['pallas_err']:.3g} > {bound:.3g}"
            assert out["torch_err"] <= bound, f"{where}: torch fp32 error {out['torch_err']:.3g} > {bound:.3g}"


def test_sink_splash_interpret_matches_the_torch_reference(probe):
    _check(probe("xla", "sink_splash.py", "interpret", timeout=900), 5)


def test_sink_splash_compiles_deviceless_for_v6e_and_v7x(probe):
    result = probe("tpuc", "sink_splash.py", "compile", "v6e", "v7x", timeout=900)
    for gen in ("v6e", "v7x"):
        out = result["compiles"][gen]
        assert "error" not in out, f"{gen}: {out['error']}"
        # forward and the fused backward, each for the sliding and the causal mask (the pick)
        assert out["mosaic_calls"] == 4, (gen, out)


def test_sink_splash_torch_tpu_ops_run_forward_and_backward_on_fake_tensors(probe):
    """titan_kernels/tpu/register.py's `sink_attention` under torch-tpu 0.2.0 (no TPU): the
    `titan_tpu::sink_splash_w{W}_*` ops defined through jax_op per window, forward and backward
    (dq, dk, dv, dsinks) on fake tensors with a tensor window, with segment ids, and an int window;
    the forward ops are among those selective AC saves."""
    result = probe("ttpu", "sink_splash.py", "register")
    assert result["checks"] == {"tensor_window": "ok", "tensor_window_segments": "ok", "int_window": "ok"}, result
    for w in (128, 64):
        assert {f"sink_splash_w{w}{part}" for part in ("_fwd", "_bwd", "_seg_fwd", "_seg_bwd")} <= set(result["ops"])
        assert f"titan_tpu::sink_splash_w{w}_fwd" in result["saved"], result["saved"]


def test_sink_splash_selfcheck_passes_the_real_kernel_in_bf16(probe):
    """The start-up self-check's tolerance (2^-5 of scale) is argued from bf16 rounding; the real
    kernel in interpret mode, bf16 in and float32 accumulation as on the MXU, at gpt-oss's head
    width and window (64, 128), must pass both of its cases with room to spare."""
    v = probe("xla", "sink_splash.py", "selfcheck")
    assert v["ok"], v["reason"]
    assert v["checked"] == "head 64, window 128 and full", v
    assert 0 < v["worst"] < v["tolerance"] / 2, v
