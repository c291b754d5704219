"""Pipeline parallelism composed with context parallelism (trainer/step/pipeline.py, eager mode).

The cp axis lives inside each stage: every cp rank of a stage holds its load-balanced shard of
each window (chunks r and 2 cp - 1 - r, parallelisms/context_parallel.py), the stages exchange
hidden states [b, s / cp, d], every stage's attention is the CP all-gather attention (the op
`causal_attention`, `cp_attention_fn`) at the shard's global RoPE positions, the last stage's
chunk loss is the non-PP CP loss (token sum x cp / the cp group's count) and SimpleFSDP reduces
the gradients over dp_shard x cp.

PP 2 x CP 2 (4 gloo processes), 1F1B and Interleaved1F1B (two stages per rank in loop order), 4
chunks of 2 sequences (the 16-token windows of tests/support/parallel_harness.py, 8 tokens per
cp rank), against one process on the same 8-sequence batches (tests/unit/test_pipeline_parallel.py's
reference and batches): losses, gradient norms before clipping and every weight after 3 AdamW steps;
the same with TP 2 inside each stage (8 processes, 1F1B), and PP 2 x CP 2 through `trainer.train`
against the one-process run. (Qwen 3 MoE on PP 2 x CP 2, with and without EP:
tests/unit/test_pipeline_moe.py.)

Tolerance: tests/unit/test_pipeline_parallel.py's argument and bounds (`_compare`: losses 2e-6
relative, gradient norms 1e-5, weights 5 % of lr x steps absolute). CP adds sums in another order
only: the attention's keys and values are gathered whole (the product is the same dense masked
SDPA, per docs/context_parallel.md bit-identical out and dq), the k/v gradients come back through a
reduce-scatter (a two-term sum per element), the loss is a token sum divided by the all-reduced
count, and the weight gradients are averaged over the cp ranks by SimpleFSDP (a two-term fp32
sum): a few ulp per step, as for PP alone. A wrong composition (local positions for RoPE, a shard
not attending to the other rank's keys, a loss normalised by the local count or not reduced over
cp) changes the losses at the 1e-2 level.
"""

from __future__ import annotations

import pytest

from tests.unit.test_pipeline_parallel import BATCH, LR, N_LAYERS, _batches, _compare, _one_process_reference, _request
from trainer.step import plan_step

PP = CP = 2
MICROBATCHES = 4
SCHEDULES = ("1F1B", "Interleaved1F1B")


def test_eager_pp_with_cp_is_planned():
    """The rule table lets eager PP x CP through, with TP and with experts and EP too, and the plan
    keeps the pipeline (graph mode: `test_graph_pp_with_cp_is_planned`)."""
    plan = plan_step(_request(cp_degree=CP, pp_schedule="Interleaved1F1B"))
    assert plan.pipeline is not None and (plan.pipeline.pp, plan.pipeline.num_virtual) == (PP, 2)
    assert plan_step(_request(cp_degree=CP, tp_degree=2)).pipeline is not None
    assert plan_step(_request(cp_degree=CP, ep_degree=2, model_has_experts=True)).pipeline is not None


def test_graph_pp_with_cp_is_planned():
    """Graph-mode PP x CP (the cp axis inside the pipeline program's stages: trainer/graph/pipeline.py
    `PipelinedLoss(cp=...)`; parity: tests/e2e/test_pipeline_train.py
    `test_graph_pp2_cp2_is_the_one_process_run`) passes the rule table, GPipe with uniform stages,
    and the plan keeps the pipeline and the graph mode."""
    graph = dict(mode="graph", pp_schedule="GPipe", pp_first_less=0, pp_last_less=0, cp_degree=CP)
    plan = plan_step(_request(**graph))
    assert plan.pipeline is not None and plan.pipeline.uniform and plan.mode == "graph"
    assert plan_step(_request(**graph, tp_degree=2)).pipeline is not None


def _shard(microbatch, cp):
    """A micro-batch (inputs, labels) -> this cp rank's (inputs, labels, positions), as the LM task
    prepares it (trainer/tasks/lm.py `LMTask.prepare`)."""
    from parallelisms.context_parallel import positions, shard_sequence

    inputs, labels = microbatch
    pos = positions(inputs.shape[1], cp.rank, cp.size).to(inputs.device).expand(inputs.shape[0], -1)
    return (shard_sequence(inputs, 1, cp.rank, cp.size), shard_sequence(labels, 1, cp.rank, cp.size), pos)


