"""scripts/bench/maxtext_side_by_side.py: the pure parts of ours beside MaxText (no compile here): the
pairs against MaxText's runs (the same tokens per device), the ratio and calibrated-MFU arithmetic,
the shipped recipes' calibration and the table writers."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

from tools.maxtext_runs import write_csv

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "maxtext_side_by_side", ROOT / "scripts" / "bench" / "maxtext_side_by_side.py"
)
sbs = importlib.util.module_from_spec(_spec)
sys.modules["maxtext_side_by_side"] = sbs  # its dataclass resolves annotations through the module
_spec.loader.exec_module(sbs)


def test_every_pair_matches_maxtexts_tokens_per_device_and_routing():
    """Each pair's overrides put our recipe at the MaxText run's tokens per device (micro-batch x
    accumulation x seq len; or a `per_token` share of them) and, for the MoE runs, at the published
    random routing."""
    from trainer.config import build_config

    mts = sbs.read_maxtext(sbs.DEFAULT_MAXTEXT_CSV)
    assert list(sbs.PAIRS) == list(mts)  # one pair per calibrated run, the same order
    for run, pair in sbs.PAIRS.items():
        cfg = build_config(str(ROOT / "configs" / f"{pair.recipe}.toml"), list(pair.overrides))
        t = cfg.training
        tokens = t.local_batch_size * t.gradient_accumulation_steps * t.seq_len
        assert tokens * pair.per_token == mts[run]["tokens_per_device"], run
        moe = run.startswith(("qwen3", "deepseek"))
        assert (cfg.moe.routing == "random") == moe, run
        assert pair.unmatched, run


MT = {
    "tokens_per_device": 32768.0,
    "step_s": 4.437,
    "mfu_pct": 41.41,
    "published_mfu_same_flops_pct": 40.41,
    "published_step_s": 4.5467,
}


def test_ratio_and_calibrated_mfu():
    pair = sbs.PAIRS["llama3.1-8b_v6e-256"]
    # ours 20 % slower than MaxText's predicted step at the same tokens: ratio 1 / 1.2
    ours = {"step_scheduled_s": 4.437 * 1.2, "tokens": 32768, "mfu_causal_scheduled": 34.5}
    r = sbs.side_row("llama3.1-8b_v6e-256", pair, MT, ours)
    assert r["ratio"] == pytest.approx(1 / 1.2, abs=1e-3)
    assert r["calibrated_mfu_pct"] == pytest.approx(40.41 / 1.2, abs=0.01)
    assert r["calibrated_step_s"] == pytest.approx(4.5467 * 1.2, abs=1e-3)
    # per token: ours at half the tokens and half the step is as fast as MaxText
    ours = {"step_scheduled_s": 4.437 / 2, "tokens": 16384, "mfu_causal_scheduled": 41.0}
    r = sbs.side_row("llama3.1-8b_v6e-256", pair, MT, ours)
    assert r["ratio"] == pytest.approx(1.0, abs=1e-3)
    assert r["calibrated_mfu_pct"] == pytest.approx(40.41, abs=0.01)
    assert r["calibrated_step_s"] == pytest.approx(4.5467 / 2, abs=1e-3)
    # a failed compile: the row says why, no ratio
    r = sbs.side_row("llama3.1-8b_v6e-256", pair, MT, {"error": "failed: boom"})
    assert r["error"] == "failed: boom" and "ratio" not in r


def test_shipped_row_is_calibrated_by_maxtexts_error():
    ours = {"step_scheduled_s": 1.5, "tokens": 8192, "mfu_causal_scheduled": 30.0}
    r = sbs.shipped_row("llama3_8b_v6e", "llama3.1-8b_v6e-256", MT, ours)
    assert r["calibration_factor"] == pytest.approx(40.41 / 41.41, abs=1e-4)
    assert r["calibrated_mfu_pct"] == pytest.approx(30.0 * 40.41 / 41.41, abs=0.01)


def test_tables(tmp_path):
    pair = sbs.PAIRS["llama3.1-8b_v6e-256"]
    rows = [
        sbs.side_row(
            "llama3.1-8b_v6e-256",
            pair,
            MT,
            {"step_scheduled_s": 4.0, "tokens": 32768, "mfu_causal_scheduled": 45.9, "compiler_gib": 20.1},
        ),
        sbs.side_row("llama3.1-70b_v6e-256", sbs.PAIRS["llama3.1-70b_v6e-256"], {}, {"error": "not compiled"}),
        sbs.side_row(
            "llama3.1-405b_v7x-512",
            sbs.PAIRS["llama3.1-405b_v7x-512"],
            MT,
            {"step_scheduled_s": 5.0, "tokens": 32768, "mfu_causal_scheduled": 30.0, "verdict": "does not fit"},
        ),
        sbs.shipped_row(
            "llama3_8b_v6e",
            "llama3.1-8b_v6e-256",
            MT,
            {"step_scheduled_s": 1.0, "tokens": 8192, "mfu_causal_scheduled": 40.0},
        ),
    ]
    write_csv(rows, tmp_path / "t.csv", sbs.COLUMNS)
    back = list(csv.DictReader((tmp_path / "t.csv").open()))
    assert [r["run"] for r in back] == [
        "llama3.1-8b_v6e-256",
        "llama3.1-70b_v6e-256",
        "llama3.1-405b_v7x-512",
        "llama3_8b_v6e (shipped)",
    ]
    assert float(back[0]["ratio"]) == pytest.approx(4.437 / 4.0, abs=1e-3)
    md = sbs.markdown(rows, ["head"])
    lines = md.splitlines()
    row8 = next(line for line in lines if line.startswith("| llama3.1-8b_v6e-256"))
    assert "**1.109**" in row8 and "**44.8**" in row8  # ratio and 40.41 x 1.109
    assert any(line.startswith("| llama3.1-70b_v6e-256") and "not compiled" in line for line in lines)
    assert any(line.startswith("| llama3.1-405b_v7x-512") and "does not fit (HBM OOM)" in line for line in lines)
    assert any(line.startswith("| llama3_8b_v6e |") and "**39.0**" in line for line in lines)  # 40 x 0.9759
    assert "Not matched" in md
    # --out names the files without an extension; a run's dot is not one (llama3.1-70b -> llama3.csv)
    from tools.maxtext_runs import write_tables

    out = write_tables(
        rows, name="x", out=tmp_path / "llama3.1-70b", columns=sbs.COLUMNS, header=lambda c: [c], markdown=sbs.markdown
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["llama3.1-70b.csv", "llama3.1-70b.md", "t.csv"]
    assert out == tmp_path / "llama3.1-70b"


def test_splash_mxu_factor_charges_our_splash_as_maxtexts():
    """Our splash kernels are charged their MXU FLOPs as the calibration charges MaxText's (the
    matmuls contracting a head dim below 256 fill d / 256 of the array), and the backward as the run
    executes it (no forward re-run: register.py's backward takes the forward's residuals)."""
    from tools.mfu_projection import splash_mxu_factor

    # head dim 128: forward q k^T at half fill (2 x its FLOPs), p v full: (256 + 128) / 256
    assert splash_mxu_factor("splash_fwd", (128, 128), 256) == pytest.approx(1.5)
    # backward: the capture counts 7 passes (the forward re-run, then five); the run's kernel takes
    # the forward's residuals and runs the five: q k^T again and dO v^T at half fill, 3 full: 7 / 7
    assert splash_mxu_factor("splash_bwd", (128, 128), 256) == pytest.approx(1.0)
    assert splash_mxu_factor("splash_bwd", (256, 256), 256) == pytest.approx(5 / 7)
    # MLA 192 / 128: q k^T at 192 / 256
    assert splash_mxu_factor("splash_fwd", (192, 128), 256) == pytest.approx((256 + 128) / 320)
    assert splash_mxu_factor("splash_fwd", (256, 256), 256) == 1.0  # full tiles: no change
    assert splash_mxu_factor("ce_fwd", (128, 128), 256) == 1.0 and splash_mxu_factor("splash_fwd", None, 256) == 1.0


NESTED_SCAN_BODY = r"""
HloModule nested

