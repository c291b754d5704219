"""scripts/bench/maxtext_compile.py and its run table (tools/maxtext_runs.py): the pure parts of the MaxText calibration (no compile here; the
compile needs the `maxtext` venv and minutes): the runs against the published anchors, the mesh
declaration read from an HLO text, the memory sum, the kernel charge, the table row and markdown."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from tools.mfu_report import load_anchors
from tools.xla_hlo import Op

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("maxtext_compile", ROOT / "scripts" / "bench" / "maxtext_compile.py")
mc = importlib.util.module_from_spec(_spec)
sys.modules["maxtext_compile"] = mc  # its dataclass resolves annotations through the module
_spec.loader.exec_module(mc)


def test_every_run_has_its_published_anchor_and_settings():
    from tools.maxtext_runs import RUNS

    assert mc.RUNS is RUNS and mc.Run is type(RUNS["llama3.1-8b_v6e-256"])  # the script's names are the module's
    anchors = {a["id"]: a for a in load_anchors()["anchor"]}
    assert list(RUNS)[:2] == ["llama3.1-8b_v6e-256", "llama3.1-70b_v6e-256"]  # the cheapest first
    for name, run in RUNS.items():
        a = anchors[run.anchor]
        assert a["framework"] == "MaxText" and a["hardware"] == run.target.split("-")[0], name
        keys = dict(arg.split("=", 1) for arg in run.args)
        assert "model_name" in keys and "per_device_batch_size" in keys and keys["remat_policy"] == "custom", name
        assert run.topology in ("v6e-256", "tpu7x-512") and run.xla_flags.startswith("--"), name
        # the published global batch: per-device batch x devices (a v7x chip is two devices)
        devices = a["chips"] * (2 if a["hardware"] == "v7x" else 1)
        if "global_batch" in a:
            assert float(keys["per_device_batch_size"]) * devices == a["global_batch"], name
    for name in ("qwen3-235b-a22b_v7x-512", "deepseek3-671b_v7x-512"):
        # published with random routing, which MaxText 0.2.5 refuses without EP: named as a deviation
        assert "use_random_routing=False" in mc.RUNS[name].args and "random routing" in mc.RUNS[name].deviation
    # libtpu 0.0.46 refuses v6e's continuation fusion: the deviation is named, the flag absent
    for name in ("llama3.1-8b_v6e-256", "llama3.1-70b_v6e-256"):
        assert mc.RUNS[name].deviation and "async_collective_fusion=true" not in mc.RUNS[name].xla_flags


def test_hlo_mesh_reads_the_one_declaration():
    text = (
        "%ag = bf16[8]{0} all-gather(%p), replica_groups=mesh['axis_0'=256] {'axis_0'}, dimensions={0}\n"
        "%ar = f32[8]{0} all-reduce(%q), replica_groups=mesh['axis_0'=256] {'axis_0'}\n"
    )
    assert mc.hlo_mesh(text) == [256]
    two = "replica_groups=mesh['axis_1'=2,'axis_0'=256] {'axis_0'}"
    assert mc.hlo_mesh(two) == [256, 2]  # ordered by the axis number
    other = "replica_groups=mesh['axis_0'=128,'axis_1'=4] {'axis_1'}"
    assert mc.hlo_mesh(text + other) == [256]  # the declaration most collectives name
    assert mc.hlo_mesh("no collectives") is None


def test_pick_hlo_prefers_the_train_step(tmp_path):
    assert mc.pick_hlo(tmp_path) is None
    (tmp_path / "module_0001.jit_other.after_optimizations.txt").write_text("x" * 100)
    (tmp_path / "module_0000.jit_train_step.cl_1.after_optimizations.txt").write_text("x" * 10)
    (tmp_path / "module_0000.jit_train_step.cl_1.after_optimizations-buffer-assignment.txt").write_text("x" * 999)
    assert mc.pick_hlo(tmp_path).name == "module_0000.jit_train_step.cl_1.after_optimizations.txt"


def test_memory_and_published_step():
    mem = {
        "argument_size_in_bytes": 3 * 2**30,
        "output_size_in_bytes": 3 * 2**30,
        "temp_size_in_bytes": 10 * 2**30,
        "alias_size_in_bytes": 3 * 2**30,
    }
    assert mc.compiler_gib(mem) == 13.0
    # v7x anchors are per chip: a device makes half; 405B: 3 x 8192 tokens per device and step
    anchor = {"tokens_per_sec": 500.0, "per": "chip", "hardware": "v7x", "mfu_pct": 54.7}
    p = mc.published(anchor, 3 * 8192)
    assert p["published_tokens_per_s_per_device"] == 250.0 and p["published_step_s"] == pytest.approx(98.304)
    v6e = mc.published({"tokens_per_sec": 7207.0, "hardware": "v6e", "mfu_pct": 45.46}, 4 * 8192)
    assert v6e["published_step_s"] == pytest.approx(4.5466, abs=1e-3)  # the recipe README's 4.546 s


def test_kernel_charge_attention_by_the_model():
    peak, hbm = 1e15, 1e12
    ops = [
        Op("dot", "fusion", 2e12, 1e9, 10.0),  # 2 ms each (FLOPs bound), 10 times
        Op("gmm", "kernel", 1e12, 4e9, 2.0, kind="kernel", io=1e9),  # 4 ms each (bytes bound)
        Op("splash_mha_fwd.1", "kernel", 0.0, 1e8, 4.0, kind="kernel-unestimated", io=1e8),
        # a splash call with an estimate (the DeepSeek recipe sets one): the model's charge all the same
        Op("splash_mha_dkv.2", "kernel", 5e12, 0.0, 2.0, kind="kernel", io=1e8),
    ]
    c = mc.kernel_compute(ops, attention_flops=6e12, peak=peak, hbm=hbm)
    assert c["xla_s"] == pytest.approx(0.02)
    # gmm by its estimate (8 ms; 2 ms at its FLOPs); splash at MaxText's attention FLOPs x 7/6 (7 ms),
    # above the calls' bytes (0.6 ms)
    assert c["gmm_s"] == pytest.approx(0.008) and c["gmm_flops_s"] == pytest.approx(0.002)
    assert c["attention_kernel_s"] == pytest.approx(0.007) and c["kernel_s"] == pytest.approx(0.015)
    assert c["compute_s"] == pytest.approx(0.035) and c["unestimated"] == 4


def test_row_and_markdown():
    """The published MFU is set beside the prediction at the compiled MaxText's FLOPs: 1,900 TFLOPs per
    device and step over 918 TFLOP/s x the published 4.5466 s is 45.5 %; the error is against that."""
    run = mc.RUNS["llama3.1-8b_v6e-256"]
    anchor = {"tokens_per_sec": 7207.0, "hardware": "v6e", "mfu_pct": 45.46, "source": "tpu-recipes"}
    worker = {
        "compile_s": 300.0,
        "memory": {"argument_size_in_bytes": 2**30, "temp_size_in_bytes": 2**31},
        "mesh_axes": ["data", "fsdp", "tensor"],
        "mesh_shape": [1, 256, 1],
        "tokens_per_device": 32768.0,
        "maxtext_tflops_per_device_step": 1900.0,
    }
    bound = {
        "compute_s": 4.0,
        "xla_s": 3.5,
        "kernel_s": 0.5,
        "comm_s": 1.0,
        "comm_by_axis": "a0(256) 1 s",
        "step_exposed_s": 5.0,
        "step_overlapped_s": 4.0,
        "mfu_causal_exposed": 41.4,
        "mfu_causal_overlapped": 51.7,
    }
    row = mc.calibration_row("llama3.1-8b_v6e-256", run, worker, bound, anchor, peak_tflops=918.0)
    assert row["compiler_gib"] == 3.0 and row["mesh"] == "fsdp=256"
    same = 100 * 1900.0 / (918.0 * 32768 / 7207.0)
    assert row["published_mfu_same_flops_pct"] == pytest.approx(same, abs=0.01)
    assert row["error_exposed_pts"] == pytest.approx(41.4 - same, abs=0.01)
    assert row["step_ratio_exposed"] == pytest.approx(5.0 / (32768 / 7207.0), abs=1e-3)
    # a compile stopped at the HLO: memory from the buffer assignment (b), wall time to the dump (h)
    stopped = dict(worker, compile_s=None, memory={}, hlo_s=42.0, memory_report_bytes=24 * 2**30)
    row_h = mc.calibration_row("llama3.1-8b_v6e-256", run, stopped, bound, anchor, peak_tflops=918.0)
    failed = mc.calibration_row("deepseek3-671b_v7x-512", mc.RUNS["deepseek3-671b_v7x-512"], {}, None, anchor, "OOM")
    md = mc.markdown([row, row_h, failed], ["header"])
    assert md.startswith("header\n")
    assert f"| llama3.1-8b_v6e-256 | v6e-256 | yes | 3.0 | 300 | 45.5 / {same:.1f} | 41.4 / 51.7 |" in md
    assert "| llama3.1-8b_v6e-256 | v6e-256 | yes | 24.0 b | 42 h |" in md
    assert "| deepseek3-671b_v7x-512 | v7x-512 | no: OOM |" in md
    assert set(row) <= set(mc.COLUMNS) and set(row_h) <= set(mc.COLUMNS)


def test_memory_usage_report_total():
    report = "Memory Space: default (color=0)\nTotal bytes: 12033783072 (11.21GiB)\n  cumulative_size; ...\n"
    assert mc.memory_report_bytes(report + "Memory Space: host (color=5)\nTotal bytes: 1\n") == 12033783072
    assert mc.memory_report_bytes("nothing") is None


TUPLE_REF_LOOP = """HloModule m

