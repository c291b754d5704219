"""PP 4: the schedules at four pipeline ranks (4 spawned gloo processes) equal one process on the same
global batches (fp32, AdamW with clipping, 3 steps), as tests/unit/test_pipeline_parallel.py checks
them at PP 2.

What PP 4 exercises that PP 2 does not: stages that neither start nor end the model (no embedding, no
head: the middle ranks only receive and send), 1F1B's warm-up of p - r forwards that differs per
rank, Interleaved1F1B's loop placement over 8 stages (rank r holds stages r and r + 4), ZBV's V over 8
stages (rank r holds r and 7 - r), and the gradient norm summed over four ranks' squares. The model
has 10 layers so that 8 stages each hold a block with the first and the last lighter (the trainer's
default split).

Tolerance as tests/unit/test_pipeline_parallel.py argues it (fp32 sums over chunks in another order: a
few ulp per step): losses 2e-6 relative, gradient norms 1e-5, weights 5 % of lr x steps absolute.
"""

import pytest

from parallelisms.pipeline_parallel import split_layers
from tests.unit.test_pipeline_parallel import BATCH, LR, STEPS, _batches, _one_process_reference
from trainer.step import StepRequest, plan_step

PP = 4
N_LAYERS = 8
MICROBATCHES = 4
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "ZBVZeroBubble")


def _worker(batches):
    """On each of the 4 ranks: per schedule, the losses, the gradient norms and this rank's weights."""
    import torch.distributed as dist

    from parallelisms import ParallelDims, build_mesh
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import eager_pipeline_step, full_state, pp_model, rank_run

    out = {}
    for schedule in SCHEDULES:
        dims = ParallelDims(pp=PP, world_size=dist.get_world_size())
        mesh = build_mesh(dims, "cpu")
        plan = plan_step(
            StepRequest(
                pp_degree=PP,
                pp_schedule=schedule,
                pp_microbatches=MICROBATCHES,
                model_has_experts=False,
                n_layers=N_LAYERS,
                local_batch=BATCH,
                pp_first_less=0,
                pp_last_less=0,
            )
        )
        model, opt = pp_model(llama3_args(N_LAYERS), plan, seed=0, lr=LR, dims=dims, mesh=mesh)
        step = eager_pipeline_step(model, opt, plan, n_layers=N_LAYERS, pp_mesh=pp_mesh(mesh))
        losses = rank_run(step, batches, dp_rank=0, dp_shard=1, accum=1)
        layers = sorted({int(k.split(".")[1]) for k in model.state_dict() if k.startswith("layers.")})
        out[schedule] = (losses, full_state(model), layers)
    return out


def test_the_pp4_stages_are_the_trainers_split():
    """8 layers in 4 stages (one per rank) and in 8 (two per rank), no stage lighter; with the default
    lighter first and last stage, 8 stages would leave one without a block."""
    assert [len(r) for r in split_layers(N_LAYERS, 4, first_stage_less=0, last_stage_less=0)] == [2, 2, 2, 2]
    assert [len(r) for r in split_layers(N_LAYERS, 8, first_stage_less=0, last_stage_less=0)] == [1] * 8
    with pytest.raises(ValueError, match="without a block"):
        split_layers(N_LAYERS, 8)


@pytest.mark.multiprocess
def test_pp4_schedules_equal_one_process():
    """GPipe, 1F1B, Interleaved1F1B and ZBVZeroBubble on PP 4, 4 chunks of 2 sequences == one process:
    each rank's losses and gradient norms, and every weight of the model, which the 4 ranks' parts
    cover exactly once (the blocks each rank holds are disjoint and together all 8)."""
    from tests.support.parallel_harness import llama3_args, run_processes

    batches = _batches(llama3_args(N_LAYERS).vocab_size)
    ref_losses, ref_state = _one_process_reference(0, batches, n_layers=N_LAYERS)
    results = run_processes(PP, _worker, batches)
    worst_loss = worst_norm = worst_weight = 0.0
    for schedule in SCHEDULES:
        seen: dict[str, int] = {}
        blocks = [set(rank_out[schedule][2]) for rank_out in results]
        assert sum(len(b) for b in blocks) == N_LAYERS and set().union(*blocks) == set(range(N_LAYERS)), schedule
        for rank_out in results:
            losses, state, _ = rank_out[schedule]
            for (loss, norm), (ref_loss, ref_norm) in zip(losses, ref_losses, strict=True):
                worst_loss = max(worst_loss, abs(loss - ref_loss) / ref_loss)
                worst_norm = max(worst_norm, abs(norm - ref_norm) / ref_norm)
            for k, v in state.items():
                worst_weight = max(worst_weight, (v - ref_state[k]).abs().max().item())
                seen[k] = seen.get(k, 0) + 1
        assert set(seen) == set(ref_state), schedule
        assert all(n == 1 for k, n in seen.items() if k.startswith("layers.")), schedule
    print(f"PP 4 parity: losses {worst_loss:.2e}, grad norms {worst_norm:.2e}, weights {worst_weight:.2e}")
    assert worst_loss < 2e-6, worst_loss
    assert worst_norm < 1e-5, worst_norm
    assert worst_weight < 0.05 * LR * STEPS, worst_weight