%retile (r0: bf16[64,256,512]) -> bf16[64,256,512] {
  %r0 = bf16[64,256,512]{2,1,0:T(16,128)(2,1)} parameter(0)
  ROOT %c = bf16[64,256,512]{2,1,0:T(8,128)(2,1)} copy(%r0)
}

%inner (i0: bf16[64,256,512], i1: s32[]) -> bf16[256,512] {
  %i0 = bf16[64,256,512]{2,1,0:T(16,128)(2,1)} parameter(0)
  %i1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %t = bf16[64,256,512]{2,1,0:T(8,128)(2,1)} fusion(%i0), kind=kLoop, calls=%retile
  %ds = bf16[1,256,512]{2,1,0} dynamic-slice(%t, %i1, %zero, %zero), dynamic_slice_sizes={1,256,512}
  ROOT %layer = bf16[256,512]{1,0} bitcast(%ds)
}

%outer (p0: bf16[64,256,512], p1: s32[], p2: bf16[512,256]) -> bf16[256,256] {
  %p0 = bf16[64,256,512]{2,1,0:T(16,128)(2,1)} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = bf16[512,256]{1,0} parameter(2)
  %x = bf16[256,512]{1,0} fusion(%p0, %p1), kind=kLoop, calls=%inner
  ROOT %d = bf16[256,256]{1,0} dot(%x, %p2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (saved: bf16[64,256,512], i: s32[], w: bf16[512,256]) -> bf16[256,256] {
  %saved = bf16[64,256,512]{2,1,0:T(16,128)(2,1)} parameter(0)
  %i = s32[] parameter(1)
  %w = bf16[512,256]{1,0} parameter(2)
  ROOT %fusion.1 = bf16[256,256]{1,0} fusion(%saved, %i, %w), kind=kOutput, calls=%outer
}
"""


def test_a_nested_fusion_slicing_one_layer_of_the_stack_is_charged_the_layer():
    """The trainer's layer-scan backward matmul fusions take the stacked [L, ...] residuals through
    an inner fusion (a tiling change) to a dynamic-slice of one layer: the fusion reads one layer,
    not the stack (charged whole before: 64x the bytes, the 405B's matmuls bytes-bound by 7 s)."""
    from tools import xla_projection as xp

    layer = 256 * 512 * 2
    op = {o.name: o for o in xp.compute_ops(xp.parse_hlo(NESTED_SCAN_BODY))}["fusion.1"]
    assert op.bytes == layer + 4 + 512 * 256 * 2 + 256 * 256 * 2  # one layer, the index, w, the result
    assert op.flops == 2 * 256 * 512 * 256


def test_the_mfu_suite_headline_reads_the_side_by_side(tmp_path, monkeypatch):
    """tools/mfu_report.py leads the suite's projections with the calibrated ratio per run (issue 51
    item 5): the side-by-side CSV's matched rows, not its shipped ones."""
    from tools.mfu_report import SIDE_BY_SIDE, calibrated_headline, projection_sections

    rows = [
        sbs.side_row(
            "llama3.1-8b_v6e-256",
            sbs.PAIRS["llama3.1-8b_v6e-256"],
            MT,
            {"step_scheduled_s": 4.437 / 0.9, "tokens": 32768, "mfu_causal_scheduled": 37.0},
        ),
        sbs.side_row("llama3.1-70b_v6e-256", sbs.PAIRS["llama3.1-70b_v6e-256"], MT, {"error": "not compiled"}),
        sbs.shipped_row(
            "llama3_8b_v6e",
            "llama3.1-8b_v6e-256",
            MT,
            {"step_scheduled_s": 1.0, "tokens": 8192, "mfu_causal_scheduled": 40.0},
        ),
    ]
    write_csv(rows, tmp_path / "s.csv", sbs.COLUMNS)
    md = calibrated_headline(tmp_path / "s.csv")
    body = [line for line in md if line.startswith("| llama")]
    assert len(body) == 2  # the shipped row is not a headline row
    assert "**0.900**" in body[0] and "**36.4**" in body[0]  # 40.41 x 0.9
    assert "not compiled" in body[1]
    assert calibrated_headline(tmp_path / "none.csv") == []
    import tools.mfu_report as mr

    monkeypatch.setattr(mr, "program_table", lambda programs, anchors: ["| program |"])
    out = projection_sections([], [{"recipe": "x"}], [], skipped="", anchors={}, headline=tmp_path / "s.csv")
    assert out[: len(md)] == md and "| program |" in out  # the headline first, the bounds after
    assert projection_sections([], [], [], skipped="no venv", anchors={}, headline=tmp_path / "s.csv") == [
        "Skipped: no venv."
    ]
    assert SIDE_BY_SIDE.is_file()  # the committed table the suite reads
