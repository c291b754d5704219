"""MetricsLogger: throughput/MFU arithmetic, metrics.jsonl, TensorBoard, resume, ranks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from trainer.runtime import metrics
from trainer.runtime.metrics import MetricsLogger

CONTRACT_KEYS = {"step", "loss", "grad_norm", "lr", "tokens_per_sec", "tflops", "mfu_pct", "mem_gib", "elapsed_s"}


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(metrics.time, "perf_counter", fake)
    return fake


def read_jsonl(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def read_tb(folder):
    acc = EventAccumulator(str(folder / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def run_steps(logger, clock, steps, *, tokens=1000, dt=0.5, loss=lambda s: 10.0 / s, data_s=lambda s: 0.0):
    for step in steps:
        clock.now += dt
        logger.log(
            step,
            tokens=tokens,
            data_s=data_s(step),
            loss=torch.tensor(loss(step)),
            grad_norm=torch.tensor(1.5),
            lr=3e-4,
        )


def test_records_throughput_and_mfu(tmp_path, clock, capsys):
    fpt = {"palm": 6e6, "causal": 5e6}
    logger = MetricsLogger(
        dump_folder=tmp_path,
        log_freq=2,
        enable_tensorboard=True,
        total_steps=5,
        is_rank0=True,
        flops_per_token=fpt,
        peak_flops=1e11,
        device=torch.device("cpu"),
    )
    run_steps(logger, clock, range(1, 6), data_s=lambda s: 0.01 * s)
    logger.log(6, tokens=0, loss=1.0, force=True, val_loss=torch.tensor(2.5))
    logger.close()

    records = read_jsonl(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 4, 5, 6]  # first, every 2nd, last, forced
    for r in records:
        assert CONTRACT_KEYS <= r.keys()
    by_step = {r["step"]: r for r in records}
    # Step 4 covers steps 3 and 4: 2000 tokens in 1.0 s.
    r = by_step[4]
    assert r["tokens_per_sec"] == pytest.approx(2000.0)
    assert r["tflops"] == pytest.approx(2000 * 6e6 / 1e12)
    assert r["mfu_pct"] == pytest.approx(100 * 2000 * 6e6 / 1e11)
    assert r["mfu_pct_causal"] == pytest.approx(100 * 2000 * 5e6 / 1e11)
    assert r["loss"] == pytest.approx(2.5) and r["grad_norm"] == 1.5 and r["lr"] == 3e-4
    assert r["elapsed_s"] == pytest.approx(2.0)
    # batch waits of steps 3 and 4 (0.03 + 0.04 s): their mean, and their share of the 1.0 s
    assert r["data_loading_s"] == pytest.approx(0.035) and r["data_loading_pct"] == pytest.approx(7.0)
    assert by_step[6]["data_loading_s"] == 0.0  # the forced record covers only its own step
    assert r["mem_gib"] > 0.01  # this process's peak RSS
    assert by_step[1]["tokens_per_sec"] == pytest.approx(2000.0)  # one step in 0.5 s
    assert by_step[6]["val_loss"] == 2.5

    tb = read_tb(tmp_path)
    assert set(tb) == {k for k in records[0] if k != "step"} | {"val_loss"}
    assert [s for s, _ in tb["loss"]] == [1, 2, 4, 5, 6]
    assert tb["mfu_pct"][2][1] == pytest.approx(r["mfu_pct"], rel=1e-6)

    err = capsys.readouterr().err
    assert "step 4/5" in err and "loss 2.5000" in err and "MFU 12.00%" in err and "tok/s 2,000" in err
    assert "step 2/5  loss 5.0000" in err and "eta 0:00:02" in err  # 3 steps left at 0.5 s/step


def test_unknown_peak_reports_null_mfu(tmp_path, clock):
    logger = MetricsLogger(dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=2, is_rank0=True)
    logger.set_flops(flops_per_token={"palm": 1e6, "causal": 1e6}, peak_flops=None, peak_name="unknown GPU")
    run_steps(logger, clock, [1, 2])
    logger.close()
    records = read_jsonl(tmp_path)
    assert records[-1]["mfu_pct"] is None and records[-1]["tflops"] == pytest.approx(2000 * 1e6 / 1e12)
    assert "mfu_pct_causal" not in records[-1]
    assert not (tmp_path / "tb").exists()


def test_non_finite_loss_is_null_in_json(tmp_path, clock):
    logger = MetricsLogger(dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=1, is_rank0=True)
    run_steps(logger, clock, [1], loss=lambda s: math.nan)
    logger.close()
    assert read_jsonl(tmp_path)[0]["loss"] is None


def test_resume_appends_and_hides_stale_tensorboard_steps(tmp_path, clock):
    first = MetricsLogger(dump_folder=tmp_path, log_freq=1, enable_tensorboard=True, total_steps=4, is_rank0=True)
    run_steps(first, clock, range(1, 5), loss=lambda s: float(s))
    first.close()
    # The run crashed after a checkpoint at step 2; the resumed run redoes 3 and 4.
    resumed = MetricsLogger(
        dump_folder=tmp_path, log_freq=1, enable_tensorboard=True, total_steps=4, is_rank0=True, start_step=2
    )
    run_steps(resumed, clock, [3, 4], loss=lambda s: 100.0 + s)
    resumed.close()
    # One record per step: the resumed run's 3 and 4 (the earlier ones were duplicated before).
    assert [(r["step"], r["loss"]) for r in read_jsonl(tmp_path)] == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    assert read_tb(tmp_path)["loss"] == [(1, 1.0), (2, 2.0), (3, 103.0), (4, 104.0)]
    # The replaced records are kept aside, tagged with the step the run went back to.
    with open(tmp_path / "metrics.rolled_back.jsonl") as f:
        aside = [json.loads(line) for line in f]
    assert [(r["step"], r["loss"], r["rolled_back_at"]) for r in aside] == [(3, 3.0, 2), (4, 4.0, 2)]
    # Roll back further (load_step=1) with a line cut short by a kill: same rule.
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "lo')
    MetricsLogger(
        dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=4, is_rank0=True, start_step=1
    ).close()
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1]
    with open(tmp_path / "metrics.rolled_back.jsonl") as f:
        aside = [json.loads(line) for line in f]
    assert [r.get("step") for r in aside[2:]] == [2, 3, 4, None] and aside[-1]["unreadable"] == '{"step": 5, "lo'
    # A non-zero rank never touches the files.
    MetricsLogger(
        dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=4, is_rank0=False, start_step=0
    ).close()
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1]


def test_other_ranks_write_nothing(tmp_path, clock, capsys):
    logger = MetricsLogger(
        dump_folder=tmp_path / "out", log_freq=1, enable_tensorboard=True, total_steps=2, is_rank0=False
    )
    run_steps(logger, clock, [1, 2])
    logger.close()
    assert not (tmp_path / "out").exists()
    assert capsys.readouterr().err == ""


def test_rejects_non_scalar_values(tmp_path, clock):
    with MetricsLogger(
        dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=1, is_rank0=True
    ) as logger:
        with pytest.raises(TypeError, match="scalar"):
            logger.log(1, tokens=1, loss=torch.ones(3))


# ------------------------------------------------------------------------------ scripts/benchmark.py


def _load_benchmark():
    """scripts/benchmark.py's runner (tools/benchmark.py)."""
    from tools import benchmark

    return benchmark


