"""The benchmark runner of `scripts/benchmark.py` (and of scripts/mfu_suite.py's sweep): the trainer
run as a subprocess per (variant, process count, repeat), interleaved, each after waiting for a
quiet machine; each run's metrics.jsonl read, its warm-up dropped, medians over steps and repeats.

- the runs: `VARIANTS`, `PRESETS`, `parse_variants`, `runs_at`, `build_command` (ours),
  `build_peer_command` (TorchTitan's trainer through scripts/bench/reference_torchtitan.py),
  `plan_jobs` (the interleaved job list), `execute` (run them);
- the numbers: `read_records`, `summarize_run`, `summarize`, `add_peer_ratio`, `format_table`,
  `write_csv`, `report`, `machine_fields` (CPU model, threads), `cpu_busy_fraction`.

The command line (its flags, presets and checks) is scripts/benchmark.py's; docs/benchmarks.md.
"""

from __future__ import annotations

import csv
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from trainer.runtime import cli

REPO = Path(__file__).resolve().parents[1]

VARIANTS = {
    "eager": ["--compile.mode=eager"],
    "compile": ["--compile.mode=compile"],
    "graph": ["--compile.mode=graph"],
    "graph_scan": ["--compile.mode=graph", "--compile.scan_layers=true"],
}

# Every run: no checkpoints, validation, profiling or TensorBoard (they are not the step), and a
# record for every step so warm-up can be cut precisely.
RUN_OVERRIDES = [
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=false",
    "--validation.enable=false",
    "--profiling.enable=false",
]

METRICS = ("tokens_per_sec", "tflops", "mfu_pct", "mfu_pct_causal", "data_loading_pct")

PEERS = ("torchtitan",)
PEER_SCRIPT = REPO / "scripts" / "bench" / "reference_torchtitan.py"
PEER_PYTHON = REPO / ".venv-peer" / "bin" / "python"

# --preset ttshape: our debug model at TorchTitan's debugmodel shape, eager/graph/graph_scan in bf16
# (TorchTitan's own mixed precision) and fp32, against TorchTitan's trainer, seq 2048, batch 8.
_FP32 = "--training.mixed_precision_param=float32"
PRESETS = {
    "ttshape": {
        "config": "configs/llama3_debug_ttshape.toml",
        "variants": {
            "eager_bf16": ["--compile.mode=eager"],
            "graph_bf16": ["--compile.mode=graph"],
            "graph_scan_bf16": ["--compile.mode=graph", "--compile.scan_layers=true"],
            "eager_fp32": ["--compile.mode=eager", _FP32],
            "graph_fp32": ["--compile.mode=graph", _FP32],
            "graph_scan_fp32": ["--compile.mode=graph", "--compile.scan_layers=true", _FP32],
        },
        "peer": "torchtitan",
        "seq_len": 2048,
        "batch": 8,
        "repeats": 3,
        "steps": 20,
        "warmup": 5,
    },
}
# --preset moe_ttshape / moe_ttshape_balanced: our Qwen 3 MoE at TorchTitan's qwen3_moe_debug shape (64
# experts, top-8, 315.8M parameters; seq cut to 256, batch 2) against TorchTitan's own MoE trainer, both
# bf16 with selective AC; learned routing on both sides, or round-robin on both (ours `[moe] routing =
# "balanced"`, TorchTitan's `debug.moe_force_load_balance`).
_MOE_SHAPE = {"config": "configs/qwen3_moe_debug_ttshape.toml", "peer": "torchtitan", "peer_model": "qwen3_moe"}
_MOE_RUNS = {"seq_len": 256, "batch": 2, "repeats": 3, "steps": 4, "warmup": 2}
_BALANCED = ["--moe.routing=balanced", "--moe.routing_benchmark_only=true"]
PRESETS["moe_ttshape"] = {
    **_MOE_SHAPE,
    "variants": {"eager_bf16": ["--compile.mode=eager"]},
    "peer_routing": "learned",
    **_MOE_RUNS,
}
PRESETS["moe_ttshape_balanced"] = {
    **_MOE_SHAPE,
    "variants": {"eager_bf16_balanced": ["--compile.mode=eager", *_BALANCED]},
    "peer_routing": "balanced",
    **_MOE_RUNS,
}
# --quick: a smoke run of the same table (shapes cut so that it finishes in minutes on 2 cores).
QUICK = {"seq_len": 256, "batch": 2, "repeats": 1, "steps": 4, "warmup": 1}


