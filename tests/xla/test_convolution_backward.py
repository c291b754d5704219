"""The torchax rule for ATen's convolution backward that tools/xla_lowering adds (Qwen 3.5's
depthwise causal conv1d; without it the Qwen 3.5 programs did not lower: "aten::convolution_backward
has no lowering"): dx, dw and db equal to ATen's on the CPU within float32 rounding (sums of at most
a few hundred products in another order: bound 1e-5 of the largest gradient)."""

import pytest

pytestmark = pytest.mark.xla


def test_convolution_backward_matches_aten(probe):
    cases = probe("xla", "convolution_backward.py")["cases"]
    assert set(cases) == {"depthwise_conv1d", "grouped_conv2d"}
    for name, outputs in cases.items():
        assert len(outputs) == 3, (name, outputs)  # dx, dw, db
        for k, (err, scale) in enumerate(outputs):
            assert scale > 0 and err <= 1e-5 * scale, (name, k, err, scale)