def _fake_run(folder, tokens_per_sec, *, steps=6, compile_s=12.0, resumed_dup=False):
    folder.mkdir(parents=True)
    lines = []
    for step in range(1, steps + 1):
        record = {
            "step": step,
            "loss": 5.0 - step * 0.1,
            "tokens_per_sec": tokens_per_sec[step - 1],
            "tflops": tokens_per_sec[step - 1] * 1e-6,
            "mfu_pct": tokens_per_sec[step - 1] * 1e-3,
            "mem_gib": 1.0 + step / 10,
            "elapsed_s": step,
            "data_loading_pct": float(step),
        }
        if step == 1:
            record["compile_s"] = compile_s
        lines.append(json.dumps(record))
    if resumed_dup:  # a resumed run repeats step 4: the later record wins
        lines.append(json.dumps({"step": 4, "tokens_per_sec": 9999.0, "mem_gib": 1.0}))
    lines.append('{"step": 7, "loss"')  # killed mid-write
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "metrics.jsonl"


def test_benchmark_parses_and_aggregates(tmp_path):
    bench = _load_benchmark()
    # Warm-up steps 1-2 are slow (compile) and must not count.
    a = bench.summarize_run(bench.read_records(_fake_run(tmp_path / "a", [10, 20, 100, 110, 120, 130])), warmup=2)
    assert a["tokens_per_sec"] == 115 and a["steady_steps"] == 4
    assert a["mem_gib"] == pytest.approx(1.6) and a["compile_s"] == 12.0
    assert a["tflops"] == pytest.approx(115e-6) and a["mfu_pct_causal"] is None
    assert a["data_loading_pct"] == 4.5  # median of steps 3-6
    b_path = _fake_run(tmp_path / "b", [1, 1, 90, 90, 90, 90], resumed_dup=True)
    b = bench.summarize_run(bench.read_records(b_path), warmup=2)
    assert b["tokens_per_sec"] == 90  # median of 90, 9999, 90, 90
    c = bench.summarize_run(bench.read_records(_fake_run(tmp_path / "c", [1, 1, 200, 200, 200, 200])), warmup=2)
    runs = [
        {"variant": "eager", "nproc": 2, "repeat": 0, "rc": 0, "busy_before": 0.1, **a},
        {"variant": "eager", "nproc": 2, "repeat": 1, "rc": 0, "busy_before": 0.3, **b},
        {"variant": "eager", "nproc": 2, "repeat": 2, "rc": 0, "busy_before": 0.2, **c},
        {
            "variant": "compile",
            "nproc": 2,
            "repeat": 0,
            "rc": 1,
            "busy_before": 0.0,
            **bench.summarize_run([], warmup=2),
        },
    ]
    rows = {(r["variant"], r["nproc"]): r for r in bench.summarize(runs)}
    eager = rows[("eager", 2)]
    assert (eager["ok"], eager["runs"]) == (3, 3)
    assert eager["tokens_per_sec"] == 115 and eager["tokens_per_sec_total"] == 230
    assert (eager["tokens_per_sec_min"], eager["tokens_per_sec_max"]) == (90, 200)
    assert eager["busy_before"] == pytest.approx(0.2)
    failed = rows[("compile", 2)]
    assert failed["ok"] == 0 and failed["tokens_per_sec"] is None
    table = bench.format_table(list(rows.values()))
    assert "115" in table and "90..200" in table and "0/1" in table and "data %" in table
    assert "data %" not in bench.format_table([{**eager, "data_loading_pct": None}])  # records without the key

    out = tmp_path / "bench.csv"
    bench.write_csv(out, list(rows.values()))
    import csv

    with open(out) as f:
        parsed = list(csv.DictReader(f))
    assert parsed[0]["variant"] == "eager" and float(parsed[0]["tokens_per_sec"]) == 115


