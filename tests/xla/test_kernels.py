"""Pallas kernels (kernels/tpu) against the torch references of the ops they serve, without a TPU.

Three kinds of checks, each probe in its own subprocess (tests/xla/probes/kernels_*.py):
- interpret mode (xla venv): forward and backward of each kernel run in Pallas' interpreter on
  the CPU, float32, odd sizes; the same inputs go through the op's torch reference
  (models/common/ops.py), and both are compared with that reference in float64.
- deviceless TPU compile (tpuc venv): forward + backward of each kernel, bf16, lowered with
  Mosaic and compiled by XLA:TPU for v5e, v6e and TPU7x compile-only devices.
- torch-tpu registration (ttpu venv): the torch ops of kernels/tpu/register.py defined
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

U_FP32 = 2.0 ** -24
CHIPS = ("v5e:2x2", "v6e:2x2", "tpu7x:2x2x1")
KERNELS = ("splash", "gmm", "fused_ce")


@pytest.fixture(scope="module")
def interpreted(probe):
    """One probe process runs every kernel's cases (one jax + torch start-up)."""
    return probe("xla", "kernels_interpret.py", *KERNELS)["kernels"]


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


def test_deviceless_tpu_compile(probe):
    result = probe("tpuc", "kernels_compile.py", *CHIPS)
    assert set(result["devices"]) == set(CHIPS)
    for chip in CHIPS:
        for kernel in (*KERNELS, "fused_ce_8b"):
            out = result["compiles"][f"{kernel}@{chip}"]
            assert "error" not in out, f"{kernel} on {chip}: {out['error']}"
            # Mosaic kernels survive into the TPU program (forward and backward).
            assert out["mosaic_calls"] >= 2, f"{kernel} on {chip}: {out}"
    # torch-tpu's jax_op exports each kernel for "tpu" with no device at registration.
    for kernel in KERNELS:
        assert result["exports"][kernel]["ok"], f"{kernel}: deviceless jax.export failed: {result['exports'][kernel]}"


def test_torch_tpu_jax_op_registration(probe):
    """kernels/tpu/register.py under torch-tpu 0.2.0 (no TPU): the ops are defined through
    jax_op, and each model-op implementation runs forward and backward on fake tensors (shapes
    and dtypes from jax_op's fake kernels, i.e. `jax.export` of the kernels for TPU)."""
    result = probe("ttpu", "kernels_register.py")
    expected = {"splash_fwd", "splash_bwd", "splash_seg_fwd", "splash_seg_bwd", "gmm", "gmm_bwd", "gmm_t",
                "gmm_t_bwd", "linear_ce_fwd", "linear_ce_bwd"}
    assert expected <= set(result["ops"]), result["ops"]
    for name, status in result["checks"].items():
        assert status == "ok", f"{name}: {status}"
