"""Pipeline parallelism (parallelisms/pipeline_parallel.py, trainer/step/pipeline.py).

The arithmetic the planner calls (stage split, stage placement, bubble fraction), the pruned
model's parameter names, the rule table's refusals, and every schedule on 2 gloo processes
against one process on the same global batch (losses and final weights).

Tolerance of the schedule parity (fp32): the pipeline computes the same ops on the same weights,
but the step's loss is the sum of the per-chunk means x 1 / chunks where one process takes the mean
over the whole batch, and each parameter's gradient is summed over chunks (with the zero-bubble
schedules the weight gradient is a separate autograd pass): fp32 sums in another order, a few ulp
(~1e-7 relative) per step. Losses and gradient norms (before clipping: AdamW and clipping would hide a wrongly scaled gradient):
asserted within 2e-6 relative (measured: losses 1.1e-7, norms 2e-7).
Weights: AdamW divides each element's moment by sqrt(v) + eps, so an element whose gradient is small
(near eps = 1e-8, where the reordered sums' rounding is a sizable part of it) moves by another
fraction of lr; the bound is in units of lr: at most 5 % of lr x steps = 1.5e-4 absolute (measured
3.0e-5 = 1 %, on embedding rows and the last blocks' out-projections; a wrong or missing gradient
moves elements by ~lr per step).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.errors import ConfigError
from parallelisms.pipeline_parallel import (
    SCHEDULES,
    PipelinePlan,
    bubble_fraction,
    max_stages,
    prune_model,
    split_layers,
    stage_ids,
    virtual_stages,
)
from trainer.step import StepRequest, plan_step

# ------------------------------------------------------------------------------ the arithmetic


def test_split_layers_gives_first_and_last_stages_fewer_blocks():
    assert [list(r) for r in split_layers(6, 2)] == [[0, 1, 2], [3, 4, 5]]
    assert [len(r) for r in split_layers(32, 4)] == [8, 9, 8, 7]  # 34 units: 9 9 8 8, less 1 at the ends
    assert [len(r) for r in split_layers(6, 4)] == [1, 2, 2, 1]
    assert [len(r) for r in split_layers(8, 4, first_stage_less=0, last_stage_less=0)] == [2, 2, 2, 2]
    assert [len(r) for r in split_layers(5, 1)] == [5]
    for n, s in ((32, 4), (80, 8), (7, 3), (126, 16)):
        split = split_layers(n, s)
        assert [i for r in split for i in r] == list(range(n)) and min(map(len, split)) >= 1
    with pytest.raises(ValueError, match="without a block"):
        split_layers(4, 4)  # 6 units: the last stage would hold none
    assert max_stages(4) == 3 and max_stages(6) == 4 and max_stages(32) == 17  # 34 units: 2 per stage at most 17


def test_stage_placement_per_schedule():
    assert virtual_stages("GPipe", 0) == virtual_stages("1F1B", 0) == 1
    assert virtual_stages("ZBVZeroBubble", 0) == 2 and virtual_stages("Interleaved1F1B", 3) == 3
    assert virtual_stages("Interleaved1F1B", 0) == 2
    assert [stage_ids(r, 4, "1F1B", 1) for r in range(4)] == [(0,), (1,), (2,), (3,)]
    assert [stage_ids(r, 2, "Interleaved1F1B", 3) for r in range(2)] == [(0, 2, 4), (1, 3, 5)]
    assert [stage_ids(r, 4, "ZBVZeroBubble", 2) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    plan = PipelinePlan(pp=2, schedule="ZBVZeroBubble", num_virtual=2, microbatches=4)
    assert plan.rank_has_first_last(0) == (True, True) and plan.rank_has_first_last(1) == (False, False)
    assert plan.rank_layers(6, 0) == [0, 5] and plan.rank_layers(6, 1) == [1, 2, 3, 4]


def test_bubble_fraction_formulas():
    assert bubble_fraction("GPipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("1F1B", 4, 8) == bubble_fraction("GPipe", 4, 8)
    assert bubble_fraction("Interleaved1F1B", 4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2) == 0.0  # f = b = w: the design point
    # a forward and input-gradient pass twice the weight pass: (p-1)(f+b-2w)/v over m(f+b+w)
    assert bubble_fraction("ZBVZeroBubble", 4, 8, 2, f=2, b=2, w=1) == pytest.approx(3.0 / (3.0 + 40))
    assert bubble_fraction("1F1B", 1, 8) == 0.0
    assert PipelinePlan(pp=2, schedule="GPipe", num_virtual=1, microbatches=2).bubble() == pytest.approx(1 / 3)


def test_pruned_model_keeps_the_model_s_own_names():
    from models.llama3 import FLAVORS, Transformer

    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=6)
    with torch.device("meta"):
        whole = set(Transformer(args).state_dict())
    plan = PipelinePlan(pp=2, schedule="Interleaved1F1B", num_virtual=2, microbatches=4)
    union = set()
    for pp_rank in range(2):
        first, last = plan.rank_has_first_last(pp_rank)
        with torch.device("meta"):
            part = prune_model(
                Transformer(args), block="layers", layers=plan.rank_layers(6, pp_rank), first=first, last=last
            )
        keys = set(part.state_dict())
        assert keys <= whole and not (keys & union)
        union |= keys
    assert union == whole
    assert any(k.startswith("layers.5.") for k in union) and "tok_embeddings.weight" in union


# ------------------------------------------------------------------------------ the rule table


def _request(**kw) -> StepRequest:
    base = dict(pp_degree=2, model_has_experts=False, n_layers=6, local_batch=4, model_document_mask=True)
    return StepRequest(**{**base, **kw})


GRAPH = dict(mode="graph", pp_schedule="GPipe", pp_first_less=0, pp_last_less=0)
"""Graph-mode PP that the earlier rules let through (GPipe, uniform stages)."""
REFUSALS = [
    (dict(pp_schedule="Bogus"), "parallelism.pipeline_schedule", "allowed: GPipe, 1F1B"),
    (dict(mode="graph"), "parallelism.pipeline_schedule", "compile.mode graph"),
    (dict(device_type="tpu"), "parallelism.pipeline_parallel_degree", "device tpu"),
    (dict(device_type="tpu", mode="compile"), "parallelism.pipeline_parallel_degree", "compile.mode compile"),
    (
        dict(model_has_experts=True, moe_routing="random", routing_benchmark_only=True),
        "moe.routing",
        "random with pipeline_parallel_degree 2",
    ),
    (dict(mtp_depth=1), "parallelism.pipeline_parallel_degree", "mtp_depth 1"),
    (dict(tie_embeddings=True), "parallelism.pipeline_parallel_degree", "tied embeddings True"),
    (dict(model_pipeline=False), "parallelism.pipeline_parallel_degree", "decoder False"),
    (dict(replicate_reduce="step"), "parallelism.pipeline_parallel_degree", "replicate_reduce step (step)"),
    (dict(initial_load_format="hf"), "parallelism.pipeline_parallel_degree", "initial_load_path ('hf'"),
    (dict(n_layers=2, pp_degree=4, local_batch=8), "parallelism.pipeline_parallel_degree", "at most 2"),
    (dict(pp_microbatches=3), "parallelism.pipeline_microbatches", "divisor of 4"),
    (dict(pp_microbatches=2, pp_degree=4, n_layers=8), "parallelism.pipeline_microbatches", ">= 4"),
    (dict(pp_schedule="GPipe", pp_virtual_stages=2), "parallelism.pipeline_virtual_stages", "allowed: 0 or 1"),
    (dict(pp_schedule="ZBVZeroBubble", pp_virtual_stages=3), "parallelism.pipeline_virtual_stages", "0 or 2"),
    (
        dict(pp_schedule="Interleaved1F1B", pp_microbatches=5, local_batch=5),
        "parallelism.pipeline_microbatches",
        "a multiple of 2",
    ),
    (dict(device_order="v6e-8"), "parallelism.device_order", "identity, auto"),
]


@pytest.mark.parametrize(
    "kw, key, fragment", REFUSALS, ids=[",".join(f"{k}={v}" for k, v in kw.items()) for kw, _, _ in REFUSALS]
)
def test_pipeline_refusals_name_the_key(kw, key, fragment):
    with pytest.raises(ConfigError) as e:
        plan_step(_request(**kw))
    message = str(e.value)
    assert message.startswith(f"{key}: ") and fragment in message and "allowed" in message, message


def test_pp_with_tp_loss_parallel_is_planned():
    """TP's loss parallel composes with PP in every mode (eager and compile: `PipelineStep` runs the
    schedule's calls inside `loss_parallel_context`; tests/e2e/test_pipeline_train.py); without TP
    there is nothing vocab-sharded and the plan drops it."""
    for mode, schedule in (("eager", "1F1B"), ("eager", "ZBVZeroBubble"), ("compile", "1F1B"), ("graph", "GPipe")):
        extra = GRAPH if mode == "graph" else {}
        plan = plan_step(_request(**{"mode": mode, "pp_schedule": schedule, **extra}, tp_degree=2, loss_parallel=True))
        assert plan.pipeline is not None and plan.loss_parallel, (mode, schedule)
    assert not plan_step(_request(loss_parallel=True)).loss_parallel


def test_pipeline_plan_resolves_defaults():
    plan = plan_step(_request(pp_schedule="Interleaved1F1B")).pipeline
    assert (plan.pp, plan.num_virtual, plan.microbatches) == (2, 2, 4)
    assert plan_step(_request(pp_degree=1)).pipeline is None
    assert plan_step(_request(pp_schedule="GPipe", pp_microbatches=1)).pipeline.microbatches == 1


# ------------------------------------------------------------------------------ schedules == one process

STEPS = 3
LR = 1e-3
N_LAYERS = 6
BATCH = 8


def _one_process_reference(seed: int, batches, n_layers: int = N_LAYERS):
    """Losses and final weights of the eager step on one process (fp32, AdamW, clipping), the debug
    Llama 3 at `n_layers`."""
    from parallelisms import clip_grad_norm_
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import pp_model
    from trainer.step import EagerStep

    model, opt = pp_model(llama3_args(n_layers), plan_step(StepRequest()), seed=seed, lr=LR)
    step = EagerStep(model=model, optimizer=opt, max_norm=1.0, aux_loss_coef=0.0, clip_grad_norm=clip_grad_norm_)
    outs = [step([b]) for b in batches]
    losses = [(o.loss.item(), o.grad_norm.item()) for o in outs]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def compiled_key(schedule: str) -> str:
    """`_pp_worker`'s key of a schedule's run in compile mode (`schedule` alone: eager mode)."""
    return f"{schedule}/compile"


def _pp_worker(schedules, seed, batches, dp_shard, accum, microbatches, ac_mode="none", modes=("eager",)):
    """On each rank: for each step mode of `modes` ("eager", "compile") and schedule, the PP run's
    losses and this rank's final weights (full), under `schedule` (eager) or `compiled_key(schedule)`;
    in compile mode also the number of graphs Dynamo compiled on this rank over the run
    (`(compiled_key(schedule), "graphs")`)."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from parallelisms import ParallelDims, build_mesh
    from parallelisms.parallel_dims import pp_mesh
    from tests.support.parallel_harness import llama3_args
    from tests.support.pipeline_runs import eager_pipeline_step, full_state, pp_model, rank_run

    out = {}
    for mode in modes:
        for schedule in schedules:
            dims = ParallelDims(pp=2, dp_shard=dp_shard, world_size=dist.get_world_size())
            mesh = build_mesh(dims, "cpu")
            request = StepRequest(
                mode=mode,
                pp_degree=2,
                pp_schedule=schedule,
                pp_microbatches=microbatches,
                model_has_experts=False,
                n_layers=N_LAYERS,
                local_batch=BATCH // dp_shard // accum,
                ac_mode=ac_mode,
            )
            plan = plan_step(request)
            torch._dynamo.reset()
            counters.clear()
            model, opt = pp_model(llama3_args(N_LAYERS), plan, seed=seed, lr=LR, dims=dims, mesh=mesh)
            step = eager_pipeline_step(model, opt, plan, n_layers=N_LAYERS, pp_mesh=pp_mesh(mesh))
            losses = rank_run(step, batches, dp_rank=dims.dp_rank(mesh), dp_shard=dp_shard, accum=accum)
            key = schedule if mode == "eager" else compiled_key(schedule)
            out[key] = (losses, full_state(model))
            if mode == "compile":
                out[key, "graphs"] = counters["stats"]["unique_graphs"]
    return out


