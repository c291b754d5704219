"""Graph-mode pipeline parallelism across slices (docs/pipeline_parallel.md, "Across slices"): the pp
axis outermost over the slices, each slice holding whole stages with FSDP inside it, only the stage
permutes crossing the data-center network.

Unit part: the rule table (several slices run graph-mode PP only; `pp x dp_replicate` must be a
multiple of the slice count), the DCN split of `ParallelDims` with PP, and the mesh `build_mesh`
gives on a fake 2-slice world (the pp groups span the slices, the FSDP groups stay inside one).

End-to-end part (`test_graph_pp_over_two_slices_trains_like_one_process`): 2 "slices" x 1 "host" x
2 CPU processes, two launchers on loopback with `MEGASCALE_NUM_SLICES=2` and each host's
`MEGASCALE_SLICE_ID` (what tests/e2e/test_multislice.py simulates for HSDP), graph mode (aot_eager),
PP 2 (GPipe, 2 chunks) over the slices x FSDP 2 in each, against one process in graph mode on the
same global batch of 4 sequences, fp32, 3 steps. Bound 1e-5 relative on the losses and gradient
norms (tests/e2e/test_multislice.py's argument: the same per-sequence terms summed in another order,
~6e-8 per reduction over a few hundred reductions and 3 AdamW steps); graph-mode PP itself is within
1.1e-7 of one process (docs/pipeline_parallel.md, "Correctness and tolerance"). It fails when the
slices and the stages disagree: the trainer checks each rank's `MEGASCALE_SLICE_ID` against the
slice-major numbering at `build_mesh` (one `error:` line), a stage whose FSDP group crossed the
slices is refused by the rule table, and a wrong stage mask or a missing gradient moves the second
step's loss by > 1e-3 (the graph-mode PP tests).
"""

from __future__ import annotations

import pytest
import torch

from models.errors import ConfigError
from parallelisms.parallel_dims import ParallelDims
from tests.support.trainer_runs import read_metrics, train
from trainer.step.plan import StepRequest, plan_step, refusals

GRAPH_PP = dict(
    mode="graph",
    pp_degree=2,
    pp_schedule="GPipe",
    pp_first_less=0,
    pp_last_less=0,
    model_has_experts=False,
    n_layers=4,
    local_batch=2,
)


def test_pp_over_slices_rules_and_dcn_split():
    """Graph-mode PP 2 on 2 slices starts; eager PP on slices, and slices that would split a stage's
    FSDP group, are one rule-table line each; the DCN split lands on the pp axis."""
    assert refusals(StepRequest(**GRAPH_PP, num_slices=2, dp_replicate=1)) == []
    assert refusals(StepRequest(**{**GRAPH_PP, "pp_degree": 4, "n_layers": 8, "local_batch": 4}, num_slices=2)) == []
    assert refusals(StepRequest(**GRAPH_PP, num_slices=4, dp_replicate=2)) == []  # HSDP 2 x PP 2 on 4 slices
    (message,) = refusals(StepRequest(**GRAPH_PP, num_slices=4, dp_replicate=1))
    assert message.startswith("parallelism.data_parallel_replicate_degree: 1 on 4 slices puts FSDP/EP")
    assert "pipeline_parallel_degree (2) x data_parallel_replicate_degree a multiple of 4" in message
    with pytest.raises(ConfigError) as e:
        plan_step(StepRequest(**{**GRAPH_PP, "mode": "eager"}, num_slices=2))
    assert str(e.value).startswith("parallelism.pipeline_parallel_degree: 2 on 2 slices runs as graph mode")
    assert 'allowed: 1, or compile.mode = "graph"' in str(e.value)

    dims = ParallelDims(pp=2, dp_shard=-1, num_slices=2, world_size=512)  # the 405B recipe's
    assert (dims.layout_shape, dims.dcn_mesh_shape, dims.ici_mesh_shape) == (
        (2, 256, 1, 1),
        (2, 1, 1, 1),
        (1, 256, 1, 1),
    )
    dims = ParallelDims(pp=4, dp_shard=2, num_slices=2, world_size=8)  # 2 stages per slice
    assert (dims.dcn_mesh_shape, dims.ici_mesh_shape) == ((2, 1, 1, 1), (2, 2, 1, 1))
    dims = ParallelDims(pp=2, dp_replicate=2, dp_shard=2, num_slices=4, world_size=8)  # one (stage, replica) each
    assert (dims.dcn_mesh_shape, dims.ici_mesh_shape) == ((4, 1, 1, 1), (1, 2, 1, 1))
    with pytest.raises(ConfigError, match=r"pipeline_parallel_degree \(2\) x data_parallel_replicate_degree"):
        ParallelDims(pp=2, dp_shard=1, tp=2, num_slices=4, world_size=4)  # TP across slices


