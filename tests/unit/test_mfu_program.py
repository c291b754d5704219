"""scripts/mfu_suite.py's projection from the trainer's program (tools/mfu_projection.py): the kernels' scaling to the
routed rows, the dispatch ops, and the weak-scaling arithmetic. No compile, no jax."""

from pathlib import Path

import pytest

from tools import mfu_projection as suite
from tools import xla_projection as xp

ROOT = Path(__file__).resolve().parents[2]


def test_gmm_priced_at_the_routed_rows():
    """The program's grouped matmuls run over a worst-case buffer (every peer's rows landing here);
    megablox sizes its grid from the group sizes, so the kernel is priced at the routed rows."""
    cost = {
        "gmm": {"calls": 2.0, "flops": 8e12, "bytes": 8e9, "rows": 8192},
        "splash_fwd": {"calls": 1.0, "flops": 1e12, "bytes": 1e9, "rows": 0},
    }
    t = suite.kernel_times(cost, [], routed_rows=1024, peak=1e12, hbm=1e9)
    assert t["gmm"]["flops"] == pytest.approx(1e12) and t["gmm"]["bytes"] == pytest.approx(1e9)
    assert t["splash_fwd"]["s"] == pytest.approx(1.0)
    # megablox's own CostEstimate in the HLO replaces the model's count, scaled the same way
    est = [xp.Op("k", "kernel", 4e12, 2e9, 2.0, kind="kernel")]
    t = suite.kernel_times(cost, est, routed_rows=1024, peak=1e12, hbm=1e9)
    assert t["gmm"]["flops"] == pytest.approx(8e12 / 8) and t["gmm"]["bytes"] == pytest.approx(4e9 / 8)
    # rows above the buffer (a capacity buffer smaller than the routed rows) never scale up
    assert suite.kernel_times(cost, [], routed_rows=10**6, peak=1e12, hbm=1e9)["gmm"]["flops"] == pytest.approx(8e12)


def test_dispatch_ops_by_their_aten_source():
    def op(source, kind="xla"):
        return xp.Op("o", "fusion", 0.0, 1.0, 1.0, kind=kind, source=source)

    assert suite.is_dispatch_op(op("jit(per_device)/shard_map/scan/while/body/closed_call/aten::index_put/scatter-add"))
    assert suite.is_dispatch_op(op("jit(per_device)/shard_map/aten::index.Tensor/gather"))
    assert suite.is_dispatch_op(op("scan/titan_program::ragged_all_to_all/ragged_all_to_all"))
    assert not suite.is_dispatch_op(op("scan/aten::mul.Tensor/mul"))
    assert not suite.is_dispatch_op(op("scan/aten::topk/jit(take_along_axis)/gather"))  # the router
    assert not suite.is_dispatch_op(op("scan/titan_capture::gmm/jit(gmm)/jit(_take)/gather"))  # the kernel's own


def test_weak_scaling_compute_is_affine_in_one_over_n():
    # t = 2 + 64 / n, compiled at 32 and 512: exact at every n
    at = {32: 2 + 64 / 32, 512: 2 + 64 / 512}
    for n in (16, 64, 2048):
        assert suite.scale_compute(at, n) == pytest.approx(2 + 64 / n)
    assert suite.scale_compute({512: 3.0, 32: 3.0}, 1024) == pytest.approx(3.0)


def test_override_tag_names_the_cache_folder():
    assert suite.override_tag([]) == ""
    assert suite.override_tag([("job.target", "v7x-16"), ("moe.routing", "random")]) == (
        "+job.target=v7x-16+moe.routing=random"
    )
    long = suite.override_tag([(f"model.key{i}", "1" * 20) for i in range(20)])
    assert long.startswith("+") and len(long) == 17
