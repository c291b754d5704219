"""The torchax rule for LayerNorm's backward that tools/xla_lowering adds (FLUX's programs use it):
equal to ATen's on the CPU within float32 rounding (the reduction orders differ: a few ulps of the
largest gradient, bound 1e-5 relative)."""

import pytest

pytestmark = pytest.mark.xla


def test_layer_norm_backward_matches_aten(probe):
    cases = probe("xla", "layer_norm_backward.py")["cases"]
    for name, outputs in cases.items():
        for k, pair in enumerate(outputs):
            if pair is None:
                assert name == "plain" and k > 0, (name, k)  # no weight: no weight or bias gradient
                continue
            err, scale = pair
            assert err <= 1e-5 * scale, (name, k, err, scale)
