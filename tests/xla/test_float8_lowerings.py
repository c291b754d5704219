"""The torchax rules tools/xla_lowering adds for the float8 pod recipes (`ldexp`, the dtype
bitcast `view_copy.dtype`): bit for bit ATen's on the CPU. Without them the three FP8 pod recipes
did not lower (issue 50; docs/results/pod_compile_2026-12-06_*.csv)."""

import pytest

pytestmark = pytest.mark.xla


def test_float8_lowerings_equal_aten_bit_for_bit(probe):
    cases = probe("xla", "float8_lowerings.py")["cases"]
    assert set(cases) == {
        "ldexp",
        "round_to_float8",
        "float8_as_uint8",
        "uint8_as_float8",
        "bf16_as_uint8",
        "uint8_as_bf16",
    }
    for name, (equal, same_shape) in cases.items():
        assert same_shape and equal, name
