"""Pipeline parallelism in compile mode (`[compile] mode = "compile"`, trainer/step/pipeline.py).

Compile mode with PP is the eager pipeline step over stages whose blocks are compiled the way the
non-PP compile mode compiles them: `build_model` prunes the model to the pp rank's layers, then
`parallelize_model` runs `apply_compile` (parallelisms/compile.py: `block.compile(backend,
fullgraph=True)` per block, after TP / AC, before SimpleFSDP; Inductor on the CPU), and the stage
views share those compiled blocks. The schedules of torch.distributed.pipelining then run the
chunks as in eager mode. Zero-bubble schedules stay refused (trainer/step/pipeline_rules.py).

What is checked, on 2 or 4 gloo processes against tests/unit/test_pipeline_parallel.py's one
process (its reference, batches and `_compare`): 1F1B and Interleaved1F1B (two stages per rank)
on PP 2, and 1F1B on PP 2 x dp_shard 2 with selective activation checkpointing and 2 accumulation
micro-batches, in compile mode == one process (losses, gradient norms before clipping, every
weight after 3 AdamW steps) and == eager PP; ZBVZeroBubble and InterleavedZeroBubble on PP 2 the same; and Dynamo compiles ONE graph per rank over the
whole run (every block of every stage of the rank shares it: the block's code and shapes are the
same, the parameters are graph inputs), so nothing recompiles per micro-batch, for the last
micro-batch, for the schedule's shape-inference forward or at a later step.

Tolerance: tests/unit/test_pipeline_parallel.py's bounds (losses 2e-6 relative, gradient norms
1e-5 relative, weights 5 % of lr x steps absolute). Inductor keeps the matmuls and the attention as
the same ATen kernels (extern calls on the CPU) and fuses the pointwise ops and the reductions
around them (RMSNorm's mean of squares, SwiGLU, RoPE, the residual adds): those reductions sum
fp32 in another order and its vectorised exp / rsqrt differ by about an ulp, so a compiled block's
output differs from the eager one's by a few ulp (~1e-7 relative), the size of the pipeline's own
reordering of the chunk sums, and the same argument and bounds apply (measured at 1F1B /
Interleaved1F1B on PP 2: losses 2.2e-7, gradient norms 1.4e-7, weights 5.7e-5 against one process;
docs/pipeline_parallel.md "Correctness and tolerance"). A block that did not run (or ran twice),
a stage fed the wrong chunk or a recompiled graph with other weights moves the losses at 1e-3
and the weights by ~lr.
"""

from __future__ import annotations

import pytest
from torch._functorch import config as functorch_config

from parallelisms.pipeline_parallel import SCHEDULES as SCHEDULES_ALL
from tests.unit.test_pipeline_parallel import _compare, _parity, _request, compiled_key
from trainer.step import plan_step
from trainer.step.pipeline import split_backward_config

SCHEDULES = ("1F1B", "Interleaved1F1B")
ZERO_BUBBLE = ("ZBVZeroBubble", "InterleavedZeroBubble")


def test_compile_mode_pp_is_planned():
    """The rule table lets PP through in compile mode with every schedule (the zero-bubble ones
    too), the step plan compiling the blocks with the non-PP compile mode's backend (Inductor on the
    CPU); a TPU outside graph mode stays refused (tests/unit/test_pipeline_parallel.py REFUSALS)."""
    for schedule in SCHEDULES_ALL:
        plan = plan_step(_request(mode="compile", pp_schedule=schedule))
        assert plan.pipeline is not None and plan.pipeline.schedule == schedule
        assert plan.block_compile == plan_step(_request(mode="compile", pp_degree=1)).block_compile == "inductor"
    assert plan_step(_request(mode="compile", cp_degree=2, tp_degree=2)).pipeline is not None


def test_zero_bubble_calls_run_without_donated_buffers():
    """A zero-bubble schedule's calls run with AOTAutograd's donated buffers off (the setting a
    compiled block's joint graph is partitioned and its backward checked under); the other
    schedules' under the process's setting, and it is restored after the call."""
    before = functorch_config.donated_buffer
    for schedule in SCHEDULES_ALL:
        with split_backward_config(schedule):
            assert functorch_config.donated_buffer is (before and schedule not in ZERO_BUBBLE), schedule
        assert functorch_config.donated_buffer is before


def _eager_as_reference(results, schedule):
    """The eager PP run of `schedule` as one process's reference for `_compare`: rank 0's losses
    (the world mean, the same on every rank) and the union of the ranks' weights."""
    state = {}
    for rank_out in results:
        state.update(rank_out[schedule][1])
    return results[0][schedule][0], state


@pytest.mark.multiprocess
def test_compiled_stages_equal_one_process_and_eager_pp():
    """PP 2 in compile mode, 1F1B and Interleaved1F1B, 4 chunks of 2 sequences == one process and
    == eager PP on the same batches; one compiled graph per rank over the whole run (scheduled
    tier: Inductor compiles on every rank)."""
    results: list = []
    _parity(2, SCHEDULES, modes=("eager", "compile"), results=results)
    for schedule in SCHEDULES:
        _compare(results, _eager_as_reference(results, schedule), (compiled_key(schedule),))
        assert [r[compiled_key(schedule), "graphs"] for r in results] == [1, 1], schedule