def test_pp_mesh_on_two_slices_keeps_fsdp_inside_a_slice(monkeypatch):
    """The pp mesh on a fake 2-slice world of 8 ranks (pp 2 x FSDP 4): the pp groups pair rank r of
    slice 0 with rank r of slice 1, every FSDP group is one slice's ranks; a rank whose
    MEGASCALE_SLICE_ID disagrees with slice-major numbering is a ConfigError."""
    import planner
    from parallelisms import build_mesh
    from parallelisms.parallel_dims import axis_groups, pp_mesh

    dims = ParallelDims(pp=2, dp_shard=4, num_slices=2, world_size=8)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "0")
    with planner.fake_process_group(8):
        stage = build_mesh(dims, "cpu")
        assert pp_mesh(stage).mesh.tolist() == [0, 4]  # rank 0's pp group: one rank per slice
        assert stage.mesh.flatten().tolist() == [0, 1, 2, 3]  # rank 0's stage: slice 0's ranks
        assert stage._titan_checked_axes  # the shard invariant was checked on every axis
    per_slice = dims.world_size // dims.num_slices
    ranks = torch.arange(8).reshape(2, *dims.mesh_shape)  # the world grid `_build_pp_mesh` builds
    pp_groups, _, shard_groups, _, _ = axis_groups(ranks)
    assert all(len({r // per_slice for r in g}) == 2 for g in pp_groups)
    assert all(len({r // per_slice for r in g}) == 1 for g in shard_groups)
    monkeypatch.setenv("MEGASCALE_SLICE_ID", "1")  # rank 0 cannot be on slice 1
    with planner.fake_process_group(8), pytest.raises(ConfigError, match="slice-major numbering puts it on slice 0"):
        build_mesh(dims, "cpu")


GRAPH_ARGS = [
    "--compile.mode=graph",
    "--compile.backend=aot_eager",
    "--model.n_layers=4",
]
PP_ARGS = [
    "--parallelism.pipeline_parallel_degree=2",
    "--parallelism.data_parallel_shard_degree=2",
    "--parallelism.pipeline_schedule=GPipe",
    "--parallelism.pipeline_microbatches=2",
    "--parallelism.pipeline_first_stage_less_layers=0",
    "--parallelism.pipeline_last_stage_less_layers=0",
    "--training.local_batch_size=2",
]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_graph_pp_over_two_slices_trains_like_one_process(tmp_path):
    """2 slices x 1 host x 2 processes (graph-mode PP 2 over the slices x FSDP 2 in each) == one
    process in graph mode, fp32, 3 steps (bound: module docstring)."""
    from tests.e2e.test_multislice import TRAIN, _launch_hosts

    two_slices = _launch_hosts(tmp_path, "pp_two_slices", slices=2, hosts=1, nproc=2, extra=[*GRAPH_ARGS, *PP_ARGS])
    single = list(train(tmp_path / "single", 1, {}, *TRAIN, *GRAPH_ARGS).values())  # global batch 4
    assert len(two_slices) == len(single) == 3
    for key in ("loss", "grad_norm"):
        want = [r[key] for r in single]
        rel = max(abs(a[key] - b) / abs(b) for a, b in zip(two_slices, want))
        print(f"pp over 2 slices {key}: 1 process {want}; 2 slices {[r[key] for r in two_slices]}; max rel {rel:.2e}")
        assert rel < 1e-5, (key, rel)
    assert read_metrics(tmp_path / "pp_two_slices")  # rank 0's records (the last stage's loss, summed over pp)