def _compare(results, reference, schedules):
    ref_losses, ref_state = reference
    worst_loss = worst_norm = worst_weight = 0.0
    for schedule in schedules:
        covered = set()
        for rank_out in results:
            losses, state = rank_out[schedule]
            # losses and the gradient norms before clipping (AdamW and clipping hide a gradient's scale)
            for (loss, norm), (ref_loss, ref_norm) in zip(losses, ref_losses):
                worst_loss = max(worst_loss, abs(loss - ref_loss) / ref_loss)
                worst_norm = max(worst_norm, abs(norm - ref_norm) / ref_norm)
            for k, v in state.items():
                ref = ref_state[k]
                worst_weight = max(worst_weight, (v - ref).abs().max().item())
                covered.add(k)
        assert covered == set(ref_state), schedule
    print(f"pipeline parity: losses {worst_loss:.2e}, grad norms {worst_norm:.2e}, weights {worst_weight:.2e}")
    assert worst_loss < 2e-6, worst_loss
    assert worst_norm < 1e-5, worst_norm
    assert worst_weight < 0.05 * LR * STEPS, worst_weight
    return worst_loss, worst_norm, worst_weight


def _batches(vocab: int):
    from tests.support.parallel_harness import batch

    return [batch(vocab, batch_size=BATCH, seed=10 + i) for i in range(STEPS)]


