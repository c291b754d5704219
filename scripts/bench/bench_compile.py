#!/usr/bin/env python
"""Compile time and step time of the four step variants over n_layers (CPU, one run).

For each n_layers in --layers (default 2, 8, 32) of the Llama 3 debug flavor and each variant
- eager:        the eager step (trainer/step/), no compilation;
- compile:      torch.compile per block (parallelisms.apply_compile, fullgraph) + eager step;
- graph:        the whole step as one graph, blocks unrolled (trainer/graph);
- graph_scan:   the whole step as one graph, blocks as one layer scan;
it measures capture + compile seconds and the steady step time (median of --repeats steps
after one warm-up step). Each compiled variant's steps alternate with the steps of an eager
step on an identical model in the same process (`vs_eager` = ratio of the medians), which
keeps the step-time comparison meaningful when other jobs load the machine. Every (variant, n_layers) runs in a fresh subprocess with torch's
compile caches disabled, so each compile time is a cold compile. Prints a table, writes CSV
(--out), and checks the two targets: graph_scan compile at the largest n_layers <= 1.5 x at
the smallest, and graph step time <= eager step time (`vs_eager`, each n_layers).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench/bench_compile.py --out results.csv

compile_s of `compile` is (first step - steady step): per-block compilation happens lazily
inside the first step. The CPU busy fraction (from /proc/stat, other processes included) is
measured during each run and reported: on a shared machine numbers above ~0.6 (of 1 core
per run) mean contention.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.runtime import cli

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ("eager", "compile", "graph", "graph_scan")


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def _build(kind: str, args, *, backend: str):
    """(model, step) for one variant on a freshly initialized model (seed 0), as the trainer builds it."""
    import torch

    from models.llama3 import Transformer
    from models.llama3.plan import PLAN
    from parallelisms import clip_grad_norm_
    from parallelisms.compile import apply_compile
    from parallelisms.simple_fsdp import data_parallel
    from trainer.graph import build_graph_step
    from trainer.optim import build_optimizer
    from trainer.step import EagerStep

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    if kind == "compile":
        apply_compile(model, plan=PLAN, backend=backend)
    # As the trainer does on one CPU process: SimpleFSDP only casts (fp32 here).
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    opt = build_optimizer(model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if kind.startswith("graph"):
        return model, build_graph_step(
            model=model, optimizer=opt, max_norm=1.0, backend=backend, scan_layers=kind == "graph_scan", plan=PLAN
        )
    return model, EagerStep(model=model, optimizer=opt, max_norm=1.0, aux_loss_coef=0.0, clip_grad_norm=clip_grad_norm_)


def _measure(step, eager, microbatches, repeats: int) -> dict:
    """The first step (loss, seconds), one warm-up, then `repeats` timed steps alternating with `eager`'s.

    Returns first, first_s, times, eager_times (seconds per step) and busy, total (/proc/stat deltas).
    """
    busy0, total0 = _cpu_times()
    t = time.perf_counter()
    first = float(step(microbatches(), 3e-4).loss)
    first_s = time.perf_counter() - t
    step(microbatches(), 3e-4)  # warm-up (allocator, lazy inits)
    if eager is not None:
        eager(microbatches(), 3e-4)
    times, eager_times = [], []
    for _ in range(repeats):
        mbs = microbatches()
        t = time.perf_counter()
        float(step(mbs, 3e-4).loss)  # the step is synchronous on CPU; this only reads the value
        times.append(time.perf_counter() - t)
        if eager is not None:
            t = time.perf_counter()
            float(eager(mbs, 3e-4).loss)
            eager_times.append(time.perf_counter() - t)
    busy1, total1 = _cpu_times()
    return {
        "first": first,
        "first_s": first_s,
        "times": times,
        "eager_times": eager_times,
        "busy": busy1 - busy0,
        "total": total1 - total0,
    }


def _one(variant: str, n_layers: int, *, backend: str, batch: int, seq: int, repeats: int) -> dict:
    """Measure one (variant, n_layers) in this process; returns a result row."""
    import torch

    import titan_kernels
    from models.llama3 import FLAVORS

    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=n_layers, max_seq_len=seq)
    titan_kernels.select(attention="auto", device=torch.device("cpu"))  # as the trainer does
    model, step = _build(variant, args, backend=backend)
    # An eager step on an identical model in the same process, timed alternately with the
    # variant: the ratio of the two is robust to other jobs slowing the machine down.
    eager = _build("eager", args, backend=backend)[1] if variant != "eager" else None
    g = torch.Generator().manual_seed(1)

    def microbatches():
        tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
        return [(tokens[:, :-1], tokens[:, 1:])]

    m = _measure(step, eager, microbatches, repeats)
    times, eager_times, first_s = m["times"], m["eager_times"], m["first_s"]
    steady = statistics.median(times)
    compile_s = step.compile_s if step.compile_s is not None else (first_s - steady if variant == "compile" else 0.0)
    ncpu = os.cpu_count() or 1
    return {
        "variant": variant,
        "n_layers": n_layers,
        "backend": backend if variant != "eager" else "",
        "compile_s": round(compile_s, 2),
        "step_ms": round(steady * 1e3, 2),
        "step_ms_min": round(min(times) * 1e3, 2),
        "first_step_s": round(first_s, 2),
        "eager_step_ms_same_process": round(statistics.median(eager_times) * 1e3, 2) if eager_times else "",
        "vs_eager": round(steady / statistics.median(eager_times), 3) if eager_times else 1.0,
        "graph_nodes": getattr(step, "graph_nodes", None) or "",
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
        "first_loss": round(m["first"], 4),
        "cpu_busy_cores": round(m["busy"] / max(1, m["total"]) * ncpu, 2),
    }


def _parse_args() -> argparse.Namespace:
    """The command line; `--layers` and `--variants` come back as lists (variants checked)."""
    p = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", default="2,8,32", help="comma-separated n_layers")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--backend", default="inductor", choices=["inductor", "aot_eager"])
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default="bench_compile.csv")
    p.add_argument("--one", nargs=2, metavar=("VARIANT", "N_LAYERS"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        return a
    a.layers = [int(x) for x in a.layers.split(",")]
    a.variants = [v for v in a.variants.split(",") if v]
    unknown = set(a.variants) - set(VARIANTS)
    if unknown:
        p.error(f"--variants: unknown {sorted(unknown)}; allowed: {', '.join(VARIANTS)}")
    return a


def _run_child(variant: str, n_layers: int, a: argparse.Namespace, env: dict) -> dict | None:
    """One (variant, n_layers) in a fresh subprocess (`--one`); its row, or None (stderr tail printed)."""
    cmd = [
        sys.executable,
        __file__,
        "--one",
        variant,
        str(n_layers),
        "--backend",
        a.backend,
        "--batch",
        str(a.batch),
        "--seq",
        str(a.seq),
        "--repeats",
        str(a.repeats),
    ]
    proc = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{variant} n_layers={n_layers} failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
        return None
    return json.loads(lines[-1][len("RESULT ") :])


def _run_all(a: argparse.Namespace) -> list[dict] | None:
    """Every (n_layers, variant) in its own cold-cache subprocess, a line each; None when one fails."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1",
        "PYTHONPATH": str(REPO),
    }
    rows = []
    with open("/proc/loadavg") as f:
        print(f"load average before: {f.read().split()[:3]}", flush=True)
    for n_layers in a.layers:
        for variant in a.variants:
            row = _run_child(variant, n_layers, a, env)
            if row is None:
                return None
            rows.append(row)
            print(
                f"{variant:>10} L={n_layers:<3} compile {row['compile_s']:>7.2f} s  step {row['step_ms']:>9.2f} ms"
                f"  (x{row['vs_eager']} eager in-process)  nodes {row['graph_nodes']!s:>6}"
                f"  cpu busy {row['cpu_busy_cores']}",
                flush=True,
            )
    with open("/proc/loadavg") as f:
        print(f"load average after: {f.read().split()[:3]}")
    return rows


