"""The Qwen 3 MoE model lowers to one XLA program (torchax, XLA:CPU): no host reads in routing,
dispatch or the experts' grouped matmul; random routing lowers too and draws on XLA (int32) the
experts CPU torch draws (int64). Probe: tests/xla/probes/moe_torchax.py (one run for both tests).

Bound: the same float32 math in two orders (torch eager vs XLA:CPU) over reductions of at most
n = 512 (vocab) terms: |loss - loss_torch| <= 4 * n * 2^-24 * loss, and gradients within
4 * n * 2^-24 * max|grad|.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24


@pytest.fixture(scope="module")
def moe_probe(probe):
    return probe("xla", "moe_torchax.py")


def test_qwen3_moe_lowers_to_one_program(moe_probe):
    r = moe_probe
    assert r["host_callbacks"] == 0
    assert r["num_grads"] == r["num_params"]
    assert abs(r["loss"] - r["loss_torch"]) <= 4 * 512 * U_FP32 * r["loss_torch"], r
    assert r["max_grad_diff"] <= 4 * 512 * U_FP32 * r["grad_scale"], r


def test_random_routing_lowers_and_draws_what_cpu_draws(moe_probe):
    """The draw's 31-bit hash gives XLA's int32 arithmetic CPU's int64 bits: every row of 12 cases
    (E, k) in (8, 2), (128, 8), (256, 8), (384, 8), keys >= 2^30, tokens up to 2^31 - 1 the same."""
    r = moe_probe["random_routing"]
    assert r["key_dtype"] == "int32" and r["index_dtype"] == "int32", r  # the int32 path really ran
    assert r["max_key"] >= 2**30 and r["max_token"] == 2**31 - 1, r
    assert r["cases"] == 12 and r["rows"] == 12 * 1024, r
    assert r["mismatched_rows"] == 0, r
    assert r["distinct_ok"] and r["host_callbacks"] == 0, r
