"""scripts/mfu_suite.py: the roofline and layer arithmetic, the anchors file, the errors, and one
sweep end to end with the trainer runs replaced by fake metrics (no timing is tested). The command
is the script (`script.main`); what the sweep calls is patched where it lives, tools/mfu_suite.py."""

from __future__ import annotations

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from tools import mfu_projection, mfu_report
from tools import mfu_suite as suite

ROOT = Path(__file__).resolve().parents[2]


def _load():
    spec = importlib.util.spec_from_file_location("mfu_suite", ROOT / "scripts" / "mfu_suite.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = _load()
FPT = {"palm": 6e9, "causal": 5e9}


def test_roofline_compute_and_memory_bound():
    # 1e15 FLOPs at 1e15 FLOP/s = 1 s; 1e12 bytes at 2e12 B/s = 0.5 s: compute bound
    r = mfu_projection.roofline(
        flops=1e15, bytes_accessed=1e12, peak_flops=1e15, hbm_bytes_per_s=2e12, tokens=1e5, flops_per_token=FPT
    )
    assert r["bound"] == "compute" and r["step_s"] == pytest.approx(1.0)
    assert r["tokens_per_sec"] == pytest.approx(1e5)
    assert r["mfu_pct"] == pytest.approx(100 * 1e5 * 6e9 / 1e15)  # 60 %: model FLOPs < executed FLOPs
    assert r["mfu_pct_causal"] == pytest.approx(50.0)
    # 4e12 bytes at 2e12 B/s = 2 s > 1 s: memory bound, half the throughput
    r = mfu_projection.roofline(
        flops=1e15, bytes_accessed=4e12, peak_flops=1e15, hbm_bytes_per_s=2e12, tokens=1e5, flops_per_token=FPT
    )
    assert r["bound"] == "memory" and r["step_s"] == pytest.approx(2.0) and r["mfu_pct"] == pytest.approx(30.0)


def test_layer_extrapolation_is_exact_for_affine_counts():
    base, per_layer = 7.0e12, 3.0e12
    at = lambda n: base + n * per_layer  # noqa: E731
    assert mfu_projection.extrapolate_layers(at(1), at(2), 126) == pytest.approx(at(126))


def test_anchor_file_is_complete_and_cited():
    anchors = mfu_report.load_anchors()
    recipes = {p.stem for p in (ROOT / "configs").glob("*.toml")}
    assert len(anchors["anchor"]) >= 10
    ids = [a["id"] for a in anchors["anchor"]]
    assert len(ids) == len(set(ids))
    for a in anchors["anchor"]:
        for key in ("framework", "source", "model", "hardware", "per", "tokens_per_sec", "mfu_pct", "convention"):
            assert a.get(key) not in (None, ""), (a["id"], key)
        assert a["convention"] in ("palm", "causal", "6n") and a["per"] in ("chip", "device")
        assert 0 < a["mfu_pct"] < 100 and a.get("chips") or a.get("slice"), a["id"]
        assert a.get("recipe") is None or a["recipe"] in recipes, a["id"]
        if a["convention"] == "palm":  # already in our convention
            assert a.get("mfu_pct_palm", a["mfu_pct"]) == a["mfu_pct"], a["id"]
        if a.get("mfu_pct_palm") and a["convention"] != "palm":  # adding attention FLOPs back raises MFU
            assert a["mfu_pct_palm"] > a["mfu_pct"], a["id"]
        # published TFLOP/s / tok/s agree with the published MFU on the chip's peak (per chip on v7x: 2307)
        if a.get("tflops") and a["hardware"] in ("v6e", "v7x"):
            chip_peak = {"v6e": 918.0, "v7x": 2307.0}[a["hardware"]]
            assert 100 * a["tflops"] / chip_peak == pytest.approx(a["mfu_pct"], abs=0.6), a["id"]
    assert set(anchors["hbm_gbps_per_device"]) >= {"v6e", "v7x"}
    v7x = next(a for a in anchors["anchor"] if a["id"] == "maxtext-v7x-llama3.1-405b")
    assert mfu_report.anchor_per_device(v7x) == pytest.approx(499.77 / 2)  # two devices per v7x chip


def _fake_execute(jobs, **_):
    """What benchmark.execute returns, with fixed numbers: 1 process 1000 tok/s, 2 processes 900 each."""
    runs = []
    for job in jobs:
        folder = Path(job["folder"])
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "stdout.log").write_text("titan-tpu: compute dtype float32 (auto: ...)\n")
        tps = 1000.0 if job["nproc"] == 1 else 900.0
        runs.append(
            {
                **{k: v for k, v in job.items() if k not in ("cmd", "folder")},
                "rc": 0,
                "wall_s": 1.0,
                "busy_before": 0.1,
                "tokens_per_sec": tps,
                "tflops": tps * 6e9 / 1e12,
                "mfu_pct": tps * 6e9 / 1e11 * 100,
                "mfu_pct_causal": tps * 5e9 / 1e11 * 100,
                "peak_tflops": 0.1,
                "peak_tflops_best": 0.4,
                "mem_gib": 1.0,
                "compile_s": None,
                "steady_steps": 4,
                "last_loss": 8.0,
            }
        )
    return runs


