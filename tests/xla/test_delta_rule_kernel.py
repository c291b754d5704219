"""The chunked gated delta rule's Pallas kernel (titan_kernels/tpu/delta_rule.py), without a TPU.

Probes (tests/xla/probes/delta_rule.py), each in its own venv's subprocess:
- interpret mode (xla venv): the op as a TPU run composes it (torch `_prepare`, then the JAX op:
  the Pallas forward and backward kernels interpreted on the CPU),
  float32, forward (output, final state) and gradients of q, k, v, g, beta and the initial state,
  at three shapes: 150 tokens (3 chunks of 64, the last padded) with GQA 1 -> 2 heads and an
  initial state; 2 x 128 tokens with documents (resets mid-chunk and on the chunk boundary, per
  row); 40 tokens (less than one chunk) with resets at token 0 and 17, no initial state. Compared
  with the token-by-token recurrence in float64 (the exact value), as is the torch reference
  `gated_delta.chunk_gated_delta_rule` (float32).
- the forward and backward ops exported for TPU (Mosaic lowering, what `jax_op` does): one kernel
  and two; deviceless compile: tests/xla/test_delta_rule_compile.py.
- the start-up self-check (titan_kernels/tpu/selfcheck.py) with the interpreted kernel as the
  implementation, bf16, at Qwen 3.5's widths (dk = dv = 128).
- torch-tpu registration (ttpu venv): `titan_tpu::gated_delta_fwd / _bwd` through `jax_op`, run
  forward and backward on fake tensors.

Bound (interpret): each result is a float32 computation whose longest chain of roundings is the
state's accumulation over the sequence (s tokens, and in the backward the reverse scan over the
same), a chunk's triangular solve and intra-chunk product (C = 64 terms each) and the readout
over dk and dv; with unit-norm keys, beta in (0, 1) and decays <= 1 each step's transition
`exp(g) (I - beta k k^T)` has norm <= 1, so rounding errors are not amplified from step to step.
The backward kernel recomputes the chunk's quantities and walks the chunks in reverse: the same
chains. So |x - exact| <= 2 n u max|exact| with n = s + 2 C + dk + dv and u = 2^-24 (the factor 2: the
kernel and the exact value's float32 inputs each round). Measured errors sit 10-100x below it
(docs/tpu.md); a wrong mask costs O(scale): the control (the resets dropped) is checked to miss
the bound by far.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24
CHUNK = 64


def _bound(case: dict, scale: float) -> float:
    shape = case["shape"]
    n = shape["s"] + 2 * CHUNK + shape["dk"] + shape["dv"]
    return 2 * n * U_FP32 * scale


@pytest.fixture(scope="module")
def interpreted(probe):
    return probe("xla", "delta_rule.py", "interpret", "selfcheck")


def test_interpreted_kernel_matches_the_float64_recurrence(interpreted):
    cases = interpreted["cases"]
    assert [c["case"] for c in cases] == ["gqa_padded_state", "documents_two_chunks", "short_documents_no_state"]
    for case in cases:
        want = {"out", "final_state", "dq", "dk", "dv", "dg", "dbeta"} | (
            {"dh0"} if case["case"] != cases[2]["case"] else set()
        )
        assert set(case["outputs"]) == want, case["outputs"].keys()
        for name, out in case["outputs"].items():
            where = f"{case['case']} {name}"
            bound = _bound(case, out["scale"])
            assert out["scale"] > 0, f"{where}: all-zero exact value, nothing compared"
            assert out["pallas_err"] <= bound, f"{where}: kernel error {out['pallas_err']:.3g} > {bound:.3g}"
            assert out["torch_err"] <= bound, f"{where}: torch fp32 error {out['torch_err']:.3g} > {bound:.3g}"


def test_dropping_the_resets_misses_the_bound_by_far(interpreted):
    """The comparison can fail: the documents case without its resets (state crossing documents)."""
    control = interpreted["control"]
    case = next(c for c in interpreted["cases"] if c["case"] == "documents_two_chunks")
    assert control["pallas_err"] > 100 * _bound(case, control["scale"]), control
    assert control["pallas_err"] > 0.05 * control["scale"], control


def test_torch_tpu_op_runs_forward_and_backward_on_fake_tensors(probe):
    result = probe("ttpu", "delta_rule.py", "register")
    assert result["ops"] == ["gated_delta_bwd", "gated_delta_fwd"], result
    for name, check in result["checks"].items():
        assert check == "ok", f"{name}: {check}"


def test_selfcheck_passes_the_real_kernel_in_bf16(interpreted):
    """The start-up self-check (2^-5 of scale, argued for bf16 roundings) with this kernel as the
    implementation, bf16 inputs at dk = dv = 128: it passes, with room to spare, and sees the
    output's bf16 rounding (worst > 0)."""
    v = interpreted["selfcheck"]
    assert v["ok"], v["reason"]
    assert 0 < v["worst"] < v["tolerance"] / 2, v


def test_the_backward_is_the_pallas_kernel(interpreted):
    """Exported for TPU (Mosaic lowering): the forward op is one kernel; the backward op is two, the
    forward kernel again (the chunk states) and the backward kernel, with no triangular solve of
    the plain-JAX form left in it."""
    exported = interpreted["export"]
    assert exported["forward"] == {"mosaic_calls": 1, "triangular_solves": 0}, exported
    assert exported["backward"] == {"mosaic_calls": 2, "triangular_solves": 0}, exported


def test_estimate_xlas_capture_ops_lower_to_the_kernels(probe):
    """scripts/estimate_xla.py's `titan_capture::gated_delta_fwd / _bwd`, lowered by
    `capture.add_lowerings` inside shard_map over a compile-only v6e:2x2 mesh (batch split): the
    forward is one Mosaic call, the backward two; each appended its kernel FLOPs (the compiler
    counts a Mosaic call as none), the backward's above the forward's."""
    result = probe("ttpu", "delta_rule.py", "capture")
    assert result["lowered"] == {"fwd": {"mosaic_calls": 1}, "bwd": {"mosaic_calls": 2}}, result
    costs = {name: flops for name, flops, _ in result["costs"]}
    # Per device: 1 row x 4 heads x 4 chunks of 64 at dk = dv = 128 (capture.gated_delta_cost).
    chunk_heads, c, d = 16, 64, 128
    assert costs["gated_delta_fwd"] == chunk_heads * (6 * c * c * d + 2 * c**3 + 4 * c * c * d + 6 * c * d * d)
    assert costs["gated_delta_bwd"] > 3 * costs["gated_delta_fwd"], costs
