"""MaxText's own train step compiled deviceless and bounded by our projector (scheduled tier:
tests/support/tiers.py; docs/maxtext_calibration.md). The smallest published run, Llama 3.1 8B on
v6e-256, through scripts/bench/maxtext_compile.py in the `maxtext` venv (scripts/xla_env.sh maxtext),
stopped at the optimized HLO (minutes): the program is read whole (the layer scan's 32 trips, no loop
without a trip count), fits a v6e chip, and the bound sits above MaxText's published MFU (the
calibration's finding: an upper bound, 1.3-1.7x optimistic in step time for the dense runs)."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_maxtext_8b_program_is_bounded_above_its_published_mfu(tmp_path):
    from tests.xla.conftest import ROOT, xla_python

    xla_python("maxtext")  # made here if absent (the package registry, minutes)
    out = tmp_path / "table"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench" / "maxtext_compile.py"),
            "--runs",
            "llama3.1-8b_v6e-256",
            "--until",
            "hlo",
            "--keep",
            str(tmp_path / "keep"),
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (row,) = list(csv.DictReader(open(f"{out}.csv")))
    assert not row["error"] and row["mesh"] == "fsdp=256"
    assert int(row["loops_without_trip_count"]) == 0
    assert 0 < float(row["buffer_assignment_gib"]) < 32  # a v6e chip's HBM
    published = float(row["published_mfu_same_flops_pct"])
    assert published < float(row["mfu_exposed_pct"]) <= float(row["mfu_overlapped_pct"]) <= 100
    # compute dominates (FSDP 256 of an 8B model moves little): the two bounds within 10 %
    assert float(row["step_exposed_s"]) < 1.1 * float(row["step_overlapped_s"])