@pytest.mark.multiprocess
def test_compiled_zero_bubble_stages_equal_one_process_and_eager_pp():
    """PP 2 in compile mode, ZBVZeroBubble (two stages per rank in V order) and
    InterleavedZeroBubble (two in loop order), 4 chunks of 2 sequences == one process and == eager
    PP: each compiled block's backward runs twice per chunk (input gradient, then weight gradient),
    under `split_backward_config`; one compiled graph per rank (scheduled tier). Without the config
    patch the first weight-gradient pass raises (donated buffers, pytorch/pytorch#161904)."""
    results: list = []
    _parity(2, ZERO_BUBBLE, modes=("eager", "compile"), results=results)
    for schedule in ZERO_BUBBLE:
        _compare(results, _eager_as_reference(results, schedule), (compiled_key(schedule),))
        assert [r[compiled_key(schedule), "graphs"] for r in results] == [1, 1], schedule


@pytest.mark.multiprocess
def test_compiled_stages_with_fsdp_accumulation_and_sac_equal_one_process():
    """PP 2 x dp_shard 2 in compile mode (4 gloo processes), 1F1B with selective activation
    checkpointing (the compile recipes' AC) and 2 accumulation micro-batches of 2 sequences per rank,
    each in 2 chunks == one process; one compiled graph per rank (scheduled tier)."""
    results: list = []
    _parity(4, ("1F1B",), dp_shard=2, accum=2, microbatches=2, ac_mode="selective", modes=("compile",), results=results)
    assert [r[compiled_key("1F1B"), "graphs"] for r in results] == [1] * 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("ep", [1, 2], ids=["pp2", "pp2_ep2"])
def test_compiled_moe_stages_equal_one_process(ep):
    """Qwen 3 MoE on PP 2 in compile mode (each stage's MoE blocks compiled; the aux loss and the
    expert loads taken off the block stack after the compiled blocks ran), 1F1B == one process:
    losses, aux loss, gradient norms, MaxVio, expert biases and weights within
    tests/unit/test_pipeline_moe.py's bounds; every graph compiled in the first step, none after.
    `pp2`: 2 processes, 4 chunks of 2 sequences, one graph per rank; `pp2_ep2`: PP 2 x EP 2
    (dp_shard 2 per stage, the 8 experts split over the stage's 2 ranks; 4 processes), 2 chunks of
    2 sequences per rank, two graphs per rank: Dynamo guards on the identity of the experts'
    `_ep_mesh` and their weights' device mesh (parallelisms/simple_fsdp.py `_gather`), which holds
    for one block and not the next, and the non-PP compile mode on dp_shard 2 x EP 2 compiles the
    same two (measured 2026-12-07) (scheduled tier)."""
    from tests.unit.test_pipeline_moe import STEPS
    from tests.unit.test_pipeline_moe import _parity as moe_parity

    results: list = []
    if ep == 1:
        moe_parity(2, ("1F1B",), mode="compile", results=results)
    else:
        moe_parity(4, ("1F1B",), dp=2, ep=2, chunks=2, mode="compile", results=results)
    assert [r["1F1B", "graphs"] for r in results] == [[ep] * STEPS] * len(results)


@pytest.mark.multiprocess
def test_compiled_stages_with_cp_equal_one_process():
    """PP 2 x CP 2 in compile mode (4 gloo processes: every stage's compiled blocks run the CP
    attention op on the cp shard at its global positions), 1F1B, 4 chunks of 2 sequences == one
    process; one compiled graph per rank (scheduled tier)."""
    from tests.support.parallel_harness import llama3_args, run_processes
    from tests.unit.test_pipeline_cp import CP, PP
    from tests.unit.test_pipeline_cp import _worker as cp_worker
    from tests.unit.test_pipeline_parallel import N_LAYERS, _batches, _one_process_reference

    batches = _batches(llama3_args(N_LAYERS).vocab_size)
    results = run_processes(PP * CP, cp_worker, batches, ("1F1B",), 1, "compile")
    _compare(results, _one_process_reference(0, batches), ("1F1B",))
    assert [r["1F1B", "graphs"] for r in results] == [1] * (PP * CP)


COMPILE = ("--compile.mode=compile",)
"""The trainer's compile mode (per-block compile, the backend `auto`: Inductor on the CPU)."""


@pytest.mark.multiprocess
def test_trainer_pp2_compile_is_the_one_process_run(tmp_path):
    """`trainer.train --compile.mode=compile` with pipeline_parallel_degree 2 (1F1B, 2 micro-batches
    of 2 sequences; 2 gloo processes in a drawn device order) is the one process's compile-mode run
    of the same config: losses, gradient norms and validation (`schedule.eval`, the no-grad forward)
    at steps 1-4 and the step-4 weights, within tests/e2e/test_pipeline_train.py's bounds
    (scheduled tier)."""
    from tests.e2e.test_pipeline_train import pp_run_is_the_one_process_run

    pp_args = (*COMPILE, "--parallelism.pipeline_schedule=1F1B", "--parallelism.pipeline_microbatches=2")
    pp_run_is_the_one_process_run(tmp_path, "pp2", 2, COMPILE, pp_args)


@pytest.mark.multiprocess
def test_trainer_pp2_tp2_compile_is_the_one_process_run(tmp_path):
    """PP 2 x TP 2 through `trainer.train --compile.mode=compile` (4 gloo processes; each stage's
    blocks sharded by the TP plan, then compiled; sequence parallel between them) is the one
    process's compile-mode run, validation included, and the same weights at step 4 (scheduled
    tier)."""
    from tests.e2e.test_pipeline_train import _four_ranks_are_the_one_process_run

    _four_ranks_are_the_one_process_run(tmp_path, "pp2tp2_compile", COMPILE, COMPILE)
