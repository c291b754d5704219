"""The pure parts of scripts/bench/bench_pipeline.py (the measured PP bubble and the side by side
with TorchTitan's PP) and the peer shim's pre-split pipeline step (scripts/bench/peer/
torchtitan_cpu_shim.py, shim 5). Nothing here times anything: fake metrics records and fake
schedules."""

import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name, rel):
    spec = importlib.util.spec_from_file_location(name, ROOT / rel)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bp = _load("bench_pipeline", "scripts/bench/bench_pipeline.py")
shim = _load("torchtitan_cpu_shim", "scripts/bench/peer/torchtitan_cpu_shim.py")


def test_variants_are_one_process_then_every_schedule_and_m_with_equal_stages():
    vs = bp.variants(2, ["GPipe", "ZBVZeroBubble"], [2, 8])
    assert [v.name for v in vs] == [
        "pp1",
        "pp1-acc2",
        "pp1-acc8",
        "pp2-GPipe-m2",
        "pp2-GPipe-m8",
        "pp2-ZBVZeroBubble-m2",
        "pp2-ZBVZeroBubble-m8",
    ]
    assert vs[0].overrides(8) == []
    # T_1(m): the one process runs the same chunks as accumulation micro-batches
    assert vs[2].overrides(8) == ["--training.local_batch_size=1", "--training.gradient_accumulation_steps=8"]
    ov = vs[6].overrides(8)
    assert "--parallelism.pipeline_schedule=ZBVZeroBubble" in ov and "--parallelism.pipeline_microbatches=8" in ov
    # equal stages: no lighter first / last stage; no data parallelism on the 2 ranks
    assert "--parallelism.pipeline_first_stage_less_layers=0" in ov
    assert "--parallelism.pipeline_last_stage_less_layers=0" in ov
    assert "--parallelism.data_parallel_shard_degree=1" in ov


def test_step_times_are_elapsed_differences_after_warmup():
    records = [{"step": s, "elapsed_s": e} for s, e in [(1, 5.0), (2, 6.0), (3, 6.5), (4, 7.25), (5, 8.0)]]
    assert bp.step_times(records, warmup=2) == [0.5, 0.75, 0.75]
    # a missing step leaves no difference across the gap
    assert bp.step_times([r for r in records if r["step"] != 4], warmup=2) == [0.5]


def test_measured_bubble_against_the_one_process_step():
    # T_1 = 2 s of work on one process; PP 2 ideal 1 s per rank; a 1.5 s step idles a third of it
    assert bp.measured_bubble(1.5, 2.0, 2) == pytest.approx(1 / 3)
    assert bp.measured_bubble(1.0, 2.0, 2) == 0.0


def _run(variant, pp, rep, step_s, rss, plan, rc=0):
    run = {"variant": variant, "pp": pp, "schedule": "-", "microbatches": 0, "planned_bubble": 0.2}
    run.update(repeat=rep, rc=rc, step_s=step_s, load_avg=2.0)
    run.update({f"rss_mib_r{r}": v for r, v in enumerate(rss)})
    run.update({f"plan_mib_r{r}": v for r, v in enumerate(plan)})
    return run


def test_summarize_medians_bubble_and_memory_differences():
    runs = [
        _run("pp1", 1, 0, 2.0, [1000], [430]),
        _run("pp2-1F1B-m4", 2, 0, 1.6, [700, 720], [120, 118]),
        _run("pp1", 1, 1, 2.2, [1002], [430]),
        _run("pp2-1F1B-m4", 2, 1, 1.2, [702, 722], [120, 118]),
        _run("pp1", 1, 2, 1.8, [1004], [430]),
        _run("pp2-1F1B-m4", 2, 2, 1.25, [704, 724], [120, 118]),
        _run("pp2-1F1B-m4", 2, 3, 0.1, [1, 1], [120, 118], rc=1),  # a failed run counts in runs, not in the medians
    ]
    one, pp = bp.summarize(runs, 2)
    assert (one["step_s"], one["ok"], one["runs"]) == (2.0, 3, 3)
    assert (pp["step_s"], pp["ok"], pp["runs"], pp["step_s_min"], pp["step_s_max"]) == (1.25, 3, 4, 1.2, 1.6)
    assert pp["ideal_step_s"] == 1.0 and pp["measured_bubble"] == pytest.approx(0.2)
    assert (pp["rss_delta_mib_r0"], pp["rss_delta_mib_r1"]) == (702 - 1002, 722 - 1002)
    assert (pp["plan_delta_mib_r0"], pp["plan_delta_mib_r1"]) == (120 - 430, 118 - 430)
    table = bp.format_table([one, pp], 2)
    assert (
        "| pp2-1F1B-m4 | 1.250 (1.200..1.600) | 1.000 | 20.0% | - | - | 20.0% | - | -300 (-310) | -280 (-312) |"
        in table
    )


