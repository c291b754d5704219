"""Graph-mode pipeline parallelism's whole train step as one SPMD program on XLA:CPU (probe
tests/xla/probes/pipeline_step_xla.py, ttpu venv: torch 2.13 + torchax + jax): rank 0's captured
pipelined step (Llama 3 debug model, 4 layers, pp 2, 2 chunks, uniform stages, fp32) lowered by
torchax with tools/tpu_compile.py's collective rules in a shard_map over 2 XLA:CPU devices, run
with device r fed rank r's inputs (its blocks, its stage index).

What it shows: the permutes are `collective_permute`s inside the one program (2 forward, 2
backward; no all-to-all); both devices report the loss and gradient norm of one process's eager
step on the same batch; the embedding's and head's weights and moments come out of the update
equal on both devices. Tolerance: fp32 sums in another order (XLA's fusions and the pipeline's
chunked loss against one eager pass): 2e-6 relative, as the gloo parity (tests/unit/
test_graph_pipeline.py). Measured (2026-12-06): loss 1.1e-7, gradient norm 8.1e-7 relative,
shared tensors bitwise equal. A wrong stage mask (the loss or the embedding taken on the wrong
stage) changes the loss by O(1)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xla


def test_pipelined_step_is_one_program_with_collective_permutes(probe):
    out = probe("ttpu", "pipeline_step_xla.py")
    assert out["collective_permute"] == 4 and out["all_to_all"] == 0, out
    assert out["stage_inputs"] == [0, 1], out
    for loss, norm in zip(out["loss"], out["grad_norm"]):
        assert abs(loss - out["ref_loss"]) / out["ref_loss"] < 2e-6, out
        assert abs(norm - out["ref_grad_norm"]) / out["ref_grad_norm"] < 2e-6, out
    assert out["shared_tensors"] == 6 and out["shared_diff_between_devices"] == 0.0, out
    assert out["shared_min_change"] > 0, out


def test_pipelined_moe_step_returns_each_stage_s_aux_and_loads(probe):
    """The same with Qwen 3 MoE's debug flavor (4 layers, 8 experts top-2, seq 32, aux_loss_coef 0.1;
    probe argument `moe`): one program on 2 XLA:CPU devices, 4 collective permutes and no
    all-to-all; the loss (2e-6), gradient norm (1e-5, the gloo MoE parity's bound: the aux term's
    gradient adds sums in another order) and aux loss (2e-6) of one process's eager step whose
    micro-batches are the chunks, on both devices; the loads each device returns for its stage's 2
    layers, summed over its live iterations, equal the one process's (integers: exact). Measured
    (2026-12-07): loss 1.6e-7, gradient norm 1.4e-6, aux 0, loads equal; counting the bubble
    iteration's loads would add a chunk's routing to each stage (tests/unit/test_graph_pipeline_moe.py)."""
    out = probe("ttpu", "pipeline_step_xla.py", "moe")
    assert out["collective_permute"] == 4 and out["all_to_all"] == 0, out
    assert out["stage_inputs"] == [0, 1], out
    for loss, norm, aux in zip(out["loss"], out["grad_norm"], out["aux"]):
        assert abs(loss - out["ref_loss"]) / out["ref_loss"] < 2e-6, out
        assert abs(norm - out["ref_grad_norm"]) / out["ref_grad_norm"] < 1e-5, out
        assert abs(aux - out["ref_aux"]) / out["ref_aux"] < 2e-6, out
    assert out["loads"] == out["ref_loads"] and sum(out["loads"]) == 4 * 4 * 32 * 2, out  # tokens x top-2 x layers
    assert out["shared_tensors"] == 6 and out["shared_diff_between_devices"] == 0.0, out


def test_pipelined_step_with_iteration_scan_has_one_permute_each_way(probe):
    """The same dense step with the pipeline's iterations as one scan (probe argument `scan`:
    `PipelinedLoss(scan=True)`, `[compile] scan_pipeline_iterations`; the stage's parameters enter
    the scan body as local tensors): one program whose scan bodies hold the two
    `collective_permute`s (one forward, one backward; the unrolled program's 4 for 2 chunks), no
    all-to-all, and the loss and gradient norm of one process's eager step within the unrolled
    test's bound on both devices. Measured (2026-12-07): loss 1.1e-7, gradient norm 8.1e-7 relative,
    the same values as unrolled; shared tensors bitwise equal (scheduled tier)."""
    out = probe("ttpu", "pipeline_step_xla.py", "scan")
    assert out["collective_permute"] == 2 and out["all_to_all"] == 0, out
    assert out["stage_inputs"] == [0, 1], out
    for loss, norm in zip(out["loss"], out["grad_norm"]):
        assert abs(loss - out["ref_loss"]) / out["ref_loss"] < 2e-6, out
        assert abs(norm - out["ref_grad_norm"]) / out["ref_grad_norm"] < 2e-6, out
    assert out["shared_tensors"] == 6 and out["shared_diff_between_devices"] == 0.0, out