def test_benchmark_commands_and_variants():
    bench = _load_benchmark()
    custom = "bf16=--training.mixed_precision_param=bfloat16 --compile.mode=compile"
    variants = bench.parse_variants("eager,graph_scan", [custom])
    assert variants["graph_scan"] == ["--compile.mode=graph", "--compile.scan_layers=true"]
    assert variants["bf16"] == ["--training.mixed_precision_param=bfloat16", "--compile.mode=compile"]
    with pytest.raises(SystemExit):
        bench.parse_variants("warp", [])
    assert bench.split_nprocs("b25@2+4") == {2, 4} and bench.split_nprocs("bf16") is None
    for bad in ("b@", "b@x", "b@0"):
        with pytest.raises(SystemExit):
            bench.parse_variants("", [f"{bad}=--compile.mode=graph"])
    assert [n for n in (1, 2, 4) if bench.runs_at("b@2+4", n)] == [2, 4]
    assert [n for n in (1, 2, 4) if bench.runs_at("graph" + bench.SOLO, n)] == [2, 4]
    # A ceiling run's copies: per-process throughput averaged, memory the worst copy's.
    copies = [
        {
            "tokens_per_sec": 100.0,
            "tflops": 1.0,
            "mfu_pct": 10.0,
            "mfu_pct_causal": 9.0,
            "compile_s": 4.0,
            "mem_gib": 1.0,
            "steady_steps": 5,
        },
        {
            "tokens_per_sec": 80.0,
            "tflops": 0.8,
            "mfu_pct": 8.0,
            "mfu_pct_causal": 7.0,
            "compile_s": 6.0,
            "mem_gib": 1.5,
            "steady_steps": 4,
        },
    ]
    mean = bench._mean_of_copies(copies)
    assert mean["tokens_per_sec"] == 90.0 and mean["mem_gib"] == 1.5 and mean["steady_steps"] == 4
    one = bench.build_command(
        recipe="r.toml",
        overrides=["--compile.mode=eager"],
        nproc=1,
        dump_folder="/d",
        steps=9,
        extra=["--x.y=1"],
        python="py",
    )
    assert one[:3] == ["py", "-m", "trainer.train"] and one[-2:] == ["--compile.mode=eager", "--x.y=1"]
    assert "--training.steps=9" in one and "--job.dump_folder=/d" in one and "--checkpoint.enable=false" in one
    four = bench.build_command(recipe="r.toml", overrides=[], nproc=4, dump_folder="/d", steps=9, extra=[], python="py")
    assert four[:5] == ["py", "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4"]