def _worker(batches, schedules=SCHEDULES, tp: int = 1, mode: str = "eager"):
    """On each rank (pp x cp x tp of them): per schedule, the losses averaged over the world (the
    trainer's global mean), this rank's gradient norms and its weights (full). `mode`: the step
    mode ("compile": the blocks compiled per block; then also the number of graphs Dynamo compiled
    on this rank over the run, `(schedule, "graphs")`)."""
    import torch
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from models.common import ops
    from parallelisms import ParallelDims, build_mesh
    from parallelisms.context_parallel import cp_attention_fn, cp_group
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import eager_pipeline_step, full_state, pp_model, rank_run

    out = {}
    for schedule in schedules:
        dims = ParallelDims(pp=PP, cp=CP, tp=tp, world_size=dist.get_world_size())
        mesh = build_mesh(dims, "cpu")
        cp = cp_group(mesh["cp"])
        previous = ops.register("causal_attention", cp_attention_fn(cp))
        try:
            plan = plan_step(
                _request(
                    mode=mode,
                    cp_degree=CP,
                    tp_degree=tp,
                    pp_schedule=schedule,
                    pp_microbatches=MICROBATCHES,
                    local_batch=BATCH,
                )
            )
            torch._dynamo.reset()
            counters.clear()
            model, opt = pp_model(llama3_args(N_LAYERS), plan, seed=0, lr=LR, dims=dims, mesh=mesh)
            step = eager_pipeline_step(model, opt, plan, n_layers=N_LAYERS, pp_mesh=pp_mesh(mesh), cp=cp)
            losses = rank_run(
                lambda micro: step([_shard(m, cp) for m in micro]), batches, dp_rank=0, dp_shard=1, accum=1
            )
            out[schedule] = (losses, full_state(model))
            if mode == "compile":
                out[schedule, "graphs"] = counters["stats"]["unique_graphs"]
        finally:
            ops.register("causal_attention", previous)
    return out


@pytest.mark.multiprocess
def test_pp2_cp2_equals_one_process():
    """PP 2 x CP 2, 1F1B and Interleaved1F1B, 4 chunks of 2 sequences (each cp rank 8 of the 16
    tokens) == one process: losses, gradient norms and every weight after 3 steps (scheduled tier)."""
    from tests.support.parallel_harness import llama3_args, run_processes

    batches = _batches(llama3_args(N_LAYERS).vocab_size)
    reference = _one_process_reference(0, batches)
    results = run_processes(PP * CP, _worker, batches)
    _compare(results, reference, SCHEDULES)


@pytest.mark.multiprocess
def test_pp2_cp2_tp2_equals_one_process():
    """PP 2 x CP 2 x TP 2 (8 processes: each stage's blocks sharded by the TP plan, sequence parallel
    over the cp shard between them, every stage taking the shard's global positions), 1F1B, 4 chunks
    == one process (scheduled tier)."""
    from tests.support.parallel_harness import llama3_args, run_processes

    batches = _batches(llama3_args(N_LAYERS).vocab_size)
    reference = _one_process_reference(0, batches)
    results = run_processes(PP * CP * 2, _worker, batches, ("1F1B",), 2)
    _compare(results, reference, ("1F1B",))


@pytest.mark.multiprocess
def test_trainer_pp2_cp2_is_the_one_process_run(tmp_path):
    """`trainer.train` with pipeline_parallel_degree 2 x context_parallel_degree 2 (1F1B, 2 micro-batches
    of 2 sequences, seq 32: 16 tokens per cp rank; 4 gloo processes in a drawn device order): the
    one process's run (the same global batch of 4 windows): losses, gradient norms and validation at
    steps 1-4 and the step-4 weights, within tests/e2e/test_pipeline_train.py's bounds (scheduled
    tier)."""
    from tests.e2e.test_pipeline_train import pp_run_is_the_one_process_run

    pp_args = (
        "--parallelism.context_parallel_degree=2",
        "--parallelism.pipeline_schedule=1F1B",
        "--parallelism.pipeline_microbatches=2",
    )
    pp_run_is_the_one_process_run(tmp_path, "pp2cp2", 4, (), pp_args)
