"""Pipeline parallelism end to end: `trainer.train` with `[parallelism] pipeline_parallel_degree`.

The trajectory is the mesh's own (docs/pipeline_parallel.md): a PP run resumes a one-process
checkpoint and continues it as one process would (the same losses and gradient norms, the same
weights at the end), and a PP checkpoint resumes on one process, because parameter names stay the
model's own and DCP reshards between the layouts. Bounds as argued in
tests/unit/test_pipeline_parallel.py: losses 2e-6 relative (measured ~1e-7), gradient norms 5e-5 (they
read weights that differ), weights 5 % of lr x steps absolute (AdamW moves an element whose gradient
is near eps by another fraction of lr).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from tests.support.trainer_runs import launch_command, read_metrics, run

LR = 1e-3
RUN = (
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=32",
    "--model.n_layers=4",
    "--validation.enable=true",
    "--validation.freq=2",
    "--validation.steps=1",
    "--metrics.enable_tensorboard=false",
    "--metrics.log_freq=1",
    "--training.mixed_precision_param=float32",
    "--training.local_batch_size=4",
    f"--optimizer.lr={LR}",
    "--lr_scheduler.warmup_steps=0",
    "--training.steps=4",
    "--checkpoint.enable=true",
    "--checkpoint.interval=2",
    "--checkpoint.keep_latest_k=0",
)
"""The debug recipe cut to 4 layers at seq 32, a batch of 4, 4 fp32 steps, checkpoints and one validation
micro-batch at steps 2 and 4."""


def _train(folder, nproc: int, *args: str) -> dict[int, dict]:
    run(launch_command(nproc, [*RUN, f"--job.dump_folder={folder}", *args]))
    return read_metrics(folder)


def _model_weights(step_folder, tmp_path) -> dict[str, torch.Tensor]:
    """The `model` state of a DCP checkpoint, read whole in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = tmp_path / f"{step_folder.parent.parent.name}-{step_folder.name}.pt"
    dcp_to_torch_save(str(step_folder), str(out))
    return torch.load(out, weights_only=False)["model"]


def _assert_same_run(got: dict[int, dict], want: dict[int, dict], steps) -> dict[str, float]:
    """Losses (training, and validation through `schedule.eval`) within 2e-6 and gradient norms within
    5e-5 relative: a norm reads every weight, and by step 4 the weights differ by up to ~1 % of lr in
    the elements AdamW moves by another fraction."""
    keys = ("loss", "grad_norm", "val_loss")
    rel = {k: max(abs(got[s][k] - want[s][k]) / abs(want[s][k]) for s in steps if k in want[s]) for k in keys}
    print("pipeline e2e parity: " + ", ".join(f"{k} {v:.2e}" for k, v in rel.items()))
    assert rel["loss"] < 2e-6 and rel["val_loss"] < 2e-6, ({s: got[s] for s in steps}, {s: want[s] for s in steps})
    assert rel["grad_norm"] < 5e-5, ({s: got[s]["grad_norm"] for s in steps}, {s: want[s]["grad_norm"] for s in steps})
    return rel


def _assert_same_weights(a, b, steps: int) -> float:
    assert set(a) == set(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"pipeline e2e parity: weights {worst:.2e}")
    assert worst < 0.05 * LR * steps, worst
    return worst


def _resume_from(src, step: int, dst) -> None:
    shutil.copytree(src / "checkpoints" / f"step-{step}", dst / "checkpoints" / f"step-{step}")


@pytest.mark.multiprocess
def test_pp2_resumes_a_one_process_checkpoint_and_continues_its_run(tmp_path):
    """One process trains 4 steps; PP 2 (1F1B, 2 micro-batches, 2 gloo processes in a random order)
    resumes its step-2 checkpoint: steps 3 and 4 are the one process's, and so are the step-4 weights
    PP 2 saves (each pp rank writes its own layers, names unchanged)."""
    one, pp = tmp_path / "one", tmp_path / "pp2"
    want = _train(one, 1)
    _resume_from(one, 2, pp)
    got = _train(pp, 2, "--parallelism.pipeline_parallel_degree=2", "--parallelism.pipeline_schedule=1F1B")
    assert sorted(got) == [3, 4]
    _assert_same_run(got, want, (3, 4))
    _assert_same_weights(
        _model_weights(pp / "checkpoints" / "step-4", tmp_path),
        _model_weights(one / "checkpoints" / "step-4", tmp_path),
        2,
    )