# ------------------------------------------------------------------------------ pure helpers


def _refuse(message: str) -> SystemExit:
    """Bad input: write the one `error:` line now; the SystemExit to raise exits with 2."""
    cli.error_line(message)
    return SystemExit(2)


def parse_variants(names: str, custom: list[str]) -> dict[str, list[str]]:
    """--variants a,b and --variant NAME='overrides' -> {name: [override, ...]} (ordered)."""
    out: dict[str, list[str]] = {}
    for name in [n.strip() for n in names.split(",") if n.strip()]:
        if name not in VARIANTS:
            raise _refuse(
                f"--variants: unknown variant {name!r}; allowed: {', '.join(VARIANTS)} "
                "(or --variant NAME='--section.key=value ...')"
            )
        out[name] = list(VARIANTS[name])
    for spec in custom:
        name, sep, overrides = spec.partition("=")
        if not sep or not name:
            raise _refuse(f"--variant: expected NAME='--section.key=value ...', got {spec!r}")
        split_nprocs(name)  # checks an @N suffix
        out[name] = shlex.split(overrides)
    if not out:
        raise _refuse("--variants: no variants to run")
    return out


def split_nprocs(name: str) -> set[int] | None:
    """`NAME@2+4` -> {2, 4}: a custom variant that runs at those process counts only (e.g. an
    FSDP option, pointless in one process); no suffix -> None (every count)."""
    _, at, counts = name.partition("@")
    if not at:
        return None
    try:
        nprocs = {int(n) for n in counts.split("+")}
    except ValueError:
        nprocs = set()
    if not nprocs or min(nprocs) < 1:
        raise _refuse(f"--variant: {name!r}: after @ expected process counts like 2 or 2+4")
    return nprocs


SOLO = "+solo"
"""Suffix of a `--ceiling` variant: N independent 1-process runs at once (no collectives)."""


def runs_at(name: str, nproc: int) -> bool:
    """Whether variant `name` runs at `nproc` processes (`NAME@2`: only there; a ceiling: N > 1)."""
    if name.endswith(SOLO):
        return nproc > 1
    only = split_nprocs(name)
    return only is None or nproc in only


def build_command(
    *,
    recipe: str,
    overrides: list[str],
    nproc: int,
    dump_folder: str,
    steps: int,
    extra: list[str],
    python: str = sys.executable,
) -> list[str]:
    """The trainer command line of one run (torchrun for more than one process)."""
    launcher = [python, "-m", "trainer.train"]
    if nproc > 1:
        launcher = [
            python,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            "trainer.train",
        ]
    return [
        *launcher,
        "--config",
        recipe,
        *RUN_OVERRIDES,
        f"--training.steps={steps}",
        f"--job.dump_folder={dump_folder}",
        *overrides,
        *extra,
    ]


def build_peer_command(
    *,
    peer: str,
    python: str,
    nproc: int,
    dump_folder: str,
    steps: int,
    warmup: int,
    seq_len: int,
    batch: int,
    extra: list[str],
    model: str = "llama3",
    routing: str = "learned",
) -> list[str]:
    """The peer harness's command line for one run (it launches the peer's own torchrun itself).

    `model`/`routing`: the harness's --model (llama3, qwen3_moe) and --routing (learned, balanced)."""
    if peer not in PEERS:
        raise _refuse(f"--peer: unknown peer {peer!r}; allowed: {', '.join(PEERS)}")
    cmd = [
        python,
        str(PEER_SCRIPT),
        "--dump-folder",
        dump_folder,
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--nproc",
        str(nproc),
        "--seq-len",
        str(seq_len),
        "--batch",
        str(batch),
        "--model",
        model,
        "--routing",
        routing,
    ]
    return cmd + (["--", *extra] if extra else [])


