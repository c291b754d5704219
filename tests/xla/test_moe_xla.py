"""The Qwen 3 MoE model lowers to one XLA program (torchax, XLA:CPU): no host reads in routing,
dispatch or the experts' grouped matmul. Probe: tests/xla/probes/moe_torchax.py.

Bound: the same float32 math in two orders (torch eager vs XLA:CPU) over reductions of at most
n = 512 (vocab) terms: |loss - loss_torch| <= 4 * n * 2^-24 * loss, and gradients within
4 * n * 2^-24 * max|grad|.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

U_FP32 = 2.0**-24


def test_qwen3_moe_lowers_to_one_program(probe):
    r = probe("xla", "moe_torchax.py")
    assert r["host_callbacks"] == 0
    assert r["num_grads"] == r["num_params"]
    assert abs(r["loss"] - r["loss_torch"]) <= 4 * 512 * U_FP32 * r["loss_torch"], r
    assert r["max_grad_diff"] <= 4 * 512 * U_FP32 * r["grad_scale"], r