def _write_table(rows: list[dict], out: str) -> None:
    """The rows as CSV at `out` and as a `|`-separated table on stdout."""
    fields = list(rows[0].keys())
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)
    print()
    print(" | ".join(f"{k}" for k in fields))
    for r in rows:
        print(" | ".join(str(r[k]) for k in fields))
    print(f"\nwrote {out}")


def _check_targets(rows: list[dict], layers: list[int]) -> bool:
    """Print each target (graph_scan compile growth, graph step vs eager) met or MISSED; True if all met."""
    ok = True
    by = {(r["variant"], r["n_layers"]): r for r in rows}
    lo, hi = min(layers), max(layers)
    if ("graph_scan", lo) in by and ("graph_scan", hi) in by:
        ratio = by[("graph_scan", hi)]["compile_s"] / max(1e-9, by[("graph_scan", lo)]["compile_s"])
        good = ratio <= 1.5
        ok &= good
        print(f"target: graph_scan compile L={hi} / L={lo} = {ratio:.2f} (<= 1.5): {'met' if good else 'MISSED'}")
    for r in rows:
        if r["variant"] in ("graph", "graph_scan"):
            good = r["vs_eager"] <= 1.0
            ok &= good
            print(
                f"target: {r['variant']} step / eager step (same process, alternating) at L={r['n_layers']} = "
                f"{r['vs_eager']:.2f} (<= 1.0): {'met' if good else 'MISSED'}"
            )
    return ok


def main() -> int:
    a = _parse_args()
    if a.one:
        row = _one(a.one[0], int(a.one[1]), backend=a.backend, batch=a.batch, seq=a.seq, repeats=a.repeats)
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    rows = _run_all(a)
    if rows is None:
        return 1
    _write_table(rows, a.out)
    return 0 if _check_targets(rows, a.layers) else 3


if __name__ == "__main__":
    sys.exit(cli.run(main))
