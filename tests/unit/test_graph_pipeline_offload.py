"""Host offload of the saved block inputs inside graph-mode PP (`[activation_checkpoint] offload =
"block_inputs"` with `PipelinedLoss`: trainer/graph/passes.py `offload_block_inputs_pass` on the
captured pipeline).

With layer scan each pipeline iteration runs the stage's blocks as one forward scan (and its
backward as one backward scan), so a PP 2 step of m chunks holds T = m + p - 1 forward scans that
each stack their blocks' inputs for their own backward scan: the pass must find every one of them
(T offloads and T reloads per accumulation micro-batch), and on the CPU, where both ops are copies,
the step's numbers must not change at all (bitwise, as tests/unit/test_scan_offload.py asks of the
plain step), and stay within the one-process bounds of tests/unit/test_graph_pipeline.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.unit.test_pipeline_parallel import BATCH, LR, N_LAYERS, _batches, _one_process_reference
from tests.unit.test_scan_offload import _ao_nodes
from trainer.step import StepRequest, plan_step

MICROBATCHES = 2
STEPS = 2


def _offload_worker(batches):
    """On each rank, with and without the offload: the losses and gradient norms, the final weights
    (full), the graph's offload / reload nodes and `GraphStats.scan_offloaded_bytes`."""
    import torch.distributed as dist

    from parallelisms import ParallelDims, build_mesh
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import full_state, llama3_family, pp_model, rank_run
    from trainer.graph import build_graph_step
    from trainer.graph.pipeline import PipelinedLoss

    out = {}
    for offload in ("none", "block_inputs"):
        dims = ParallelDims(pp=2, world_size=dist.get_world_size())
        mesh = build_mesh(dims, "cpu")
        request = StepRequest(
            mode="graph",
            backend="aot_eager",
            pp_degree=2,
            pp_schedule="GPipe",
            pp_microbatches=MICROBATCHES,
            pp_first_less=0,
            pp_last_less=0,
            model_has_experts=False,
            n_layers=N_LAYERS,
            local_batch=BATCH,
        )
        plan = plan_step(request)
        args = llama3_args(N_LAYERS)
        model, opt = pp_model(args, plan, seed=0, lr=LR, dims=dims, mesh=mesh)
        pp = pp_mesh(mesh)
        loss_fn = PipelinedLoss(
            pp_rank=pp.get_local_rank(),
            pp=2,
            group_name=pp.get_group().group_name,
            microbatches=plan.pipeline.microbatches,
            dim=args.dim,
            dtype=torch.float32,
            device=torch.device("cpu"),
        )
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend="aot_eager",
            loss_fn=loss_fn,
            pp_mesh=pp,
            scan_layers=True,
            ac_mode="full",
            plan=llama3_family().plan,
            loss_context=plan.loss_context,
        )
        step.capture.offload = offload
        losses = rank_run(lambda micro: step(micro, LR), batches, dp_rank=0, dp_shard=1, accum=1)
        out[offload] = (
            losses,
            full_state(model),
            _ao_nodes(step.capture.graph_module),
            step.stats.scan_offloaded_bytes,
            dict(step.stats.collectives),
        )
    return out


@pytest.mark.multiprocess
def test_graph_pp2_offload_matches_the_step_without():
    """PP 2 in graph mode (GPipe, 2 chunks of 4 sequences: T = 3 pipeline iterations), layer scan
    (each stage's 3 blocks one scan), full AC, aot_eager, fp32, 2 AdamW steps on 2 gloo processes:
    with the offload each rank's graph holds 3 offloads (one per iteration's forward scan) and 3
    reloads (its backward scan), 3 x 3 blocks x [4, 32, 64] fp32 on the host; the losses, gradient
    norms and weights equal the step's without it bitwise, and one process's within
    test_graph_pipeline's bounds."""
    from tests.support.parallel_harness import llama3_args, run_processes

    batches = _batches(llama3_args(N_LAYERS).vocab_size)[:STEPS]
    ref_losses, ref_state = _one_process_reference(0, batches)
    results = run_processes(2, _offload_worker, batches)
    for rank_out in results:
        (ref, ref_weights, ref_ao, ref_host, ref_colls), (got, weights, ao, host, colls) = (
            rank_out["none"],
            rank_out["block_inputs"],
        )
        assert ref_ao == {"offload": 0, "reload": 0} and ref_host == 0
        iterations = MICROBATCHES + 2 - 1
        assert ao == {"offload": iterations, "reload": iterations}, ao
        chunk = BATCH // MICROBATCHES
        seq, dim = batches[0][0].shape[1], llama3_args(N_LAYERS).dim
        assert host == iterations * (N_LAYERS // 2) * chunk * seq * dim * 4, host
        assert colls == ref_colls  # the same permutes (2 (T - 1)), nothing else moved
        assert got == ref, (got, ref)
        assert weights.keys() == ref_weights.keys() and all(torch.equal(weights[k], ref_weights[k]) for k in weights)
        # test_graph_pipeline's bounds against one process (its module docstring)
        for (loss, norm), (ref_loss, ref_norm) in zip(got, ref_losses):
            assert abs(loss - ref_loss) / ref_loss < 2e-6 and abs(norm - ref_norm) / ref_norm < 1e-5
        assert max((weights[k] - ref_state[k]).abs().max().item() for k in weights) < 0.05 * LR * STEPS
