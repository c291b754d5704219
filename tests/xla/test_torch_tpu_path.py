"""torch-tpu's own compile path for the graph step, run on the CPU up to its lowering call.

Probe torch_tpu_path.py (ttpu venv: torch-tpu 0.2.0, libtpu 0.0.52): rank 0 of a fake 2-rank process
group builds Llama 3 debugmodel (2 layers) with SimpleFSDP over dp_shard = 2 and
`build_graph_step(backend="tpu")`, and the real path runs (Dynamo under `spmd_safe`, our AOT capture
and passes, torch-tpu's TpuBackend and SplitCompiler) until `fx_to_mlir`, which a stand-in records
and stops: the real one builds the MLIR and the PJRT executable in one call and needs a TPU
(reference/xla_cpu_path.md §D). So this proves the graph reaches torch-tpu's lowering as one
program; not that torch-tpu lowers it.

Checked: the run ends in the stand-in (not an earlier error); every functional collective the
SplitCompiler sees carries `spmd_safe`, so it hands the lowering the whole graph as one partition;
with scan, both scan ops reach the lowering. Control: without `spmd_safe` the same step is split at
its collectives, so the one-partition check can fail.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla


def _variant(torch_tpu_path: dict, name: str) -> dict:
    res = torch_tpu_path["variants"][name]
    assert "error" not in res, f"{name}: {res['error']}\n{res.get('traceback', '')}"
    assert res["reached_fx_to_mlir"] and res["exception_chain"].endswith("ReachedLowering"), res
    return res


@pytest.mark.parametrize("name", ["unrolled", "scan"])
def test_step_reaches_torch_tpu_lowering_as_one_program(torch_tpu_path, name):
    res = _variant(torch_tpu_path, name)
    assert res["split_collectives"] > 0, res
    assert res["split_collectives_spmd_safe"] == res["split_collectives"], res
    # One partition: the graph given to fx_to_mlir is the whole graph SplitCompiler received.
    assert res["mlir_nodes"] == res["split_input_nodes"], res
    assert res["mlir_collectives"] == res["split_collectives"], res
    assert res["mlir_scans"] == (2 if name == "scan" else 0), res
    # With scan, SimpleFSDP's per-layer all-gathers / reduce-scatters are inside the scan bodies;
    # they carry the annotation too (whether torch-tpu lowers them there needs a TPU).
    assert res["split_body_collectives_spmd_safe"] == res["split_body_collectives"], res
    assert (res["split_body_collectives"] > 0) == (name == "scan"), res


def test_without_spmd_safe_the_step_is_split(torch_tpu_path):
    res = _variant(torch_tpu_path, "unrolled_unannotated")
    assert res["split_collectives"] > 0 and res["split_collectives_spmd_safe"] == 0, res
    assert res["mlir_nodes"] < res["split_input_nodes"], res
