"""Multislice targets in the planner: `v6e-256x2` parsing, the DCN all-reduce arithmetic
(planner/multislice.py), the slice rule in the planner's layouts, and the recipe check on a
2-slice target (a fake world of every slice's devices)."""

from types import SimpleNamespace

import pytest

from models.errors import ConfigError
from planner.multislice import dcn_cost
from planner.targets import parse_target


def test_multislice_target_names():
    t = parse_target("v6e-256x2")
    assert (t.name, t.devices, t.chips, t.num_slices, t.size, t.slice_devices, t.hosts_per_slice) == (
        "v6e-256x2",
        512,
        512,
        2,
        256,
        256,
        64,
    )
    assert t.dcn_bytes_per_s_per_host == 4 * 100e9 / 8  # 4 chips x 100 Gb/s
    v7 = parse_target("tpu7x-1024x4")
    assert (v7.name, v7.devices, v7.chips, v7.hosts_per_slice) == ("v7x-1024x4", 4096, 2048, 128)
    assert parse_target("v6e-256").num_slices == 1 and parse_target("v4-8").dcn_bytes_per_s_per_host is None
    for bad in ("v6e-256x0", "h100-64x2", "v6e-256x"):
        with pytest.raises(ConfigError, match="--target"):
            parse_target(bad)


def test_dcn_all_reduce_arithmetic():
    """1 GiB of fp32 gradient shard per device, 4 devices per v6e host at 50 GB/s: a ring over 2
    slices moves 2 x 1/2 x 4 GiB per host -> 4 GiB / 50 GB/s; 4 slices: 2 x 3/4 of it."""
    est = SimpleNamespace(grads=2**30, grad_accum=1, recompute_factor=1.0, step_time_s=3.0, n_layers=10)
    two = dcn_cost(est, parse_target("v6e-256x2"))
    assert two.dcn_s == pytest.approx(4 * 2**30 / 50e9)
    assert dcn_cost(est, parse_target("v6e-256x4")).dcn_s == pytest.approx(1.5 * 4 * 2**30 / 50e9)
    assert dcn_cost(est, parse_target("v6e-256x2"), reduce_bytes=2).dcn_s == pytest.approx(two.dcn_s / 2)
    assert two.backward_s == pytest.approx(2.0) and two.exposed_s == pytest.approx(two.dcn_s / 10)
    assert two.efficiency_serial == pytest.approx(3.0 / (3.0 + two.dcn_s))
    slow = dcn_cost(SimpleNamespace(**{**vars(est), "step_time_s": 0.03, "grad_accum": 2}), parse_target("v6e-256x2"))
    assert slow.dcn_s == pytest.approx(2 * two.dcn_s) and slow.exposed_s == pytest.approx(slow.dcn_s - 0.02)
    assert dcn_cost(est, parse_target("v6e-256")).dcn_s == 0.0
    # replicate_reduce = "step": 4 micro-batches pay one reduction, hidden only under the last
    # micro-batch's backward (a quarter of the step's 2.0 s)
    accum = SimpleNamespace(**{**vars(est), "grad_accum": 4})
    per_micro, once = (
        dcn_cost(accum, parse_target("v6e-256x2")),
        dcn_cost(accum, parse_target("v6e-256x2"), once_per_step=True),
    )
    assert (per_micro.reductions, once.reductions) == (4, 1)
    assert once.dcn_s == pytest.approx(per_micro.dcn_s / 4) and once.backward_s == pytest.approx(0.5)


def test_recipe_check_on_two_slices():
    from tools.recipe_check import check_recipe

    refused = check_recipe("configs/llama3_70b_v6e.toml", capture=False, overrides=[("job.target", "v6e-256x2")])
    assert refused.error.startswith("parallelism.data_parallel_replicate_degree: 1 on 2 slices")
    ok = check_recipe(
        "configs/llama3_70b_v6e.toml",
        capture=False,
        overrides=[("job.target", "v6e-256x2"), ("parallelism.data_parallel_replicate_degree", "2")],
    )
    assert ok.error is None and ok.devices == 512 and ok.fits, ok
    assert ok.mesh.startswith("dp_rep 2 x fsdp 256")


def test_a_slice_count_other_than_the_targets_is_a_rule():
    """`parallelism.num_slices` against the slices `job.target` names (`v6e-256x2`) is a rule of
    trainer/step/plan.py, not the recipe check's own raise (tools/recipe_check.py world_of raised it
    before): the check, the planner and the trainer refuse it alike; 0 takes the target's count."""
    from tools.recipe_check import check_recipe
    from trainer.job_plan import target_slices
    from trainer.step.plan import StepRequest, refusals

    two = [("job.target", "v6e-256x2"), ("parallelism.data_parallel_replicate_degree", "2")]
    bad = check_recipe("configs/llama3_70b_v6e.toml", capture=False, overrides=[*two, ("parallelism.num_slices", "3")])
    assert bad.error == "parallelism.num_slices: 3, but job.target has 2 slices; allowed: 2 or 0", bad.error
    ok = check_recipe("configs/llama3_70b_v6e.toml", capture=False, overrides=[*two, ("parallelism.num_slices", "0")])
    assert ok.error is None and ok.devices == 512, ok
    assert refusals(StepRequest(recipe_num_slices=3, target_num_slices=2)) == [bad.error]
    assert refusals(StepRequest(recipe_num_slices=2, target_num_slices=2)) == []
    assert [target_slices(t) for t in ("v6e-256x2", "V7X-512x4", "v6e-256", "")] == [2, 4, 1, 1]