@pytest.mark.multiprocess
def test_pp2_from_scratch_is_the_one_process_run_and_resumes_at_pp1(tmp_path):
    """PP 2 x dp_shard 2 (Interleaved1F1B, 2 stages per rank, 4 gloo processes) from scratch: the
    one process's run (the init is the whole model's, replayed); its step-2 checkpoint resumes on
    one process, and that run's steps 3 and 4 are the PP run's (scheduled tier)."""
    one, pp, back = tmp_path / "one", tmp_path / "pp2", tmp_path / "back"
    want = _train(one, 1)
    got = _train(
        pp,
        4,
        "--parallelism.pipeline_parallel_degree=2",
        "--parallelism.data_parallel_shard_degree=2",
        "--parallelism.pipeline_schedule=Interleaved1F1B",
        "--parallelism.pipeline_first_stage_less_layers=0",  # 4 layers, 4 stages: one each
        "--parallelism.pipeline_last_stage_less_layers=0",
        "--parallelism.pipeline_microbatches=2",
        "--training.local_batch_size=2",
        "--training.global_batch_size=4",
    )
    _assert_same_run(got, want, (1, 2, 3, 4))
    _resume_from(pp, 2, back)
    again = _train(back, 1)
    assert sorted(again) == [3, 4]
    _assert_same_run(again, got, (3, 4))
    _assert_same_weights(
        _model_weights(back / "checkpoints" / "step-4", tmp_path),
        _model_weights(pp / "checkpoints" / "step-4", tmp_path),
        4,
    )


@pytest.mark.multiprocess
def test_pp2_tp2_is_the_one_process_run(tmp_path):
    """PP 2 x TP 2 (sequence parallel: a stage's input is a sequence shard, every stage gets the
    window's RoPE positions; 1F1B, 4 gloo processes): the one process's run, validation included,
    and the same weights at step 4 (scheduled tier)."""
    _four_ranks_are_the_one_process_run(tmp_path, "pp2tp2", (), ())