%cond (p: (s32[], bf16[4,8]{1,0})) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[4,8]{1,0}) parameter(0)
  %limit = s32[]{:T(128)} constant(32)
  ROOT %lt = pred[]{:T(512)} compare(%p#0, %limit), direction=LT
}

%body (q: (s32[], bf16[4,8]{1,0})) -> (s32[], bf16[4,8]{1,0}) {
  %q = (s32[]{:T(128)}, bf16[4,8]{1,0}) parameter(0)
  %one = s32[]{:T(128)} constant(1)
  %next = s32[]{:T(128)} add(%q#0, %one)
  %y = bf16[4,8]{1,0} dot(%q#1, %q#1), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  ROOT %t = (s32[]{:T(128)}, bf16[4,8]{1,0}) tuple(%next, %y)
}

ENTRY %m (x: bf16[4,8]) -> bf16[4,8] {
  %x = bf16[4,8]{1,0} parameter(0)
  %zero = s32[]{:T(128)} constant(0)
  %init = (s32[]{:T(128)}, bf16[4,8]{1,0}) tuple(%zero, %x)
  %loop = (s32[]{:T(128)}, /*index=1*/bf16[4,8]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = bf16[4,8]{1,0} copy(%loop#1)
}
"""


def test_tuple_element_shorthand_in_the_hlo():
    """MaxText's program (libtpu 0.0.46) writes a tuple element as `%t#k`, not a get-tuple-element:
    the layer scan's trip count is read through it (it was counted once) and an operand's shape is the
    element's, not the whole tuple's."""
    from tools import xla_hlo

    hlo = xla_hlo.parse_hlo(TUPLE_REF_LOOP)
    entry = hlo.computations["m"]
    assert xla_hlo.trip_count(entry.by_name["loop"], hlo, entry) == 32
    assert dict((c.name, t) for c, t in xla_hlo.executed(hlo))["body"] == 32
    assert xla_hlo._operand_shape(entry, "loop#1") == "bf16[4,8]{1,0}"
    dots = [o for o in xla_hlo.compute_ops(hlo) if o.opcode == "dot"]
    # 2 x the [4, 8] result x K = 8, K read off the lhs `%q#1` (the element, not the tuple)
    assert len(dots) == 1 and dots[0].times == 32 and dots[0].flops == 2 * 4 * 8 * 8


def test_window_taps_closed_form_matches_the_count():
    """tools/xla_hlo.window_taps with lhs dilation counts in closed form what a loop over the window
    counted (MaxText's MoE program has convolutions with windows of thousands)."""
    import itertools

    from tools.xla_hlo import window_taps

    def brute(n, window, out, stride, pad_lo, lhs_dilate, rhs_dilate):
        last = (n - 1) * lhs_dilate
        return sum(
            1
            for o in range(out)
            for k in range(window)
            if 0 <= o * stride - pad_lo + k * rhs_dilate <= last
            and (o * stride - pad_lo + k * rhs_dilate) % lhs_dilate == 0
        )

    for n, window, out, stride, pad_lo, ld, rd in itertools.product(
        (1, 3, 7), (1, 4, 9), (1, 5), (1, 2, 3), (0, 2, 7), (2, 3, 4), (1, 2, 6)
    ):
        args = dict(n=n, window=window, out=out, stride=stride, pad_lo=pad_lo, lhs_dilate=ld, rhs_dilate=rd)
        assert window_taps(**args) == brute(n, window, out, stride, pad_lo, ld, rd), args


def test_attention_kernel_time_pads_the_head_dim_on_the_mxu():
    """Splash's 7 matmul passes against MaxText's 6 (3 x forward): with head dims of 256 they fill the
    256-wide MXU, 7/6 of the FLOPs; with 128 the three passes contracting a head dim (Q K^T twice,
    dO V^T) run at half rate: 10/6; DeepSeek-V3's 192 / 128 in between."""
    assert mc.attention_kernel_seconds(6.0, (256, 256), peak=1.0) == pytest.approx(7.0)
    assert mc.attention_kernel_seconds(6.0, (128, 128), peak=1.0) == pytest.approx(10.0)
    # a = 6/3 x 192/320 = 1.2 (Q K^T), b = 0.8 (P V): 2 x 1.2 / 0.75 + 0.8 + 0.8 / 0.5 + 0.8 + 2 x 1.2
    assert mc.attention_kernel_seconds(6.0, (192, 128), peak=1.0) == pytest.approx(8.8)
    assert mc.RUNS["deepseek3-671b_v7x-512"].head_dims == (192, 128)


def test_the_prediction_table_leads_with_one_number_and_its_error():
    run = mc.RUNS["llama3.1-8b_v6e-256"]
    anchor = {"tokens_per_sec": 7207.0, "hardware": "v6e", "mfu_pct": 45.46}
    worker = {
        "compile_s": None,
        "hlo_s": 25.0,
        "memory": {},
        "memory_report_bytes": 11 * 2**30,
        "mesh_axes": ["fsdp"],
        "mesh_shape": [256],
        "tokens_per_device": 32768.0,
        "maxtext_tflops_per_device_step": 1686.58,
    }
    bound = {
        "compute_s": 2.5,
        "xla_s": 2.3,
        "kernel_s": 0.2,
        "comm_s": 0.16,
        "comm_by_axis": "a0(256) 0.16 s",
        "step_exposed_s": 2.71,
        "step_overlapped_s": 2.56,
        "mfu_causal_exposed": 67.7,
        "mfu_causal_overlapped": 71.8,
        "step_s": 4.44,
        "mfu_pct": 100 * 1686.58 / (918.0 * 4.44),
        "sched_compute_s": 3.8,
        "exposed_comm_s": 0.08,
        "exposed_host_s": 0.51,
        "host_s": 1.91,
        "ici_busy_s": 0.16,
        "exposed_by": "host:d2h 0.51 s, ici:a0 0.08 s",
        "unmatched_done": 0,
    }
    row = mc.calibration_row("llama3.1-8b_v6e-256", run, worker, bound, anchor, peak_tflops=918.0)
    published_step = 32768 / 7207.0
    # MFU error relative to the published MFU at these FLOPs = published step / predicted step - 1
    assert row["error_pct"] == pytest.approx(100 * (published_step / 4.44 - 1), abs=0.06)
    assert row["step_ratio"] == pytest.approx(4.44 / published_step, abs=1e-3)
    md = mc.markdown([row], ["header"])
    assert "| llama3.1-8b_v6e-256 | 40.4 | 41.4 | +2.4 | 4.55 | 4.44 | 3.80 | 0.08 | 0.51 (1.91) | 67.7 / 71.8 |" in md
    assert set(row) <= set(mc.COLUMNS)


FAKE_WORKER = """import json, os, re, sys, time
out, args = sys.argv[2], dict(a.split("=", 1) for a in sys.argv[3:])
dump = re.search(r"--xla_dump_to=(\\S+)", os.environ["XLA_FLAGS"]).group(1)
if args["fake"] == "fail":
    print("loading MaxText"); print("boom: the compile failed"); sys.exit(3)
facts = {"mesh_axes": ["fsdp"], "mesh_shape": [4], "compile_started": time.time() - 30.0}
json.dump(facts, open(out + ".pre.json", "w"))
os.makedirs(dump, exist_ok=True)
stem = os.path.join(dump, "module_0007.jit_train_step.cl_1.after_optimizations")
open(stem + ".txt", "w").write("HloModule jit_train_step")
open(stem + "-memory-usage-report.txt", "w").write("Memory Space: default (color=0)\\nTotal bytes: 1234\\n")
os.makedirs(args["base_output_directory"], exist_ok=True)
if args["fake"] == "hang":
    time.sleep(600)  # the codegen a caller stopping at the HLO does not wait for
json.dump({**facts, "compile_s": 40.0, "memory": {"temp_size_in_bytes": 2**30}}, open(out, "w"))
"""


def test_compile_run_drives_the_worker_to_its_result(tmp_path, monkeypatch):
    """compile_run's phases against a stand-in for the maxtext venv's interpreter (it reads the
    result path, MaxText's arguments and the dump folder from XLA_FLAGS, as maxtext_worker.py is
    given them): a finished compile keeps its memory analysis and gains the buffer assignment's
    total and the seconds to the HLO; one stopped at the HLO (`until="hlo"`) is killed once the
    dump is written and records the buffer assignment instead; a failed worker's last log lines
    and a timeout are raised; a kept result.json is reused without a worker; the dump and MaxText's
    output folder are removed, the optimized HLO kept."""
    import subprocess
    import time as real_time
    from types import SimpleNamespace

    python = tmp_path / "python"
    python.write_text(f"#!{sys.executable}\n{FAKE_WORKER}")
    python.chmod(0o755)
    # the polls (every 5 s, a 2 s settle for the HLO's size) at test speed
    monkeypatch.setattr(mc, "time", SimpleNamespace(time=real_time.time, sleep=lambda s: real_time.sleep(0.05)))

    def run(name: str, mode: str, until: str = "full", timeout: float = 60.0) -> dict:
        fake = mc.Run(anchor="x", topology="v6e-256", target="v6e-256", args=[f"fake={mode}"], xla_flags="", source="")
        return mc.compile_run(name, fake, python=python, folder=tmp_path / name, timeout=timeout, until=until)

    done = run("full", "finish")
    assert done["compile_s"] == 40.0 and done["memory"] == {"temp_size_in_bytes": 2**30}
    assert done["memory_report_bytes"] == 1234.0 and 29.0 < done["hlo_s"] < 60.0
    assert Path(done["hlo"]).read_text() == "HloModule jit_train_step"
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == [
        "result.json",
        "result.json.pre.json",
        "train_step.after_optimizations.txt",
        "worker.log",
    ]

    start = real_time.time()
    stopped = run("stopped", "hang", until="hlo")
    assert real_time.time() - start < 30.0  # killed at the dump, not after the worker's 600 s
    assert stopped["stopped_at"] == "hlo" and stopped["compile_s"] is None and stopped["memory"] == {}
    assert stopped["memory_report_bytes"] == 1234.0 and 29.0 < stopped["hlo_s"] < 60.0 and stopped["hlo"]

    with pytest.raises(RuntimeError, match="worker exited 3 after .* boom: the compile failed"):
        run("failed", "fail")
    with pytest.raises(subprocess.TimeoutExpired):
        run("slow", "hang", timeout=0.5)
    assert run("full", "fail") == done  # kept: no worker started
