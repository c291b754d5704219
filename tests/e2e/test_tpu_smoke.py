"""scripts/tpu_smoke.sh end to end on the fake TPU shim, and the report's pieces on their own.

The shim (`--shim`, tests/support/fake_tpu) trains the "TPU" runs on the CPU; everything else is the real
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}


def _smoke(*args, env=None, timeout=600):
    return subprocess.run(
        ["bash", "scripts/tpu_smoke.sh", *args],
        cwd=REPO,
        env={**ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _row(report: str, name: str) -> list[str]:
    """The cells of `name`'s row in the report's runs table."""
    for line in report.splitlines():
        if line.startswith(f"| {name} |"):
            return [c.strip() for c in line.strip().strip("|").split("|")]
    raise AssertionError(f"no row for {name} in the report")


HEADER = [
    "run",
    "what",
    "status",
    "steps",
    "final loss",
    "vs",
    "Δ loss (rel.)",
    "verdict",
    "setup s",
    "first step s",
    "graph compile s",
    "median step s",
    "tokens/s/device",
    "MFU %",
    "cache misses after step 3 (counter / log)",
]


@pytest.mark.linux  # the timeout kill walks /proc for torchrun's workers
def test_shim_run_end_to_end(tmp_path):
    out = tmp_path / "smoke"
    r = _smoke(
        "--shim",
        "4",
        "--out",
        str(out),
        "--runs",
        "cpu,compile,graph_scan,moe_ep2,save,resume,reload_cpu,cp2,cache_cold,cache_warm",
        "--set",
        "compile:--training.dataset=/nonexistent/smoke.jsonl",
        "--run-timeout",
        "graph_scan=3",
        # eager saves and resumes in seconds; graph mode's capture takes a minute on 2 busy cores
        "--set",
        "save:--compile.mode=eager",
        "--set",
        "save:--compile.scan_layers=false",
        "--set",
        "resume:--compile.mode=eager",
        "--set",
        "resume:--compile.scan_layers=false",
        *[
            x
            for run in ("cache_cold", "cache_warm")
            for x in ("--set", f"{run}:--compile.mode=eager", "--set", f"{run}:--compile.scan_layers=false")
        ],
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tarball = out.with_name("smoke.tar.gz")
    assert f"tarball: {tarball}" in r.stderr and f"report: {out / 'report.md'}" in r.stderr

    meta = json.loads((out / "smoke.json").read_text())
    status = {name: run["status"] for name, run in meta["runs"].items()}
    assert status == {
        "cpu": "ok",
        "compile": "failed",
        "graph_scan": "timed out",
        "moe_ep2": "skipped",
        "save": "ok",
        "resume": "ok",
        "reload_cpu": "ok",
        "cp2": "skipped",
        "cache_cold": "ok",
        "cache_warm": "ok",
    }, status
    # torchrun exits 1 whatever its worker's code (here the trainer's 2); a killed run has none
    assert meta["runs"]["compile"]["rc"] == 1 and meta["runs"]["graph_scan"]["rc"] is None

    report = (out / "report.md").read_text()
    assert "Fake TPU shim" in report
    lines = report.splitlines()
    assert [
        c.strip()
        for c in lines[lines.index(next(x for x in lines if x.startswith("| run |")))].strip().strip("|").split("|")
    ] == HEADER

    # Losses and numbers: the report's cells are the runs' metrics.jsonl, recomputed here.
    def metrics(name):
        with open(out / "runs" / name / "metrics.jsonl") as f:
            return {rec["step"]: rec for rec in map(json.loads, f)}

    cpu, save, resume = metrics("cpu"), metrics("save"), metrics("resume")
    assert sorted(cpu) == sorted(save) == [1, 2, 3, 4] and sorted(resume) == [3, 4]  # resumed at step 2
    row = dict(zip(HEADER, _row(report, "save")))
    assert row["final loss"] == f"{save[4]['loss']:.4f}" and row["vs"] == "cpu" and row["steps"] == "1-4"
    rel = (
        statistics.median(save[s]["loss"] for s in (1, 2, 3, 4))
        - statistics.median(cpu[s]["loss"] for s in (1, 2, 3, 4))
    ) / statistics.median(cpu[s]["loss"] for s in (1, 2, 3, 4))
    assert row["Δ loss (rel.)"] == f"{rel:+.2%}"
    assert (
        row["median step s"]
        == f"{statistics.median([save[s]['elapsed_s'] - save[s - 1]['elapsed_s'] for s in (3, 4)]):.3f}"
    )
    assert row["tokens/s/device"] == f"{statistics.median([save[s]['tokens_per_sec'] for s in (3, 4)]):,.0f}"
    assert row["graph compile s"] == "-" and "compile_s" not in save[1]  # eager: nothing captured
    assert row["first step s"] == f"{save[1]['elapsed_s']:.1f}" and row["setup s"] == f"{save[1]['setup_s']:.1f}"
    assert row["cache misses after step 3 (counter / log)"] == "- / 0"  # no counter off a TPU
    # Save + resume: the same device, state restored exactly, so the losses agree (CPU: bit for bit).
    row = dict(zip(HEADER, _row(report, "resume")))
    assert row["vs"] == "save" and row["steps"] == "3-4" and row["verdict"] == "ok", row
    worst = max(abs(resume[s]["loss"] - save[s]["loss"]) / save[s]["loss"] for s in (3, 4))
    assert row["Δ loss (rel.)"] == f"{worst:+.2e}"
    # The save read back in one CPU process: from the same state, so within the CPU bound of `resume`.
    reload = metrics("reload_cpu")
    assert sorted(reload) == [3, 4] and dict(zip(HEADER, _row(report, "reload_cpu")))["verdict"] == "ok"
    assert max(abs(reload[s]["loss"] - resume[s]["loss"]) / resume[s]["loss"] for s in (3, 4)) < 1e-5
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
    assert dict(zip(HEADER, _row(report, "cp2")))["status"] == "skipped: needs 2 devices, this host has 1"
    # The compile-cache pair: 4 steps (the smoke's, under CACHE_STEPS), the relaunch compared step by step
    # with its first launch (same program, same seed), each with a host cache of its own in its flags,
    # the persistent one named by the recipe key; no counter off a TPU, so the verdict says so.
    row = dict(zip(HEADER, _row(report, "cache_warm")))
    assert row["steps"] == "1-4" and row["vs"] == "cache_cold" and row["verdict"] == "ok", row
    assert "**second launch: not measured (no compile_cache_misses through step 3" in report
    cold, warm = meta["runs"]["cache_cold"], meta["runs"]["cache_warm"]
    assert cold["tier2"] != warm["tier2"] and warm["env"]["TORCH_TPU_TIER2_COMPILATION_CACHE"] == warm["tier2"]
    assert f"--compile.cache_dir={out / 'compile_cache'}" in warm["cmd"]
    assert "titan-tpu: cache_dir not applied on cpu (TPU only)" in report

    # What the report records: flags per run (command line + launch env), versions, topology.
    assert "  python -m torch.distributed.run --standalone --nproc_per_node=1 -m trainer.train --config" in report
    assert "--device.type=cpu" in report and "--training.mixed_precision_param=bfloat16" in report
    assert "TORCH_TPU_TOPOLOGY=fake-1x1" in report and "WORLD_SIZE=1" in report
    assert "## pip freeze" in report and "torch==" in report
    assert "titan-tpu: compute dtype bfloat16" in report  # the runs' start-up lines

    # The tarball holds the report, logs, metrics and launch env, not the checkpoints.
    with tarfile.open(tarball) as tar:
        names = set(tar.getnames())
    for want in (
        "report.md",
        "smoke.json",
        "env.txt",
        "pip_freeze.txt",
        "launch_env.txt",
        "runs/save.log",
        "runs/save/metrics.jsonl",
        "runs/resume/metrics.jsonl",
        "runs/compile.log",
        "runs/graph_scan.log",
        "runs/save.launch_env.txt",
    ):
        assert f"smoke/{want}" in names, want
    assert not [n for n in names if "checkpoints" in n]

    # `report` re-assembles from the folder: cache-miss lines after step 3 are counted.
    with open(out / "runs" / "save.log", "a") as f:
        f.write(f"I1203 tpu_compiler.cc] {tpu_smoke.CACHE_MISS_PATTERN} for program 7\n" * 2)
    r = subprocess.run(
        [sys.executable, "-m", "tools.tpu_smoke", "report", str(out)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
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
    proc = subprocess.Popen(
        [sys.executable, "-m", "tools.tpu_smoke", "run", "--shim", "--out", str(out), "--runs", "cpu,eager"],
        cwd=REPO,
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while not (out / "runs" / "cpu.log").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the trainer is starting
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "interrupted: writing the report of the runs so far" in err and "tarball: " in err, err[-3000:]
    report = (out / "report.md").read_text()
    # The run the signal found is marked interrupted (the cpu run, unless a slow machine let it
    # finish first: then the eager run), and every run after it is listed as not run.
    statuses = {name: dict(zip(HEADER, _row(report, name)))["status"] for name in ("cpu", "eager")}
    hit = "cpu" if statuses["cpu"] != "ok" else "eager"
    assert statuses[hit] == "failed: interrupted (Ctrl-C)", statuses
    if hit == "cpu":
        assert statuses["eager"] == "not run: interrupted before it started", statuses
    assert "tools.tpu_smoke: interrupted (Ctrl-C)" in (out / "runs" / f"{hit}.log").read_text()
    assert out.with_name("smoke.tar.gz").is_file()


@pytest.mark.parametrize(
    "args, names",
    [
        (["run", "--shim", "3"], "steps: 3"),
        (["run", "--shim", "--runs", "eager,nope"], "run 'nope'"),
        (["run", "--shim", "--run-timeout", "eager=abc"], "--run-timeout 'eager=abc'"),
        (["run", "--shim", "--set", "eager:training.steps=3"], "--set 'eager:training.steps=3'"),
        (["run", "--shim", "--timeout", "0"], "--timeout"),
        (["report", "/nonexistent/smoke"], "/nonexistent/smoke: no smoke.json"),
    ],
)
def test_bad_arguments_are_one_error_line(args, names):
    r = subprocess.run(
        [sys.executable, "-m", "tools.tpu_smoke", *args], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=60
    )
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and err[0].startswith("error: ") and names in err[0], r.stderr


def test_existing_output_folder_is_refused(tmp_path):
    (tmp_path / "old.txt").write_text("a previous smoke")
    r = subprocess.run(
        [sys.executable, "-m", "tools.tpu_smoke", "run", "--shim", "--out", str(tmp_path)],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and r.stderr.startswith(f"error: --out {tmp_path}: exists and is not empty")


def test_without_torch_tpu_the_run_is_refused(tmp_path):
    """Outside the shim the smoke needs Python 3.11 with torch-tpu; this venv has none."""
    r = subprocess.run(
        [sys.executable, "-m", "tools.tpu_smoke", "run", "--out", str(tmp_path / "x")],
        cwd=REPO,
        env={**ENV, "TITAN_SMOKE_SHIM": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    err = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(err) == 1 and ("torch-tpu is not installed" in err[0] or "cp311" in err[0])
    assert not (tmp_path / "x").exists()


def test_cache_misses_are_counted_after_the_step_3_line():
    log = "\n".join(
        [
            "titan-tpu: llama3 debugmodel ...",
            "W tpu] Compilation cache STATIC MISS a",  # step 1's compile: not counted
            "step 1/20  loss 8.7963  grad_norm 10.042",
            "step  2/20  loss 8.5389",
            "W tpu] Compilation cache STATIC MISS b",  # before step 3's line: not counted
            "step  3/20  loss 8.2389",
            "W tpu] Compilation cache STATIC MISS c",
            "step  4/20  loss 8.0220",
            "[rank1] W tpu] Compilation cache STATIC MISS d",  # any rank's line counts
            "step 13/20  loss 7.1",
        ]
    )
    assert cache_misses(log) == 2
    assert cache_misses(log, after_step=1) == 3
    assert cache_misses(log, pattern="no such text") == 0
    assert cache_misses("step  2/20  loss 8.5\nCompilation cache STATIC MISS") is None  # never reached step 3


def test_error_lines():
    log = (
        "step 1/4 loss 8.1\nerror: dataset /x: no such file\nTraceback (most recent call last):\n  File x\n"
        "[rank1]: RuntimeError: collective timed out\nValueError: bad\nValueError: bad\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \nan Error in prose\n"
    )
    assert tpu_smoke.error_lines(log) == [
        "error: dataset /x: no such file",
        "[rank1]: RuntimeError: collective timed out",
        "ValueError: bad",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    ]


def test_cache_misses_by_the_trainers_counter():
    records = [{"step": s, "compile_cache_misses": c} for s, c in [(1, 40), (2, 41), (3, 41), (4, 41), (5, 43)]]
    assert counter_misses(records) == 2
    assert counter_misses(records[:3]) == 0
    assert counter_misses([{"step": s} for s in range(1, 6)]) is None  # off a TPU: no counter
    assert counter_misses(records[3:]) is None  # resumed after step 3


def test_start_up_lines_leave_out_the_per_step_miss_lines():
    from trainer.runtime.tpu_env import CACHE_MISS_LINE

    assert tpu_smoke.TRAINER_MISS_LINE == CACHE_MISS_LINE
    log = (
        "titan-tpu: llama3 debugmodel\nstep 1/4 loss 8\n"
        + f"{CACHE_MISS_LINE} 1: +3 (total 40)\n"
        + "titan-tpu: llama3 debugmodel\ntitan-tpu: kernel self-check: splash failed\n"
    )
    assert tpu_smoke.banner_lines(log) == [
        "titan-tpu: llama3 debugmodel",
        "titan-tpu: kernel self-check: splash failed",
    ]


def test_launch_env_is_parsed_as_torch_tpu_prints_it():
    # torch-tpu 0.2.0's _print_launch_env: quoted values, WORLD_SIZE bare, NNODES etc. on several hosts.
    text = (
        'TORCH_TPU_TOPOLOGY="2x2x1"\nTORCH_TPU_SLICEBUILDER_ADDRESSES="localhost:1,localhost:2"\n'
        'TORCH_TPU_XPROF_SESSION_ID=""\nWORLD_SIZE=4\nNODE_RANK="0"\nsome warning: x=1\n'
    )
    assert parse_launch_env(text) == {
        "TORCH_TPU_TOPOLOGY": "2x2x1",
        "TORCH_TPU_SLICEBUILDER_ADDRESSES": "localhost:1,localhost:2",
        "TORCH_TPU_XPROF_SESSION_ID": "",
        "WORLD_SIZE": "4",
        "NODE_RANK": "0",
    }


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
    assert set(runs) == {
        "cpu",
        "cpu_moe",
        "cpu_doc",
        "cpu_mla",
        "eager",
        "compile",
        "graph_scan",
        "ac_full",
        "fused_loss",
        "splash",
        "moe_ep1",
        "moe_ep2",
        "save",
        "resume",
        "reload_cpu",
        "cp2",
        "cp2_doc",
        "mla_ep2",
        "cache_cold",
        "cache_warm",
    }
    out = tpu_smoke.ROOT / "outputs" / "x"
    for shim in (False, True):
        for name, run in runs.items():
            cmd = tpu_smoke.command(run, steps=20, nproc=4, global_batch=8, out=out, shim=shim, extra=["--a.b=1"])
            assert "--training.mixed_precision_param=bfloat16" in cmd and cmd[-1] == "--a.b=1"
            want_device = "cpu" if run.device == "cpu" or shim else "tpu"
            assert f"--device.type={want_device}" in cmd
            # 8 sequences per step: over 4 data-parallel ranks, or 2 with cp 2 (cp ranks share theirs)
            local = 8 if run.device == "cpu" else 4 if name.startswith("cp2") else 2
            assert f"--training.local_batch_size={local}" in cmd
            assert ("--nproc_per_node=4" in cmd) == (run.device == "tpu")
            splash = name in ("splash", "cp2", "cp2_doc", "mla_ep2")
            assert ("--model.attn_backend=splash" in cmd) == (splash and not shim), cmd
            assert ("--parallelism.context_parallel_degree=2" in cmd) == name.startswith("cp2"), cmd
            cache = f"--compile.cache_dir={out / 'compile_cache'}"
            assert (cache in cmd) == name.startswith("cache_"), cmd
            assert f"--training.steps={6 if name.startswith('cache_') else 20}" in cmd
            # the shim's 2 layers: DeepSeek V3 keeps 1 dense block and 1 MoE block
            assert ("--model.n_dense_layers=1" in cmd) == (shim and run.recipe == tpu_smoke.MLA), cmd
    assert "--checkpoint.interval=10" in runs["save"].args and runs["resume"].resume_of == "save"
    # the TPU's checkpoint read back in one CPU process, compared with the TPU's own resume
    assert (runs["reload_cpu"].device, runs["reload_cpu"].resume_of, runs["reload_cpu"].ref) == (
        "cpu",
        "save",
        "resume",
    )
    assert runs["cache_warm"].relaunch_of == "cache_cold" and runs["cache_warm"].ref == "cache_cold"
    assert runs["cp2_doc"].ref == "cpu_doc" and runs["mla_ep2"].ref == "cpu_mla"


@pytest.mark.parametrize("nproc", [2, 4, 8])
def test_every_run_passes_the_rules_at_its_world_size(nproc):
    """Each run's command line, parsed as the trainer parses it, passes `plan_job` (every rule the
    trainer checks before it builds anything; on a TPU: the rules a TPU run sees, CP's 128-token
    chunks included) at the device count of a one-host slice (v6e-8 / tpu7x-8: 8 devices, v5p-8 /
    v6e-4: 4), and splits the CPU reference's 8 sequences over its data-parallel ranks."""
    from trainer import plan_job
    from trainer.config import build_config, split_cli
    from trainer.job import batch_split

    global_batch = -(-tpu_smoke.GLOBAL_BATCH // nproc) * nproc
    checked = []
    for run in tpu_smoke.plan(20):
        if run.device == "tpu" and (nproc < run.min_devices or nproc % run.cp):
            continue
        cmd = tpu_smoke.command(
            run,
            steps=20,
            nproc=nproc,
            global_batch=global_batch,
            out=tpu_smoke.ROOT / "outputs" / "x",
            shim=False,
            extra=[],
        )
        recipe, _, overrides = split_cli(cmd[cmd.index("trainer.train") + 1 :])
        cfg = build_config(os.path.join(REPO, recipe), overrides)
        world, device_type = (1, "cpu") if run.device == "cpu" else (nproc, "tpu")
        plan = plan_job(cfg, world_size=world, device_type=device_type)
        dims = plan.parallel_dims
        assert dims.cp == run.cp and dims.dp_replicate * dims.dp_shard * dims.cp * dims.tp == world, (run.name, dims)
        t = cfg.training
        local, accum = batch_split(
            global_batch_size=t.global_batch_size,
            local_batch_size=t.local_batch_size,
            gradient_accumulation_steps=t.gradient_accumulation_steps,
            dp_degree=dims.dp_degree,
        )
        assert local * accum * dims.dp_degree == (tpu_smoke.GLOBAL_BATCH if run.device == "cpu" else global_batch)
        checked.append(run.name)
    assert {"cp2", "cp2_doc", "mla_ep2", "cache_cold", "cache_warm"} <= set(checked), checked
    assert {"cpu_doc", "cpu_mla"} <= set(checked)
    mla = build_config(os.path.join(REPO, tpu_smoke.MLA))
    assert mla.model.name == "deepseek_v3"  # the MLA family


def test_cp_runs_are_skipped_where_the_devices_do_not_split(tmp_path):
    """A cp 2 run on 3 devices is skipped with the reason; so is a relaunch whose first launch did not run."""
    import argparse

    meta = {"global_batch": 9, "runs": {}}
    args = argparse.Namespace(run_timeout={}, timeout=10, shim=True, steps=5, set={})
    runs = {r.name: r for r in tpu_smoke.plan(5)}
    for name in ("cp2", "cache_warm"):
        meta["runs"][name] = {"status": "not run"}
        tpu_smoke._one(runs[name], meta, args=args, out=tmp_path, base_env={}, launch_rc=0, nproc=3)
    assert meta["runs"]["cp2"]["reason"] == "context parallel 2 needs a device count divisible by 2, this host has 3"
    assert meta["runs"]["cache_warm"]["reason"] == "relaunches cache_cold, which did not run"


def _records(counts, compiled=None):
    return [
        {"step": s, "compile_cache_misses": c, **({"compilations": compiled} if compiled is not None else {})}
        for s, c in enumerate(counts, start=1)
    ]


def test_relaunch_verdict_from_metrics():
    first = _records([40, 42, 42, 42, 43, 43])  # 42 programs through step 3, 1 more after
    assert tpu_smoke.misses_through(first) == 42 and counter_misses(first) == 1
    assert tpu_smoke.relaunch_verdict(first, _records([0] * 6)) == (
        "second launch: 0 misses after step 3, 0 at restart (first launch: 1 after step 3, 42 at start): "
        "compiled nothing, the cache served every program"
    )
    assert tpu_smoke.relaunch_verdict(first, _records([5, 6, 6, 6, 6, 6])) == (
        "second launch: 0 misses after step 3, 6 at restart (first launch: 1 after step 3, 42 at start): "
        "the cache served 36 of the first launch's 42 programs, the rest compiled again"
    )
    assert tpu_smoke.relaunch_verdict(first, first).startswith(
        "second launch: 1 misses after step 3, 42 at restart (first launch: 1 after step 3, 42 at start): "
        "missed as much as a cold start"
    )
    # Off a TPU (no counter) or stopped before step 3: said so, nothing made up.
    assert tpu_smoke.relaunch_verdict(first, [{"step": s} for s in range(1, 7)]).startswith(
        "second launch: not measured"
    )
    assert tpu_smoke.relaunch_verdict(first, _records([3, 3])).startswith("second launch: not measured")
    # Without the first launch's numbers the line still stands.
    assert tpu_smoke.relaunch_verdict([], _records([0] * 6)) == (
        "second launch: 0 misses after step 3, 0 at restart: compiled nothing, the cache served every program"
    )


def test_report_has_the_relaunch_section(tmp_path):
    """report.md from synthetic metrics files: the verdict line and both launches' numbers."""
    out = tmp_path / "smoke"
    for name, counts, compiled in (("cache_cold", [40, 42, 42, 42, 43, 43], 43), ("cache_warm", [2] * 6, 0)):
        folder = out / "runs" / name
        folder.mkdir(parents=True)
        recs = [{**r, "loss": 9.0 - r["step"] / 10, "elapsed_s": 10.0 * r["step"]} for r in _records(counts, compiled)]
        recs[0].update(setup_s=3.0, compile_s=55.5 if name == "cache_cold" else 1.2)
        (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
        (out / "runs" / f"{name}.log").write_text("step 1/6 loss 8.9\n")
    run = {
        "device": "tpu",
        "exact": True,
        "recipe": tpu_smoke.LLAMA,
        "steps": 6,
        "status": "ok",
        "rc": 0,
        "timeout_s": 1800,
    }
    meta = {
        "shim": False,
        "started": "-",
        "git": "x",
        "steps": 20,
        "global_batch": 8,
        "devices": 8,
        "timeout_s": 1800,
        "launch_rc": 0,
        "runs": {
            "cache_cold": {
                **run,
                "what": "first",
                "ref": None,
                "relaunch_of": None,
                "tier2": "t-cold",
                "tier3_after": {"files": 12, "bytes": 5_000_000},
                "tier2_after": {"files": 12, "bytes": 1},
            },
            "cache_warm": {
                **run,
                "what": "second",
                "ref": "cache_cold",
                "relaunch_of": "cache_cold",
                "tier2": "t-warm",
                "tier3_after": {"files": 12, "bytes": 5_000_000},
                "tier2_after": None,
            },
        },
    }
    (out / "smoke.json").write_text(json.dumps(meta))
    (out / "env.txt").write_text("python 3.11\n")
    report = tpu_smoke.render_report(out)
    assert (
        "**second launch: 0 misses after step 3, 2 at restart (first launch: 1 after step 3, 42 at start): "
        "the cache served 40 of the first launch's 42 programs, the rest compiled again**"
    ) in report
    assert "| first | cache_cold | ok | 42 | 1 | 43 | 10.0 | 55.5 | 12, 5.0 | 12 |" in report
    assert "| second | cache_warm | ok | 2 | 0 | 0 | 10.0 | 1.2 | 12, 5.0 | none |" in report
    # 6 steps is complete for these runs (not the smoke's 20), and the relaunch matches its first launch.
    assert dict(zip(HEADER, _row(report, "cache_warm")))["verdict"] == "ok"