def read_records(path: Path) -> list[dict]:
    """metrics.jsonl records, the last one per step (a resumed run may repeat steps)."""
    by_step: dict[int, dict] = {}
    if not path.is_file():
        return []
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
        by_step[int(record["step"])] = record
    return [by_step[s] for s in sorted(by_step)]


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize_run(records: list[dict], warmup: int) -> dict:
    """Median over the steps after `warmup` of each throughput metric; peak memory; compile time."""
    steady = [r for r in records if r["step"] > warmup]
    out = {key: _median([r.get(key) for r in steady]) for key in METRICS}
    out["mem_gib"] = max((r["mem_gib"] for r in records if r.get("mem_gib") is not None), default=None)
    out["compile_s"] = next((r["compile_s"] for r in records if r.get("compile_s") is not None), None)
    out["steady_steps"] = len(steady)
    out["_steady_tps"] = [r["tokens_per_sec"] for r in steady if r.get("tokens_per_sec") is not None]
    out["last_loss"] = records[-1].get("loss") if records else None
    # The peak MFU divides by, and the best compute dtype's peak (they differ on a CPU where the
    # run's dtype is the slower one; docs/metrics.md), from the first record.
    for key in ("peak_tflops", "peak_tflops_best"):
        out[key] = next((r[key] for r in records if r.get(key) is not None), None)
    return out


def summarize(runs: list[dict]) -> list[dict]:
    """Group runs by (variant, nproc); medians across the successful repeats."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for run in runs:
        groups.setdefault((run["variant"], run["nproc"]), []).append(run)
    rows = []
    for (variant, nproc), group in groups.items():
        ok = [r for r in group if r["rc"] == 0 and r["steady_steps"] > 0]
        row = {"variant": variant, "nproc": nproc, "runs": len(group), "ok": len(ok)}
        for key in ("cpu_model", "threads"):
            row[key] = group[0].get(key)
        for key in (*METRICS, "mem_gib", "compile_s", "busy_before"):
            row[key] = _median([r.get(key) for r in ok])
        tps = [r["tokens_per_sec"] for r in ok if r.get("tokens_per_sec") is not None]
        row["tokens_per_sec_min"] = min(tps) if tps else None
        row["tokens_per_sec_max"] = max(tps) if tps else None
        # The fast phase: on a shared VM other tenants only ever slow a step down, so a high
        # quantile of all steady steps of all repeats estimates the uncontended speed (the
        # reasoning of timeit's "take the minimum"); p90, not the max, so one odd step cannot set it.
        pooled = sorted(t for r in ok for t in r.get("_steady_tps", []))
        row["tokens_per_sec_p90"] = pooled[min(int(0.9 * len(pooled)), len(pooled) - 1)] if pooled else None
        # Pure data parallelism: every device consumes its own tokens.
        row["tokens_per_sec_total"] = row["tokens_per_sec"] * nproc if row["tokens_per_sec"] is not None else None
        rows.append(row)
    return rows


def add_peer_ratio(rows: list[dict], peer: str | None) -> list[dict]:
    """`vs_peer` = tokens/s per device over the peer's at the same process count (None if either is missing)."""
    if peer is None:
        return rows
    base = {r["nproc"]: r.get("tokens_per_sec") for r in rows if r["variant"] == peer}
    for row in rows:
        ours, theirs = row.get("tokens_per_sec"), base.get(row["nproc"])
        row["vs_peer"] = ours / theirs if ours is not None and theirs else None
    return rows


def format_table(rows: list[dict]) -> str:
    columns = [
        ("variant", "variant", "{}"),
        ("nproc", "nproc", "{}"),
        ("threads", "threads", "{}"),
        ("ok", "ok/runs", None),
        ("tokens_per_sec", "tok/s/dev", "{:,.0f}"),
        ("spread", "min..max", None),
        ("tokens_per_sec_p90", "p90 step", "{:,.0f}"),
        ("vs_peer", "vs peer", "{:.2f}x"),
        ("tokens_per_sec_total", "tok/s total", "{:,.0f}"),
        ("tflops", "TFLOP/s/dev", "{:.3g}"),
        ("mfu_pct", "MFU %", "{:.2f}"),
        ("mfu_pct_causal", "MFU % causal", "{:.2f}"),
        ("data_loading_pct", "data %", "{:.1f}"),
        ("mem_gib", "mem GiB", "{:.2f}"),
        ("compile_s", "compile s", "{:.1f}"),
        ("busy_before", "cpu busy", "{:.2f}"),
    ]

    def cell(row, key, spec):
        if key == "ok":
            return f"{row['ok']}/{row['runs']}"
        if key == "spread":
            lo, hi = row.get("tokens_per_sec_min"), row.get("tokens_per_sec_max")
            return "-" if lo is None else f"{lo:,.0f}..{hi:,.0f}"
        value = row.get(key)
        return "-" if value is None else spec.format(value)

    for optional in ("vs_peer", "data_loading_pct"):  # a peer's rows, or records from before the key
        if not any(r.get(optional) is not None for r in rows):
            columns = [c for c in columns if c[0] != optional]
    table = [[title for _, title, _ in columns]] + [[cell(r, k, s) for k, _, s in columns] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(columns))]
    lines = ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ machine state


