"""Eager PP with an MoE model through `trainer.train` (trainer/job.py hands `PipelineStep` the aux-loss
coefficient, the expert balance and the stage mesh; docs/pipeline_parallel.md "MoE and expert
parallelism with PP").

The Qwen 3 MoE debug recipe at 4 layers, seq 32, fp32, 3 steps, global batch 8, with the selection
bias (rate 0.01) and aux_loss_coef 0.1: PP 2 (1F1B, 2 chunks of 4 sequences, 2 processes) is the one
process that accumulates 2 micro-batches of 4 (the chunk is the load-balancing loss's unit). Losses
and the aux loss within 2e-6 relative, gradient norms 1e-5, MaxVio equal (integer loads, equal biases:
a wrong load or bias step changes it by far more); validation (`schedule.eval` over the 8 sequences
against the one process's 2 micro-batches of 4) within 2e-6. Bounds: tests/unit/test_pipeline_moe.py.
"""

from __future__ import annotations

import pytest

from tests.support.trainer_runs import launch_command, read_metrics, run

RUN = (
    "--config",
    "configs/qwen3_moe_debug.toml",
    "--training.seq_len=32",
    "--model.n_layers=4",
    "--model.moe_expert_bias=true",
    "--training.aux_loss_coef=0.1",
    "--training.expert_bias_rate=0.01",
    "--training.steps=3",
    "--checkpoint.enable=false",
    "--training.mixed_precision_param=float32",
    "--training.global_batch_size=8",
    "--lr_scheduler.warmup_steps=0",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--validation.enable=true",
    "--validation.freq=3",
)


def _train(folder, nproc: int, *args: str) -> dict[int, dict]:
    run(launch_command(nproc, [*RUN, f"--job.dump_folder={folder}", *args]))
    return read_metrics(folder)


@pytest.mark.multiprocess
def test_pp2_moe_trains_as_the_one_process_with_accumulation(tmp_path):
    """PP 2 x 1F1B over 2 chunks of 4 == one process accumulating 2 x 4: losses, aux losses, gradient
    norms, MaxVio at steps 1-3 and validation at step 3 (scheduled tier)."""
    want = _train(tmp_path / "one", 1, "--training.local_batch_size=4", "--validation.steps=2")
    got = _train(
        tmp_path / "pp2",
        2,
        "--training.local_batch_size=8",
        "--validation.steps=1",
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.pipeline_microbatches=2",
    )
    rel = {
        k: max(abs(got[s][k] - want[s][k]) / abs(want[s][k]) for s in (1, 2, 3) if k in want[s])
        for k in ("loss", "moe_aux_loss", "grad_norm", "val_loss")
    }
    print("pipeline MoE e2e parity: " + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()))
    assert rel["loss"] < 2e-6 and rel["moe_aux_loss"] < 2e-6 and rel["val_loss"] < 2e-6, rel
    assert rel["grad_norm"] < 1e-5, rel
    assert all(got[s]["moe_max_vio"] == want[s]["moe_max_vio"] for s in (1, 2, 3)), (got, want)
