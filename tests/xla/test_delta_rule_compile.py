"""The chunked gated delta rule's Pallas kernel compiled for TPU without one (tpuc venv).

tests/xla/probes/delta_rule.py `compile`: the forward (the Mosaic kernel) and forward + backward
(the forward kernel, its chunk-states pass and the backward kernel: three Mosaic calls) at Qwen 3.5 9B's Gated DeltaNet
widths (32 value heads, dk = dv = 128) over 4096 tokens, float32, lowered for and compiled by
XLA:TPU on v6e and TPU7x compile-only devices (`jax.experimental.topologies` over libtpu). The
numerics are tests/xla/test_delta_rule_kernel.py's (interpret mode).
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla

GENERATIONS = ("v6e", "v7x")


@pytest.fixture(scope="module")
def compiled(probe):
    return probe("tpuc", "delta_rule.py", "compile", *GENERATIONS, timeout=900)


def assert_kernel_compiled(compiled: dict, gen: str) -> None:
    """The probe's forward and forward + backward compiled on `gen`, with one and three Mosaic calls
    (the forward kernel; with the backward also the chunk states' forward pass and the backward
    kernel), the kernel's VMEM estimate under the scoped limit."""
    for name, kernels in (("forward", 1), ("forward+backward", 3)):
        out = compiled["compiles"][f"{name}@{gen}"]
        assert "error" not in out, f"{name} on {gen}: {out['error']}"
        assert out["mosaic_calls"] == kernels, out
        assert out["vmem_est_mib"] < out["scoped_vmem_limit_mib"], out


@pytest.mark.parametrize("gen", GENERATIONS)
def test_deviceless_compile_forward_and_backward(compiled, gen):
    assert_kernel_compiled(compiled, gen)