def test_bubble_at_the_same_micro_batch_uses_the_accumulation_baseline():
    # m 4 chunks cost the one process 2.4 s (vs 2.0 whole): PP 2 at 1.5 s idles 20 % beyond 1.2 s
    acc = _run("pp1-acc4", 1, 0, 2.4, [900], [300])
    acc["microbatches"] = 4
    pp = _run("pp2-1F1B-m4", 2, 0, 1.5, [700, 720], [120, 118])
    pp.update(microbatches=4, planned_imbalance=1.1, planned_bubble_imbalance=1 - 0.8 / 1.1)
    one, acc_row, pp_row = bp.summarize([_run("pp1", 1, 0, 2.0, [1000], [430]), acc, pp], 2)
    assert pp_row["measured_bubble"] == pytest.approx(1 / 3)  # against the whole-batch T_1
    assert pp_row["ideal_step_s_at_m"] == pytest.approx(1.2)
    assert pp_row["measured_bubble_at_m"] == pytest.approx(0.2)
    assert "measured_bubble_at_m" not in acc_row and "measured_bubble_at_m" not in one
    assert pp_row["planned_bubble_imbalance"] == pytest.approx(0.2727, abs=1e-4)
    table = bp.format_table([one, acc_row, pp_row], 2)
    assert "| pp1-acc4 | 2.400 (2.400..2.400) | - | - | - | - | - | - | - | - |" in table


def test_side_by_side_jobs_interleave_and_match_the_micro_batches():
    args = SimpleNamespace(
        microbatches="4,8",
        seq_len=512,
        batch=8,
        schedules="GPipe,1F1B",
        repeats=2,
        steps=10,
        warmup=3,
        peer_python="py",
    )
    jobs = bp.side_by_side_jobs(args, Path("/tmp/x"))
    names = [(j["variant"], j["repeat"]) for j in jobs]
    order = ["1proc", "pp2_GPipe_m4", "pp2_1F1B_m4"]
    assert names == [(f"{side}_{n}", rep) for rep in (0, 1) for n in order for side in ("ours", "torchtitan")]
    ours, theirs = jobs[4]["cmd"], jobs[5]["cmd"]  # PP 2, 1F1B
    assert "--parallelism.pipeline_microbatches=4" in ours and "--training.seq_len=512" in ours
    assert "--nproc_per_node=2" in ours
    i = theirs.index("--parallelism.pipeline-parallel-microbatch-size")
    assert theirs[i + 1] == "2"  # batch 8 / m 4
    assert "--training.disable-cuda-graphs" in theirs and theirs[-1] == "activation-checkpoint:none"
    assert (
        jobs[1]["cmd"][-1] == "activation-checkpoint:none"
        and "--parallelism.pipeline-parallel-degree" not in jobs[1]["cmd"]
    )


def test_side_by_side_ratios_pair_each_setting():
    rows = [
        {"variant": "ours_1proc", "tokens_per_sec": 6000.0},
        {"variant": "torchtitan_1proc", "tokens_per_sec": 3000.0},
        {"variant": "ours_pp2_1F1B_m4", "tokens_per_sec": 3000.0},
        {"variant": "torchtitan_pp2_1F1B_m4", "tokens_per_sec": 1200.0},
    ]
    got = {r["variant"]: r["vs_peer"] for r in bp.side_by_side_ratios(rows)}
    assert got == {"ours_1proc": 2.0, "torchtitan_1proc": None, "ours_pp2_1F1B_m4": 2.5, "torchtitan_pp2_1F1B_m4": None}


def test_shim_runs_presplit_micro_batches_and_passes_whole_batches_through(monkeypatch):
    """Shim 5 on torch's own schedule classes: TorchTitan 0.3.0's `step(arg_mbs=..., kwarg_mbs=...,
    target_mbs=...)` goes to `_step_microbatches` with the lists as given (torch 2.13's `step` would
    split them again), a whole-batch call reaches torch's `step` unchanged."""
    from torch.distributed.pipelining import schedules

    seen = []

    def whole_batch(self, *args, **kwargs):
        seen.append(("whole", args, kwargs))

    monkeypatch.setattr(schedules.PipelineScheduleSingle, "step", whole_batch)
    monkeypatch.setattr(schedules.PipelineScheduleMulti, "step", schedules.PipelineScheduleMulti.step)
    shim.accept_presplit_microbatches()
    shim.accept_presplit_microbatches()  # idempotent: no double wrap

    class Stage:
        is_last = True
        output_chunks = ["out"]

        def clear_runtime_states(self):
            seen.append("cleared")

    class Fake(schedules.PipelineScheduleSingle):
        def __init__(self):
            self._stage, self._has_backward = Stage(), True

        def _step_microbatches(self, arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=None):
            seen.append(("split", arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs))

        def _merge_outputs(self, chunks):
            return chunks

    sched, losses = Fake(), []
    out = sched.step(
        arg_mbs=[(1,), (2,)], kwarg_mbs=[{}, {}], target_mbs=["a", "b"], losses=losses, loss_kwargs={"k": 1}
    )
    assert seen == ["cleared", ("split", [(1,), (2,)], [{}, {}], ["a", "b"], losses, True, {"k": 1})]
    assert out == ["out"] and sched._stage.has_backward is True
    seen.clear()
    assert sched.step("x", target="t", return_outputs=False) is None
    assert seen == [("whole", ("x",), {"target": "t", "losses": None, "return_outputs": False, "loss_kwargs": None})]