LOSS_PARALLEL_SCHEDULES = {
    "1F1B": (),
    "ZBVZeroBubble": (
        "--parallelism.pipeline_schedule=ZBVZeroBubble",
        "--parallelism.pipeline_first_stage_less_layers=0",  # 4 layers, 4 stages: one each
        "--parallelism.pipeline_last_stage_less_layers=0",
    ),
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("schedule", list(LOSS_PARALLEL_SCHEDULES))
def test_pp2_tp2_loss_parallel_is_the_one_process_run(tmp_path, schedule):
    """PP 2 x TP 2 with TP's loss parallel (`enable_loss_parallel`: the last stage's logits stay
    vocab-sharded DTensors, the schedule's loss function and backward run inside
    `loss_parallel_context`, validation's `schedule.eval` inside the step plan's loss context; 4 gloo
    processes): the one process's run, validation included, and the same weights at step 4.
    `1F1B`; `ZBVZeroBubble`: the split backward from a DTensor loss, and the V schedule's forward-only
    validation (the two adjacent stages of the last rank hand over no gradient then:
    parallelisms/pipeline_parallel.py `ChunkStage`) (scheduled tier)."""
    pp_args = ("--parallelism.enable_loss_parallel=true", *LOSS_PARALLEL_SCHEDULES[schedule])
    _four_ranks_are_the_one_process_run(tmp_path, f"pp2tp2_lp_{schedule}", (), pp_args)


def _four_ranks_are_the_one_process_run(tmp_path, name: str, one_args, pp_args) -> None:
    """PP 2 x TP 2 with 2 micro-batches (and `pp_args`) against one process (`one_args`)."""
    pp_args = (*pp_args, "--parallelism.tensor_parallel_degree=2", "--parallelism.pipeline_microbatches=2")
    pp_run_is_the_one_process_run(tmp_path, name, 4, one_args, pp_args)


def pp_run_is_the_one_process_run(tmp_path, name: str, ranks: int, one_args, pp_args) -> None:
    """A PP 2 run on `ranks` processes (`pp_args`) against one process (`one_args`): the same
    losses, grad norms and validation at steps 1-4, and the same weights at step 4."""
    one, pp = tmp_path / "one", tmp_path / name
    want = _train(one, 1, *one_args)
    got = _train(pp, ranks, *pp_args, "--parallelism.pipeline_parallel_degree=2")
    _assert_same_run(got, want, (1, 2, 3, 4))
    _assert_same_weights(
        _model_weights(pp / "checkpoints" / "step-4", tmp_path),
        _model_weights(one / "checkpoints" / "step-4", tmp_path),
        4,
    )


GRAPH_PP = (
    "--compile.mode=graph",
    "--compile.backend=aot_eager",
    "--parallelism.pipeline_schedule=GPipe",
    "--parallelism.pipeline_first_stage_less_layers=0",
    "--parallelism.pipeline_last_stage_less_layers=0",
)
"""Graph-mode PP (trainer/graph/pipeline.py): GPipe's order, uniform stages."""


@pytest.mark.multiprocess
def test_graph_pp2_cp2_is_the_one_process_run(tmp_path):
    """Graph-mode PP 2 x CP 2 (4 gloo processes in a drawn device order; every stage's blocks run the
    CP attention on the cp shard at its global RoPE positions, the permutes carry each cp rank's
    shard between the ranks with its cp coordinate, the last stage's loss is the cp-scaled token sum):
    the one process's graph-mode run, validation included, and the same weights at step 4. With the
    shard's local positions instead the losses move by 3.6e-4 (checked by hand) (scheduled tier)."""
    graph = ("--compile.mode=graph", "--compile.backend=aot_eager")
    pp_args = (*GRAPH_PP, "--parallelism.context_parallel_degree=2", "--parallelism.pipeline_microbatches=2")
    pp_run_is_the_one_process_run(tmp_path, "graph_pp2cp2", 4, graph, pp_args)


@pytest.mark.multiprocess
def test_graph_pp2_cp2_iteration_scan_is_the_one_process_run(tmp_path):
    """Graph-mode PP 2 x CP 2 with `compile.scan_pipeline_iterations = true` (4 gloo processes in a
    drawn device order): the pipeline's 5 iterations (4 chunks) one scan, whose body gathers
    SimpleFSDP's shards over the cp axis by group name and runs the CP attention; the one process's
    graph-mode run, validation included (the pipeline's forward, unrolled), and the same weights at
    step 4 (scheduled tier)."""
    graph = ("--compile.mode=graph", "--compile.backend=aot_eager")
    pp_args = (
        *GRAPH_PP,
        "--parallelism.context_parallel_degree=2",
        "--parallelism.pipeline_microbatches=4",
        "--compile.scan_pipeline_iterations=true",
    )
    pp_run_is_the_one_process_run(tmp_path, "graph_pp2cp2_scan", 4, graph, pp_args)


@pytest.mark.multiprocess
def test_graph_pp2_tp2_is_the_one_process_run(tmp_path):
    """Graph-mode PP 2 x TP 2 (4 gloo processes in a drawn device order; each stage's blocks sharded by
    the TP plan, sequence parallel between them, the permutes carrying each tp rank's sequence shard):
    the one process's graph-mode run, validation included, and the same weights at step 4 (scheduled
    tier)."""
    graph = ("--compile.mode=graph", "--compile.backend=aot_eager")
    _four_ranks_are_the_one_process_run(tmp_path, "graph_pp2tp2", graph, GRAPH_PP)