def _cpu_times() -> tuple[int, int] | None:
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return idle, sum(fields[:8])  # guest time is already inside user/nice


def cpu_busy_fraction(interval: float = 1.0) -> float | None:
    """Fraction of all CPUs' time spent busy over `interval` seconds (None off Linux)."""
    first = _cpu_times()
    if first is None:
        return None
    time.sleep(interval)
    second = _cpu_times()
    idle, total = second[0] - first[0], second[1] - first[1]
    return 1.0 - idle / total if total > 0 else None


def wait_until_quiet(max_busy: float, max_wait: float) -> float | None:
    busy = cpu_busy_fraction()
    waited = 0.0
    while busy is not None and busy > max_busy and waited < max_wait:
        time.sleep(4.0)
        waited += 5.0
        busy = cpu_busy_fraction()
    return busy


# ------------------------------------------------------------------------------ running


def execute(
    jobs: list[dict], *, env: dict, warmup: int, timeout: float, max_busy: float, max_wait: float
) -> list[dict]:
    """Run each job (`cmd`, `folder`, optional `log` file name, plus any labels) in order, one at a time, after waiting for
    a quiet machine; returns one row per job: its labels, rc, wall_s, busy_before and the
    `summarize_run` of its metrics.jsonl. scripts/mfu_suite.py runs its sweep through this too."""
    runs = []
    for i, job in enumerate(jobs):
        labels = {k: v for k, v in job.items() if k not in ("cmd", "cmds", "folder", "log")}
        folder = Path(job["folder"])
        busy = wait_until_quiet(max_busy, max_wait)
        busy_text = "n/a" if busy is None else f"{busy:.2f}"
        what = " ".join(f"{k}={v}" for k, v in labels.items())
        print(f"[{i + 1}/{len(jobs)}] {what} (cpu busy {busy_text}) ...", file=sys.stderr, flush=True)
        folder.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        log_path = folder / job.get("log", "stdout.log")
        if "cmds" in job:  # independent copies at once, each in its own folder
            rc = _run_together(job["cmds"], env=env, timeout=timeout, log_path=log_path)
            copies = [summarize_run(read_records(Path(_dump_folder(c)) / "metrics.jsonl"), warmup) for c in job["cmds"]]
            summary = _mean_of_copies(copies)
        else:
            with open(log_path, "w") as log:
                try:
                    rc = subprocess.run(
                        job["cmd"], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout
                    ).returncode
                except subprocess.TimeoutExpired:
                    rc = 124
            summary = summarize_run(read_records(folder / "metrics.jsonl"), warmup)
        wall = time.perf_counter() - start
        run = {**labels, "rc": rc, "wall_s": wall, "busy_before": busy, **summary}
        if rc != 0:
            print(f"  failed (exit {rc}); see {log_path}", file=sys.stderr)
        runs.append(run)
    return runs


def _dump_folder(cmd: list[str]) -> str:
    return next(a.split("=", 1)[1] for a in cmd if a.startswith("--job.dump_folder="))