def test_cpu_busy_fraction_from_two_readings(monkeypatch):
    """(idle, total) jiffies 100/1000 then 150/1100: 50 of 100 jiffies idle -> busy 0.5."""
    bench = _load_benchmark()
    readings = iter([(100, 1000), (150, 1100)])
    monkeypatch.setattr(bench, "_cpu_times", lambda: next(readings))
    assert bench.cpu_busy_fraction(0.0) == pytest.approx(0.5)
    monkeypatch.setattr(bench, "_cpu_times", lambda: None)  # no /proc/stat
    assert bench.cpu_busy_fraction(0.0) is None


def _full_after(monkeypatch, budget: int):
    """metrics.jsonl opened as a file that takes `budget` more bytes, then fails like a full disk."""
    from tests.support.full_disk import LimitedFile

    real_open = open

    def fake_open(path, mode="r", *args, **kwargs):
        if str(path).endswith("metrics.jsonl") and "a" in mode:
            return LimitedFile(path, mode, budget=budget)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(metrics, "open", fake_open, raising=False)


def test_a_full_disk_mid_record_leaves_only_whole_records(tmp_path, monkeypatch, clock):
    """The disk fills in the middle of a record: one WriteFailed line naming the file and the
    cause, and metrics.jsonl ends with the last whole record (the part written is truncated away)."""
    import errno
    import os

    from trainer.runtime.atomic import WriteFailed

    first = MetricsLogger(dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=3, is_rank0=True)
    clock.now += 1
    first.log(1, tokens=10, loss=2.0)
    first.close()
    before = (tmp_path / "metrics.jsonl").read_bytes()
    _full_after(monkeypatch, budget=len(before) // 2)  # room for half of the next record
    logger = MetricsLogger(
        dump_folder=tmp_path, log_freq=1, enable_tensorboard=False, total_steps=3, is_rank0=True, start_step=1
    )
    clock.now += 1
    with pytest.raises(WriteFailed) as e:
        logger.log(2, tokens=10, loss=1.5)
    logger.close()
    assert str(e.value) == f"writing metrics {tmp_path / 'metrics.jsonl'} failed: {os.strerror(errno.ENOSPC)}"
    assert (tmp_path / "metrics.jsonl").read_bytes() == before
    assert [r["step"] for r in read_jsonl(tmp_path)] == [1]


def test_a_real_full_file_system_leaves_only_whole_records(tmp_path, clock):
    """The same on a real full disk: a tiny tmpfs (root only; skipped elsewhere) filled to one page."""
    from tests.support.full_disk import fill, tiny_tmpfs
    from trainer.runtime.atomic import WriteFailed

    with tiny_tmpfs(tmp_path / "disk", kib=128) as disk:
        logger = MetricsLogger(dump_folder=disk, log_freq=1, enable_tensorboard=False, total_steps=9, is_rank0=True)
        clock.now += 1
        logger.log(1, tokens=10, loss=2.0)
        fill(disk, leave=4096)
        with pytest.raises(WriteFailed, match="No space left on device"):
            for step in range(2, 10):  # records of ~2 KiB: the second or third does not fit whole
                clock.now += 1
                logger.log(step, tokens=10, loss=1.0, **{f"extra_{i}": i + 0.5 for i in range(150)})
        logger.close()
        text = (disk / "metrics.jsonl").read_text()
        assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines())