def test_sweep_writes_csv_markdown_and_plots(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.setattr(suite.bench, "execute", _fake_execute)

    def fake_costs(recipe, target, n_layers, extra, timeout):  # affine in layers, compute bound on v6e
        return {"flops": 1e13 + n_layers * 2e13, "bytes": 1e9 * n_layers, "tokens": 8192.0}

    monkeypatch.setattr(suite, "compile_costs", fake_costs)
    monkeypatch.setattr(suite, "xla_venv", lambda: (tmp_path, ""))
    monkeypatch.setattr(suite, "host_available_bytes", lambda: 1e15)
    out = tmp_path / "suite"
    rc = script.main(
        [
            "--recipes",
            "llama3_debug",
            "--modes",
            "eager,graph_scan",
            "--nproc",
            "1,2",
            "--repeats",
            "2",
            "--project",
            "llama3_8b_v6e",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    rows = list(csv.DictReader(open(out.with_suffix(".csv"))))
    measured = [r for r in rows if r["mode"] != "projection"]
    assert len(measured) == 4 and all(r["ok"] == "2" for r in measured)
    two = next(r for r in measured if r["mode"] == "eager" and r["nproc"] == "2")
    assert float(two["tokens_per_sec_total"]) == pytest.approx(1800.0)
    assert float(two["mfu_pct_best"]) == pytest.approx(float(two["mfu_pct"]) / 4)  # float32 peak is 1/4 of best
    assert two["dtype"] == "float32"
    assert len(list(csv.DictReader(open(tmp_path / "suite_runs.csv")))) == 8
    proj = next(r for r in rows if r["mode"] == "projection")
    # llama3 8B: 32 layers -> 1e13 + 32 x 2e13 FLOPs per step at 918e12 FLOP/s (above the model's
    # own 8192 x ~5e10 = ~4e14, so the compiler's count is used)
    assert proj["recipe"] == "llama3_8b_v6e" and proj["bound"] == "compute" and proj["flops_source"] == "compiler"
    assert float(proj["step_s"]) == pytest.approx(65e13 / 918e12)
    # a compiler count below the model's FLOPs (loop bodies counted once) is replaced by them
    low, _ = suite.project(
        ["llama3_8b_v6e"],
        anchors=mfu_report.load_anchors(),
        timeout=1,
        costs=lambda r, t, n, e, s: {"flops": 1e12 * n, "bytes": 1.0, "tokens": 8192.0},
    )
    floor = float(proj["model_flops_per_step"])
    assert low[0]["flops_source"].startswith("model floor (compiler ") and low[0]["model_flops_per_step"] == floor
    assert low[0]["step_s"] == pytest.approx(floor / 918e12)
    assert low[0]["mfu_pct_causal"] == pytest.approx(100.0)
    md = out.with_suffix(".md").read_text()
    assert "llama3_8b_v6e (projection)" in md and "MFU % (palm)" in md and "MFU % (causal)" in md
    assert "Llama 3.1 8B | MaxText | v6e" in md and "45.46 (causal)" in md
    for png in ("suite_vs_devices.png", "suite_vs_mode.png"):
        assert (tmp_path / png).stat().st_size > 10_000
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


def test_projections_skip_without_the_xla_venv_or_the_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("TITAN_XLA_VENV_ROOT", str(tmp_path))
    rows, why = suite.project(["llama3_8b_v6e"], anchors=mfu_report.load_anchors(), timeout=1)
    assert rows == [] and ".venv-ttpu" in why and "xla_env.sh ttpu" in why
    # a recipe whose capture does not fit in the free host memory is skipped, named, not compiled
    # (Llama 3 8B at 2 layers: 1 GiB + 1 byte x 1.49e9 parameters = 2.4 GiB > 60 % of 2 GiB)
    monkeypatch.setattr(suite, "host_available_bytes", lambda: 2 * 2**30)

    def never(*_):
        raise AssertionError("compiled")

    rows, why = suite.project(["llama3_8b_v6e"], anchors=mfu_report.load_anchors(), timeout=1, costs=never)
    assert why == "" and rows[0]["error"].startswith("skipped: the 2-layer capture needs ~2 GiB")


def test_context_and_expert_parallel_recipes_project_the_trainer_program(monkeypatch):
    """The 128k recipes (cp > 1) take the trainer's own program at their target, as the EP recipes
    do, once (no routing variants: no experts); a dense recipe keeps the small-slice approximation."""
    calls = []

    def row(name, overrides, **_):
        calls.append((name, list(overrides)))
        return {"recipe": name, "kind": mfu_projection.PROGRAM_KIND}

    monkeypatch.setattr(suite, "program_row", row)
    monkeypatch.setattr(suite, "host_available_bytes", lambda: None)  # never skipped for host memory
    fsdp = []

    def costs(recipe, *_):
        fsdp.append(Path(recipe).stem)
        raise RuntimeError("not compiled in this test")

    names = ["llama3_8b_128k_v6e", "qwen3_32b_128k_v7x", "qwen3_30b_a3b_v6e", "llama3_8b_v6e"]
    assert [suite.trainer_program(mfu_projection.recipe_path(n)) for n in names] == ["cp", "cp", "ep", None]
    rows, why = suite.project(
        names,
        anchors=mfu_report.load_anchors(),
        timeout=1,
        compile=lambda *_: None,
        costs=costs,
        routings=("learned", "random"),
        overrides=[("training.steps", "2")],
    )
    assert why == ""
    assert calls == [
        ("llama3_8b_128k_v6e", [("training.steps", "2")]),
        ("qwen3_32b_128k_v7x", [("training.steps", "2")]),
        ("qwen3_30b_a3b_v6e", [("training.steps", "2")]),
        ("qwen3_30b_a3b_v6e", [*mfu_projection.ROUTINGS["random"], ("training.steps", "2")]),
    ]
    assert fsdp == ["llama3_8b_v6e"] and rows[-1]["error"].startswith("failed: not compiled")
    # the bound's tokens per device: a CP group of 4 shares each 128k sequence (fsdp 64 x cp 4)
    assert mfu_projection.program_facts(mfu_projection.recipe_path("llama3_8b_128k_v6e"), [])["tokens"] == 131072 // 4
    # and a TP group shares its dp rank's sequences: 2 x 8192 over tp 2 (the 405B's --recommend layout)
    tp2 = [("parallelism.tensor_parallel_degree", "2"), ("training.local_batch_size", "2")]
    assert mfu_projection.program_facts(mfu_projection.recipe_path("llama3_405b_v7x"), tp2)["tokens"] == 8192


def test_bad_input_is_one_error_line(capsys, monkeypatch):
    assert script.main(["--recipes", "nope_debug", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: --recipes: no recipe 'nope_debug'")
    assert script.main(["--modes", "warp", "--dry-run"]) == 2
    assert capsys.readouterr().err.startswith("error: --modes: unknown mode 'warp'")
    # matplotlib absent: a clear line, before any run (a dry run needs no plots)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert script.main(["--project", "none"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "matplotlib is not installed" in err and "pip install '.[bench]'" in err


def test_dry_run_interleaves_repeats(capsys):
    assert (
        script.main(
            [
                "--recipes",
                "llama3_debug,qwen3_debug",
                "--modes",
                "eager",
                "--nproc",
                "1,2",
                "--repeats",
                "2",
                "--dry-run",
                "--",
                "--training.seq_len=64",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 8
    order = [
        ("llama3" if "llama3_debug" in ln else "qwen3", "nproc_per_node=2" in ln, ln.split("-r")[-1][:1])
        for ln in lines
    ]
    assert [o[2] for o in order] == ["0"] * 4 + ["1"] * 4  # repeat 0 of every group, then repeat 1
    assert all(ln.endswith("--training.seq_len=64") for ln in lines)


def test_resume_reads_finished_runs(tmp_path, monkeypatch):
    """--resume: a run folder with a record of the last step is read back, not run again."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "s"
    folder = tmp_path / "s_runs" / "llama3_debug-eager-n1-r0"
    folder.mkdir(parents=True)
    (folder / "metrics.jsonl").write_text(
        "".join(
            json.dumps(
                {"step": s, "tokens_per_sec": 100.0 * s, "mfu_pct": 1.0, "peak_tflops": 0.1, "peak_tflops_best": 0.1}
            )
            + "\n"
            for s in range(1, 7)
        )
    )
    ran = []

    def execute(jobs, **kw):
        ran.extend(j["folder"].name for j in jobs)
        return _fake_execute(jobs, **kw)

    monkeypatch.setattr(suite.bench, "execute", execute)
    assert (
        script.main(
            [
                "--recipes",
                "llama3_debug",
                "--modes",
                "eager",
                "--nproc",
                "1,2",
                "--repeats",
                "1",
                "--project",
                "none",
                "--resume",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert ran == ["llama3_debug-eager-n2-r0"]
    rows = {r["nproc"]: r for r in csv.DictReader(open(out.with_suffix(".csv")))}
    assert float(rows["1"]["tokens_per_sec"]) == pytest.approx(450.0)  # median of steps 3..6 (warmup 2)
