"""Graph-mode pipeline parallelism's permute on XLA (tests/xla/probes/pipeline_permute.py): the
all_to_all_single with one nonzero split that `StagePermute` issues lowers, under
tools/tpu_compile.py's torchax rules (`permute_shift`), to one `collective_permute` per direction
(forward r -> r + 1, backward r -> r - 1) and moves the values as on gloo, over 2 and 4 XLA:CPU
devices in a shard_map as the pod compile lowers a program."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla


def test_stage_permute_lowers_to_one_collective_permute_each_way(probe):
    cases = probe("xla", "pipeline_permute.py")["cases"]
    assert set(cases) == {"2", "4"}
    for p, out in cases.items():
        for way in ("forward", "backward"):
            assert out[way], (p, way)
            assert out[f"{way}_permutes"] == 1 and out[f"{way}_all_to_all"] == 0, (p, out)
