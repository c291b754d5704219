"""The layer scan's host offload (`[activation_checkpoint] offload = "block_inputs"`) lowered by
torchax with tools/xla_lowering's rules: the hand-built scan pair of tests/unit/test_scan_offload.py
after the pass, jitted on XLA:CPU, equals the graph run by torch before it, with the ops as copies
(the XLA tier) and as `jax.device_put` to pinned host memory and back (the TPU program compile's
rule). XLA and torch sum the matmuls in different orders: a few ulps of the largest output
(measured 9.5e-7 of 6.2), bound 1e-5 relative."""

import pytest

pytestmark = pytest.mark.xla


def test_offloaded_scan_pair_lowers_and_matches_torch(probe):
    res = probe("xla", "host_offload.py")
    for name in ("copy", "host"):
        assert len(res[name]) == 3, res
        for err, scale in zip(res[name], res["scale"]):
            assert scale > 0 and err <= 1e-5 * scale, (name, err, scale)
