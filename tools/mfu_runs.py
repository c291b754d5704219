"""The measured side of scripts/mfu_suite.py: its runs grouped and resumed, and its outputs written.

- `group_runs` (one row per recipe, mode and process count: medians over the repeats),
  `add_best_mfu`, `run_dtype` (a run's compute dtype from its log);
- `--resume`: `complete` (a run folder that holds its last step), `reread` (its row, as
  tools/benchmark.py's `execute` makes it);
- `write_outputs` (the CSVs and plots), `report_lines` (<out>.md), `machine_line`, `git_commit`.

The runs are tools/benchmark.py's; the tables and plots tools/mfu_report.py's.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

from tools import benchmark as bench
from tools.mfu_report import (
    anchor_table,
    measured_table,
    ours_by_recipe,
    projection_sections,
    write_plots,
    write_weak_plot,
)

ROOT = Path(__file__).resolve().parents[1]


def group_runs(runs: list[dict]) -> list[dict]:
    """Runs -> one row per (recipe, mode, nproc): medians over the successful repeats."""
    groups: dict[tuple, list[dict]] = {}
    for run in runs:
        groups.setdefault((run["recipe"], run["mode"], run["nproc"]), []).append(run)
    rows = []
    for (recipe, mode, nproc), group in groups.items():
        ok = [r for r in group if r["rc"] == 0 and r.get("steady_steps")]
        row = {"recipe": recipe, "mode": mode, "nproc": nproc, "runs": len(group), "ok": len(ok)}
        for key in (
            "tokens_per_sec",
            "tflops",
            "mfu_pct",
            "mfu_pct_causal",
            "mfu_pct_best",
            "peak_tflops",
            "peak_tflops_best",
            "mem_gib",
            "compile_s",
            "busy_before",
        ):
            row[key] = bench._median([r.get(key) for r in ok])
        dtypes = sorted({r["dtype"] for r in ok if r.get("dtype")})
        row["dtype"] = "/".join(dtypes) or None
        row["tokens_per_sec_total"] = row["tokens_per_sec"] * nproc if row["tokens_per_sec"] is not None else None
        rows.append(row)
    return rows


def add_best_mfu(run: dict) -> dict:
    """mfu_pct against the faster compute dtype's peak (equal to mfu_pct where the run uses it)."""
    mfu, peak, best = run.get("mfu_pct"), run.get("peak_tflops"), run.get("peak_tflops_best")
    run["mfu_pct_best"] = mfu * peak / best if None not in (mfu, peak, best) and best > 0 else mfu
    return run


def run_dtype(folder: Path) -> str | None:
    """The compute dtype a run printed in its start-up lines (`titan-tpu: compute dtype X (...)`)."""
    try:
        text = (folder / "stdout.log").read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"compute dtype (\w+)", text)
    return m.group(1) if m else None


def complete(folder: Path, steps: int) -> bool:
    """Whether a run folder holds a metrics.jsonl record of its last step (--resume)."""
    records = bench.read_records(folder / "metrics.jsonl")
    return bool(records) and records[-1]["step"] == steps


def reread(job: dict, warmup: int) -> dict:
    """The row `benchmark.execute` would have made for a finished run (--resume): rc 0, no timing."""
    labels = {k: v for k, v in job.items() if k not in ("cmd", "folder")}
    return {
        **labels,
        "rc": 0,
        "wall_s": None,
        "busy_before": None,
        **bench.summarize_run(bench.read_records(Path(job["folder"]) / "metrics.jsonl"), warmup),
    }


def machine_line() -> str:
    import torch

    from trainer.runtime.device import cpu_model

    threads = os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads()))
    load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"
    return f"{cpu_model()}, {os.cpu_count()} CPUs, OMP_NUM_THREADS={threads}, torch {torch.__version__}, load average {load}"


def git_commit() -> str:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"


def write_outputs(out: Path, *, rows, runs, projections, programs, weak) -> list[Path]:
    """The CSVs (groups and projections, programs, weak scaling, runs) and the plots; the PNG paths."""
    bench.write_csv(out.with_suffix(".csv"), rows + [{**p, "mode": "projection"} for p in projections])
    if programs:
        bench.write_csv(out.with_name(out.name + "_programs.csv"), programs)
    if weak:
        bench.write_csv(out.with_name(out.name + "_weak_scaling.csv"), weak)
    bench.write_csv(out.with_name(out.name + "_runs.csv"), runs)
    pngs = write_plots(rows, out)
    if weak:
        pngs.append(write_weak_plot(weak, out))
    return pngs


def report_lines(
    argv: list[str], *, steps, warmup, repeats, started, rows, projections, programs, weak, skipped, anchors, pngs
) -> list[str]:
    """<out>.md: the run's header (`argv`: the command's arguments; `steps`, `warmup`, `repeats` of
    its runs), the measured table, the projections, the anchors, the plots."""
    command = "python scripts/mfu_suite.py " + shlex.join(argv)
    md = [
        f"# MFU suite, {started}",
        "",
        f"- machine: {machine_line()}",
        f"- commit: {git_commit()}",
        f"- command: `{command}`",
        f"- {steps} steps per run, first {warmup} dropped; median over steps, then over {repeats} "
        "repeat(s) (interleaved)",
        "- MFU conventions: palm = 6N + 12·L·H·Q·T per token (TorchTitan; `mfu_pct`), causal = attention halved "
        "(MaxText; `mfu_pct_causal`); 'vs best dtype' divides by the faster CPU compute dtype's peak "
        "(docs/metrics.md)",
        "",
        "## Measured",
        "",
        *measured_table(rows),
        "",
        "## Projections: upper bounds on MFU from the compiled program (deviceless XLA:TPU compile; not measured)",
        "",
    ]
    md += projection_sections(projections, programs, weak, skipped=skipped, anchors=anchors)
    md += [
        "",
        "## Published anchors beside ours",
        "",
        *anchor_table(anchors, ours_by_recipe(projections, rows)),
        "",
        *[f"![{p.stem}]({p.name})" for p in pngs],
        "",
    ]
    return md
