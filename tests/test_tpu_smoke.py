"""scripts/tpu_smoke.sh end to end on the fake TPU shim, and the report's pieces on their own.

The shim (`--shim`, tests/fake_tpu) trains the "TPU" runs on the CPU; everything else is the real
script: argument handling, the launch environment, per-run timeouts, failure capture, log tails,
the report and the tarball. One run of it (about a minute on 2 idle cores) carries an ok reference,
an ok save + resume pair, a run made to fail, one killed by a 3 s timeout and one skipped for
want of devices; the test checks the report against the runs' own metrics.jsonl.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tarfile

import pytest

from tools import tpu_smoke
from tools.tpu_smoke import cache_misses, compare, counter_misses, parse_launch_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


def _smoke(*args, env=None, timeout=600):
    return subprocess.run(["bash", "scripts/tpu_smoke.sh", *args], cwd=REPO, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def _row(report: str, name: str) -> list[str]:
    """The cells of `name`'s row in the report's runs table."""
    for line in report.splitlines():
        if line.startswith(f"| {name} |"):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    raise AssertionError(f"no row for {name} in the report")


HEADER = ["run", "what", "status", "steps", "final loss", "vs", "Δ loss (rel.)", "verdict", "setup s",
          "first step s", "graph compile s", "median step s", "tokens/s/device", "MFU %",
          "cache misses after step 3 (counter / log)"]


@pytest.mark.linux  # the timeout kill walks /proc for torchrun's workers
def test_shim_run_end_to_end(tmp_path):
    out = tmp_path / "smoke"
    r = _smoke("--shim", "4", "--out", str(out), "--runs", "cpu,compile,graph_scan,moe_ep2,save,resume",
               "--set", "compile:--training.dataset=/nonexistent/smoke.jsonl", "--run-timeout", "graph_scan=3",
               # eager saves and resumes in seconds; graph mode's capture takes a minute on 2 busy cores
               "--set", "save:--compile.mode=eager", "--set", "save:--compile.scan_layers=false",
               "--set", "resume:--compile.mode=eager", "--set", "resume:--compile.scan_layers=false")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tarball = out.with_name("smoke.tar.gz")
    assert f"tarball: {tarball}" in r.stderr and f"report: {out / 'report.md'}" in r.stderr

    meta = json.loads((out / "smoke.json").read_text())
    status = {name: run["status"] for name, run in meta["runs"].items()}
    assert status == {"cpu": "ok", "compile": "failed", "graph_scan": "timed out", "moe_ep2": "skipped",
                      "save": "ok", "resume": "ok"}, status
    # torchrun exits 1 whatever its worker's code (here the trainer's 2); a killed run has none
    assert meta["runs"]["compile"]["rc"] == 1 and meta["runs"]["graph_scan"]["rc"] is None

    report = (out / "report.md").read_text()
    assert "Fake TPU shim" in report
    lines = report.splitlines()
    assert [c.strip() for c in lines[lines.index(next(x for x in lines if x.startswith("| run |")))]
            .strip().strip("|").split("|")] == HEADER

    # Losses and numbers: the report's cells are the runs' metrics.jsonl, recomputed here.
    def metrics(name):
        with open(out / "runs" / name / "metrics.jsonl") as f:
            return {rec["step"]: rec for rec in map(json.loads, f)}

    cpu, save, resume = metrics("cpu"), metrics("save"), metrics("resume")
    assert sorted(cpu) == sorted(save) == [1, 2, 3, 4] and sorted(resume) == [3, 4]  # resumed at step 2
    row = dict(zip(HEADER, _row(report, "save")))
    assert row["final loss"] == f"{save[4]['loss']:.4f}" and row["vs"] == "cpu" and row["steps"] == "1-4"
    rel = (statistics.median(save[s]["loss"] for s in (1, 2, 3, 4))
           - statistics.median(cpu[s]["loss"] for s in (1, 2, 3, 4))) / statistics.median(
        cpu[s]["loss"] for s in (1, 2, 3, 4))
    assert row["Δ loss (rel.)"] == f"{rel:+.2%}"
    assert row["median step s"] == f"{statistics.median([save[s]['elapsed_s'] - save[s - 1]['elapsed_s'] for s in (3, 4)]):.3f}"
    assert row["tokens/s/device"] == f"{statistics.median([save[s]['tokens_per_sec'] for s in (3, 4)]):,.0f}"
    assert row["graph compile s"] == "-" and "compile_s" not in save[1]  # eager: nothing captured
    assert row["first step s"] == f"{save[1]['elapsed_s']:.1f}" and row["setup s"] == f"{save[1]['setup_s']:.1f}"
    assert row["cache misses after step 3 (counter / log)"] == "- / 0"  # no counter off a TPU
    # Save + resume: the same device, state restored exactly, so the losses agree (CPU: bit for bit).
    row = dict(zip(HEADER, _row(report, "resume")))
    assert row["vs"] == "save" and row["steps"] == "3-4" and row["verdict"] == "ok", row
    worst = max(abs(resume[s]["loss"] - save[s]["loss"]) / save[s]["loss"] for s in (3, 4))
    assert row["Δ loss (rel.)"] == f"{worst:+.2e}"
    assert "## Save and resume" in report and f"| 4 | {save[4]['loss']:.6f} | {resume[4]['loss']:.6f} |" in report

    # The failing run: its status, and its log's tail with the trainer's error line in the report.
    assert dict(zip(HEADER, _row(report, "compile")))["status"] == "failed (rc 1)"
    log = (out / "runs" / "compile.log").read_text()
    err = [x for x in log.splitlines() if x.startswith("error:")]
    assert err and "/nonexistent/smoke.jsonl" in err[0]
    section = report.split("### compile: failed")[1].split("###")[0]
    assert section.count(err[0]) == 2  # among the error lines and in the tail
    assert "ChildFailedError" in section  # torchrun's summary
    assert "### compile: failed" in report
    # The killed run: "timed out after 3 s", and the kill noted at the end of its log tail.
    assert dict(zip(HEADER, _row(report, "graph_scan")))["status"] == "timed out after 3 s"
    section = report.split("### graph_scan: timed out")[1].split("###")[0]
    assert "tools.tpu_smoke: timed out after 3 s: SIGTERM" in section
    # The skipped run says why.
    assert dict(zip(HEADER, _row(report, "moe_ep2")))["status"] == "skipped: needs 2 devices, this host has 1"

    # What the report records: flags per run (command line + launch env), versions, topology.
    assert "  python -m torch.distributed.run --standalone --nproc_per_node=1 -m trainer.train --config" in report
    assert "--device.type=cpu" in report and "--training.mixed_precision_param=bfloat16" in report
    assert "TORCH_TPU_TOPOLOGY=fake-1x1" in report and "WORLD_SIZE=1" in report
    assert "## pip freeze" in report and "torch==" in report
    assert "titan-tpu: compute dtype bfloat16" in report  # the runs' start-up lines

    # The tarball holds the report, logs, metrics and launch env, not the checkpoints.
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    for want in ("report.md", "smoke.json", "env.txt", "pip_freeze.txt", "launch_env.txt", "runs/save.log",
                 "runs/save/metrics.jsonl", "runs/resume/metrics.jsonl", "runs/compile.log",
                 "runs/graph_scan.log", "runs/save.launch_env.txt"):
        assert f"smoke/{want}" in names, want
    assert not [n for n in names if "checkpoints" in n]

    # `report` re-assembles from the folder: cache-miss lines after step 3 are counted.
    with open(out / "runs" / "save.log", "a") as f:
        f.write(f"I1203 tpu_compiler.cc] {tpu_smoke.CACHE_MISS_PATTERN} for program 7\n" * 2)
    r = subprocess.run([sys.executable, "-m", "tools.tpu_smoke", "report", str(out)], cwd=REPO, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    report = (out / "report.md").read_text()
    assert dict(zip(HEADER, _row(report, "save")))["cache misses after step 3 (counter / log)"] == "- / 2"


def test_shim_without_a_launch_environment_skips_the_tpu_runs(tmp_path):
    out = tmp_path / "smoke"
    r = _smoke("--shim", "--out", str(out), "--runs", "eager", env={"TITAN_SMOKE_SHIM_FAIL": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = (out / "report.md").read_text()
    status = dict(zip(HEADER, _row(report, "eager")))["status"]
    assert status.startswith("skipped: no launch environment") and "exited 1" in status
    assert "ValueError: set_tpu_launch_env()" in report  # the command's output is in the report


@pytest.mark.linux
def test_ctrl_c_stops_the_run_and_still_reports(tmp_path):
    """SIGINT to the smoke (a terminal's Ctrl-C): the current run's processes are stopped, the
    runs not reached are listed as such, and the report and tarball are written."""
    import signal
    import time

    out = tmp_path / "smoke"
    proc = subprocess.Popen([sys.executable, "-m", "tools.tpu_smoke", "run", "--shim", "--out", str(out), "--runs",
                             "cpu,eager"], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (out / "runs" / "cpu.log").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the trainer is starting
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "interrupted: writing the report of the runs so far" in err and "tarball: " in err
    report = (out / "report.md").read_text()
    assert dict(zip(HEADER, _row(report, "cpu")))["status"] == "failed: interrupted (Ctrl-C)"
    assert dict(zip(HEADER, _row(report, "eager")))["status"] == "not run: interrupted before it started"
    assert "tools.tpu_smoke: interrupted (Ctrl-C)" in (out / "runs" / "cpu.log").read_text()
    assert out.with_name("smoke.tar.gz").is_file()


@pytest.mark.parametrize("args, names", [
    (["run", "--shim", "3"], "steps: 3"),
    (["run", "--shim", "--runs", "eager,nope"], "run 'nope'"),
    (["run", "--shim", "--run-timeout", "eager=abc"], "--run-timeout 'eager=abc'"),
    (["run", "--shim", "--set", "eager:training.steps=3"], "--set 'eager:training.steps=3'"),
    (["run", "--shim", "--timeout", "0"], "--timeout"),
    (["report", "/nonexistent/smoke"], "/nonexistent/smoke: no smoke.json"),
])
def test_bad_arguments_are_one_error_line(args, names):
    r = subprocess.run([sys.executable, "-m", "tools.tpu_smoke", *args], cwd=REPO, env=ENV, capture_output=True,
                       text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and names in err[0], r.stderr


def test_existing_output_folder_is_refused(tmp_path):
    (tmp_path / "old.txt").write_text("a previous smoke")
    r = subprocess.run([sys.executable, "-m", "tools.tpu_smoke", "run", "--shim", "--out", str(tmp_path)], cwd=REPO,
                       env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"error: --out {tmp_path}: exists and is not empty")


def test_without_torch_tpu_the_run_is_refused(tmp_path):
    """Outside the shim the smoke needs Python 3.11 with torch-tpu; this venv has none."""
    r = subprocess.run([sys.executable, "-m", "tools.tpu_smoke", "run", "--out", str(tmp_path / "x")], cwd=REPO,
                       env={**ENV, "TITAN_SMOKE_SHIM": "0"}, capture_output=True, text=True, timeout=60)
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and ("torch-tpu is not installed" in err[0] or "cp311" in err[0])
    assert not (tmp_path / "x").exists()


def test_cache_misses_are_counted_after_the_step_3_line():
    log = "\n".join([
        "titan-tpu: llama3 debugmodel ...",
        "W tpu] Compilation cache STATIC MISS a",           # step 1's compile: not counted
        "step 1/20  loss 8.7963  grad_norm 10.042",
        "step  2/20  loss 8.5389",
        "W tpu] Compilation cache STATIC MISS b",           # before step 3's line: not counted
        "step  3/20  loss 8.2389",
        "W tpu] Compilation cache STATIC MISS c",
        "step  4/20  loss 8.0220",
        "[rank1] W tpu] Compilation cache STATIC MISS d",  # any rank's line counts
        "step 13/20  loss 7.1",
    ])
    assert cache_misses(log) == 2
    assert cache_misses(log, after_step=1) == 3
    assert cache_misses(log, pattern="no such text") == 0
    assert cache_misses("step  2/20  loss 8.5\nCompilation cache STATIC MISS") is None  # never reached step 3


def test_error_lines():
    log = ("step 1/4 loss 8.1\nerror: dataset /x: no such file\nTraceback (most recent call last):\n  File x\n"
           "[rank1]: RuntimeError: collective timed out\nValueError: bad\nValueError: bad\n"
           "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nan Error in prose\n")
    assert tpu_smoke.error_lines(log) == [
        "error: dataset /x: no such file", "[rank1]: RuntimeError: collective timed out", "ValueError: bad",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:"]


def test_cache_misses_by_the_trainers_counter():
    records = [{"step": s, "compile_cache_misses": c} for s, c in [(1, 40), (2, 41), (3, 41), (4, 41), (5, 43)]]
    assert counter_misses(records) == 2
    assert counter_misses(records[:3]) == 0
    assert counter_misses([{"step": s} for s in range(1, 6)]) is None  # off a TPU: no counter
    assert counter_misses(records[3:]) is None  # resumed after step 3


def test_start_up_lines_leave_out_the_per_step_miss_lines():
    from trainer.runtime.tpu_env import CACHE_MISS_LINE

    assert tpu_smoke.TRAINER_MISS_LINE == CACHE_MISS_LINE
    log = ("titan-tpu: llama3 debugmodel\nstep 1/4 loss 8\n" + f"{CACHE_MISS_LINE} 1: +3 (total 40)\n"
           + "titan-tpu: llama3 debugmodel\ntitan-tpu: kernel self-check: splash failed\n")
    assert tpu_smoke.banner_lines(log) == ["titan-tpu: llama3 debugmodel", "titan-tpu: kernel self-check: splash failed"]


def test_launch_env_is_parsed_as_torch_tpu_prints_it():
    # torch-tpu 0.2.0's _print_launch_env: quoted values, WORLD_SIZE bare, NNODES etc. on several hosts.
    text = ('TORCH_TPU_TOPOLOGY="2x2x1"\nTORCH_TPU_SLICEBUILDER_ADDRESSES="localhost:1,localhost:2"\n'
            'TORCH_TPU_XPROF_SESSION_ID=""\nWORLD_SIZE=4\nNODE_RANK="0"\nsome warning: x=1\n')
    assert parse_launch_env(text) == {"TORCH_TPU_TOPOLOGY": "2x2x1",
                                      "TORCH_TPU_SLICEBUILDER_ADDRESSES": "localhost:1,localhost:2",
                                      "TORCH_TPU_XPROF_SESSION_ID": "", "WORLD_SIZE": "4", "NODE_RANK": "0"}


def _losses(values, first=1):
    return {"losses": {first + i: v for i, v in enumerate(values)}}


def test_loss_verdicts():
    ref = _losses([8.8, 8.5, 8.2, 8.0, 7.9, 7.8, 7.7, 7.6, 7.5, 7.4])
    # Within 2 % on the median of the last 5 steps; one spike does not move the median.
    assert compare(_losses([8.7, 8.4, 8.1, 8.0, 7.9, 7.8, 7.7, 8.4, 7.5, 7.45]), ref, exact=False)[0] == "ok"
    verdict, rel = compare(_losses([8.8, 8.6, 8.4, 8.3, 8.2, 8.1, 8.0, 7.95, 7.9, 7.85]), ref, exact=False)
    assert verdict.startswith("DIFFERS") and rel == pytest.approx((7.95 - 7.6) / 7.6)
    assert compare(_losses([8.8] * 10), _losses([8.8] * 10), exact=False)[0] == "FAIL: loss did not fall"
    assert compare(_losses([8.8, None, 8.0]), ref, exact=False)[0] == "FAIL: non-finite loss"
    assert compare(_losses([7.0], first=50), ref, exact=False)[0].startswith("not compared")
    # The resume: per step, 1e-5 relative.
    assert compare(_losses([7.6, 7.5], first=8), ref, exact=True) == ("ok", 0.0)
    verdict, rel = compare(_losses([7.6, 7.5001], first=8), ref, exact=True)
    assert verdict.startswith("DIFFERS") and rel == pytest.approx(1e-4 / 7.5)


def test_plan_and_commands():
    """Every TPU run splits the CPU reference's global batch over the devices and records bf16;
    the shim swaps splash (TPU only) for SDPA and the device for the CPU."""
    runs = {r.name: r for r in tpu_smoke.plan(20)}
    assert set(runs) == {"cpu", "cpu_moe", "eager", "compile", "graph_scan", "ac_full", "fused_loss", "splash",
                         "moe_ep1", "moe_ep2", "save", "resume"}
    out = tpu_smoke.ROOT / "outputs" / "x"
    for shim in (False, True):
        for name, run in runs.items():
            cmd = tpu_smoke.command(run, steps=20, nproc=4, global_batch=8, out=out, shim=shim, extra=["--a.b=1"])
            assert "--training.mixed_precision_param=bfloat16" in cmd and cmd[-1] == "--a.b=1"
            want_device = "cpu" if run.device == "cpu" or shim else "tpu"
            assert f"--device.type={want_device}" in cmd
            assert f"--training.local_batch_size={8 if run.device == 'cpu' else 2}" in cmd
            assert ("--nproc_per_node=4" in cmd) == (run.device == "tpu")
            assert ("--model.attn_backend=splash" in cmd) == (name == "splash" and not shim), cmd
    assert "--checkpoint.interval=10" in runs["save"].args and runs["resume"].resume_of == "save"
