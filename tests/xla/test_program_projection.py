"""The MFU suite's projection from the trainer's own program (scripts/mfu_suite.py
`program_compile` + `program_bound`, tools/xla_projection.py): a reduced-width Qwen 3 MoE with
EP 2 on a v6e-8 slice, dropless (the ragged all-to-all dispatch), compiled deviceless with XLA's
HLO dump, and its bound read back. What would fail here: a dump that is not the step's module,
the EP all-to-alls missing from the bound or not on the expert axis, the dispatch's permutation
ops not found by their ATen names, a scan whose trip count is unknown (the bound would count
one layer), or the kernels' capture-model cost missing from the worker's report.
"""

from __future__ import annotations

import pytest

from tests.xla.conftest import xla_python

pytestmark = pytest.mark.xla

MOE_EP2 = [
    ("model.n_layers", "2"),
    ("model.dim", "512"),
    ("model.n_heads", "4"),
    ("model.n_kv_heads", "2"),
    ("model.vocab_size", "8192"),
    ("model.head_dim", "128"),
    ("model.num_experts", "16"),
    ("model.moe_hidden_dim", "256"),
    ("parallelism.expert_parallel_degree", "2"),
    ("training.seq_len", "1024"),
    ("training.local_batch_size", "2"),
    ("moe.capacity_factor", "0"),
    ("job.target", "v6e-8"),
]


def test_the_bound_holds_the_ep_all_to_alls_and_the_dispatch(tmp_path, monkeypatch):
    xla_python("ttpu")  # made (or found) by the tier's fixture rules; program_compile finds it too
    from tools import mfu_projection as suite
    from tools.mfu_report import load_anchors

    recipe = suite.recipe_path("qwen3_30b_a3b_v6e")
    res = suite.program_compile(recipe, MOE_EP2, 1200, cache=tmp_path)
    assert res.get("error") is None and res.get("oom") is None, res.get("error") or res.get("oom")
    assert res["radices"] == [4, 2] and len(res["device_coords"]) == 8
    assert res["kernel_cost"]["gmm"]["calls"] >= 2 * 3 and res["kernel_cost"]["splash_fwd"]["calls"] >= 2
    facts = suite.program_facts(recipe, MOE_EP2)
    b = suite.program_bound(res, facts, anchors=load_anchors())
    assert b["loops_without_trip_count"] == 0
    a2a = [c for c in b["_collectives"] if c.kind == "all-to-all"]
    assert a2a and {c.axes for c in a2a} == {("a1",)}, {c.axes for c in a2a}
    # dispatch + combine each way, forward, recompute and backward: at least 4 ragged exchanges of
    # the routed rows (2 x 1024 tokens x top-8 x 512 wide, bf16) per layer
    routed = facts["routed_rows"] * 512 * 2
    assert max(c.bytes for c in a2a) == pytest.approx(routed, rel=0.01)
    assert b["a2a_bytes"] >= 4 * 2 * routed and b["a2a_s"] > 0 and "a1" in b["comm_by_axis"]
    assert b["dispatch_ops_bytes"] > 0 and b["dispatch_ops_s"] > 0
    assert 0 < b["mfu_causal_exposed"] <= b["mfu_causal_overlapped"] <= 100