def _parity(
    nproc: int,
    schedules,
    *,
    dp_shard: int = 1,
    accum: int = 1,
    microbatches: int = 4,
    ac_mode="none",
    modes=("eager",),
    results: list | None = None,
):
    """Every schedule of `schedules` in every step mode of `modes` == one process; `results`, if
    given, receives each rank's `_pp_worker` output (for more checks)."""
    from tests.support.parallel_harness import llama3_args, run_processes

    batches = _batches(llama3_args(N_LAYERS).vocab_size)
    reference = _one_process_reference(0, batches)
    out = run_processes(nproc, _pp_worker, schedules, 0, batches, dp_shard, accum, microbatches, ac_mode, modes)
    if results is not None:
        results.extend(out)
    keys = [s if mode == "eager" else compiled_key(s) for mode in modes for s in schedules]
    return _compare(out, reference, keys)


@pytest.mark.multiprocess
def test_gpipe_1f1b_and_zbv_equal_one_process():
    """GPipe, 1F1B (one stage per rank) and ZBVZeroBubble (two, V order) on pp 2, 4 chunks of 2
    sequences == one process on the same 8-sequence batches: losses, gradient norms, final weights."""
    _parity(2, ("GPipe", "1F1B", "ZBVZeroBubble"))


@pytest.mark.multiprocess
def test_every_schedule_equals_one_process():
    """Every schedule of SCHEDULES (Interleaved1F1B, LoopedBFS, InterleavedZeroBubble too: two stages
    per rank in loop order) on pp 2 == one process (scheduled tier)."""
    _parity(2, SCHEDULES)


@pytest.mark.multiprocess
def test_pp_with_fsdp_accumulation_and_ac_equals_one_process():
    """pp 2 x dp_shard 2 on 4 gloo processes, 1F1B with full activation checkpointing, 2 accumulation
    micro-batches of 2 sequences per rank, each in 2 chunks == one process."""
    _parity(4, ("1F1B",), dp_shard=2, accum=2, microbatches=2, ac_mode="full")


@pytest.mark.multiprocess
def test_pp_with_fsdp_zero_bubble_equals_one_process():
    """pp 2 x dp_shard 2, ZBVZeroBubble (its weight-gradient pass under SimpleFSDP's gathers) with full
    activation checkpointing and accumulation == one process (scheduled tier)."""
    _parity(4, ("ZBVZeroBubble",), dp_shard=2, accum=2, microbatches=2, ac_mode="full")