def _run_together(cmds: list[list[str]], *, env: dict, timeout: float, log_path: Path) -> int:
    """Start every command at once (one log each: stdout.log -> stdout.<i>.log); the first failure's exit code."""
    procs = []
    for i, cmd in enumerate(cmds):
        log = open(log_path.with_suffix(f".{i}{log_path.suffix}"), "w")
        procs.append((subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    deadline, rcs = time.monotonic() + timeout, []
    for proc, log in procs:
        try:
            rcs.append(proc.wait(timeout=max(deadline - time.monotonic(), 0.1)))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rcs.append(124)
        log.close()
    return next((rc for rc in rcs if rc != 0), 0)


def _mean_of_copies(copies: list[dict]) -> dict:
    """One run's summary from its independent copies: per-process metrics averaged, memory the max."""
    out = dict(copies[0])
    for key in (*METRICS, "compile_s"):
        values = [c.get(key) for c in copies]
        out[key] = sum(values) / len(values) if all(v is not None for v in values) else None
    out["mem_gib"] = max((c["mem_gib"] for c in copies if c.get("mem_gib") is not None), default=None)
    out["steady_steps"] = min(c["steady_steps"] for c in copies)
    out["_steady_tps"] = [t for c in copies for t in c.get("_steady_tps", [])]
    return out


# ------------------------------------------------------------------------------ the machine and the CSVs


def machine_fields(threads: int | None = None) -> dict:
    """The CPU model (lscpu, via trainer/device.cpu_model) and the OpenMP thread count of a run."""
    from trainer.runtime.device import cpu_model

    if threads is None:
        threads = int(os.environ.get("OMP_NUM_THREADS", "0")) or os.cpu_count()
    return {"cpu_model": cpu_model(), "threads": threads}


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    keys = list(dict.fromkeys(k for row in rows for k in row if not k.startswith("_")))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def plan_jobs(
    *,
    recipe: str,
    variants: dict[str, list[str]],
    nprocs: list[int],
    repeats: int,
    steps: int,
    warmup: int,
    root: Path,
    extra: list[str],
    ceiling: list[str] = (),
    peer: str | None = None,
    peer_python: str = str(PEER_PYTHON),
    peer_seq_len: int = 2048,
    peer_batch: int = 8,
    peer_args: list[str] = (),
    preset: dict | None = None,
) -> list[dict]:
    """One job per (repeat, variant, process count), interleaved: the command (or commands, for a
    +solo ceiling, `ceiling` naming variants) and the run folder. `extra`: the arguments after `--`
    for every run of ours; `preset`: a PRESETS entry (the peer's model and routing)."""
    preset = preset or {}
    names = [*variants, *(f"{name}{SOLO}" for name in ceiling), *([peer] if peer else [])]
    plan = [(rep, name, nproc) for rep in range(repeats) for name in names for nproc in nprocs if runs_at(name, nproc)]
    jobs = []
    for rep, name, nproc in plan:
        folder = root / f"{name}-n{nproc}-r{rep}"
        job = {"variant": name, "nproc": nproc, "repeat": rep, "folder": folder}
        if name == peer:
            job["cmd"] = build_peer_command(
                peer=name,
                python=peer_python,
                nproc=nproc,
                dump_folder=str(folder),
                steps=steps,
                warmup=warmup,
                seq_len=peer_seq_len,
                batch=peer_batch,
                extra=list(peer_args),
                model=preset.get("peer_model", "llama3"),
                routing=preset.get("peer_routing", "learned"),
            )
            # The peer harness's own output; TorchTitan's log is its stdout.log in the same folder.
            job["log"] = "harness.log"
        elif name.endswith(SOLO):
            job["cmds"] = [
                build_command(
                    recipe=recipe,
                    overrides=variants[name.removesuffix(SOLO)],
                    nproc=1,
                    dump_folder=str(folder / f"copy{i}"),
                    steps=steps,
                    extra=extra,
                )
                for i in range(nproc)
            ]
        else:
            job["cmd"] = build_command(
                recipe=recipe,
                overrides=variants[name],
                nproc=nproc,
                dump_folder=str(folder),
                steps=steps,
                extra=extra,
            )
        jobs.append(job)
    return jobs


def report(
    runs: list[dict], machine: dict, *, recipe: str, steps: int, warmup: int, repeats: int, peer: str | None, out: Path
) -> int:
    """Print the summary table, write the summary CSV (`out`) and the runs CSV (<stem>_runs); 1 if a run
    failed, else 0."""
    rows = add_peer_ratio(summarize(runs), peer)
    load = f"{os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else "n/a"
    print(
        f"\n{recipe}: {steps} steps, first {warmup} dropped, median of {repeats} repeat(s); "
        f"CPU {machine['cpu_model']}, {os.cpu_count()} CPUs, {machine['threads']} thread(s) per process, "
        f"load average now {load}"
    )
    print(format_table(rows))
    write_csv(out, rows)
    write_csv(out.with_name(out.stem + "_runs" + out.suffix), runs)
    print(f"\nwrote {out} and {out.with_name(out.stem + '_runs' + out.suffix)}")
    return 0 if all(r["ok"] == r["runs"] for r in rows) else 1
