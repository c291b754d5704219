"""Context parallelism's delta-rule wrapper (parallelisms/context_parallel_linear.py) over the TPU
Pallas kernel interpreted on the CPU (tests/xla/probes/cp_delta_rule.py, xla venv).

The wrapper calls whatever serves `gated_delta_rule` at `dv + dk` value columns from the initial
state `[0 | I]`; on a TPU that is the Pallas kernel. Here, at cp 1 (the two local chunks are the
sequence's halves, no collective), the kernel-composed op under the wrapper equals the same op on
the whole sequence: outputs, final state and every gradient within 1e-5 of max|whole| (both are
fp32 computations of the same sums in another order, the bound of tests/unit/test_cp_linear_attention.py;
measured ~6e-7), and the second half from a zero state (no state passing) misses by O(1).
And the kernel compiles deviceless for v6e and TPU7x at those widths (dv + dk = 256 value columns,
a cp rank's two chunks of 4096 tokens as a batch, 32 heads): forward one Mosaic call, forward +
backward three, its VMEM estimate under the scoped limit.
"""

from __future__ import annotations

import pytest

from tests.xla.test_delta_rule_compile import GENERATIONS, assert_kernel_compiled

pytestmark = pytest.mark.xla


@pytest.fixture(scope="module")
def result(probe):
    return probe("xla", "cp_delta_rule.py", "interpret", "256", timeout=600)


@pytest.fixture(scope="module")
def compiled(probe):
    return probe("tpuc", "cp_delta_rule.py", "compile", *GENERATIONS, timeout=600)


def test_the_wrapper_over_the_interpreted_kernel_matches_the_whole_sequence(result):
    print(result)
    assert max(result["rel_to_max"].values()) <= 1e-5, result
    assert result["control_second_half_from_zero"] > 0.1, result


@pytest.mark.parametrize("gen", GENERATIONS)
def test_the_kernel_compiles_at_the_wrappers_widths(compiled, gen):
    assert compiled["shape"] == {"b": 2, "heads": 32, "s": 4096, "dk": 128, "dv": 256}, compiled["shape"]
    assert_kernel_compiled(compiled, gen)
