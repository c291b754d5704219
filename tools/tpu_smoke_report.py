"""The TPU smoke's logs, metrics and report (tools/tpu_smoke.py runs the smoke; this reads what the
runs left in DIR): compile-cache misses, error and start-up lines of the logs, each run's numbers
from its metrics.jsonl, the loss verdicts, and report.md.

This module imports no torch (tools/tpu_smoke.py's launching process must not hold the chips).
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

CACHE_MISS_PATTERN = "Compilation cache STATIC MISS"
"""Text of torch-tpu's own log line for a compilation-cache miss (a string in its binary; whether
0.2.0 prints it without verbose logging is unknown): the report counts the log lines holding it
after each run's step-3 console line. The other count comes from the trainer: on a TPU it logs
torch-tpu's miss counter as `compile_cache_misses` in metrics.jsonl (trainer/runtime/tpu_env.py).
Any miss after step 3 means a program compiled again in steady state (e.g. a per-step Python
scalar baked into it)."""

TRAINER_MISS_LINE = "titan-tpu: compile cache misses at step"
"""The start of the trainer's per-step line for the same counter (trainer.runtime.tpu_env.
CACHE_MISS_LINE; not imported: this process must not import torch), kept out of the start-up
lines the report quotes."""


TAIL_LINES = 40
"""Lines of a failed run's log quoted in the report."""

LAST_STEPS = 5
"""Losses compared as the median over the last LAST_STEPS steps both runs logged: early in
training one step's loss can spike by 0.5 (7 % of it) in one run and not in another started from
other weights; the median of 5 steps ignores one such spike."""

REL_TOL_VS_CPU = 0.02
"""Largest relative difference of the last-steps median loss from the CPU reference that reads
as "ok". A TPU run sees the same batches as the CPU run (same data seed), but its initial weights
come from another random generator (each device initializes on its own RNG) and its bf16 kernels
round differently. Measured on the CPU (docs/tpu.md, "First run"): the Llama 3 debug recipe at
bf16, 20 steps, with only the init seed changed (4 seeds): the medians of steps 16-20 lie within
0.8 % of each other (the final losses within 7.6 %, from spikes). 2 % is 2.5 times that spread
and under the ~3 steps of learning the median gains there (7 % over steps 6-10 to 16-20), so a
run that trains wrong (a flat loss, a wrong lr or gradient) shows as DIFFERS."""
REL_TOL_RESUME = 1e-5
"""Largest relative loss difference of the resumed run from the uninterrupted one: the same
device, program and batches, the state restored bit for bit (fp32 weights and moments, data
position, RNG); only a reduction order may differ, a few fp32 ulps (tests/e2e/test_resume_e2e.py
holds 1e-5 even across meshes)."""


SHIM = ["--model.n_layers=2", "--training.seq_len=64", "--compile.backend=aot_eager"]
"""--shim: a tiny model and no Inductor, so CI's end-to-end run takes seconds per run."""

CACHE_FOLDER = "compile_cache"
"""DIR/compile_cache: the persistent compilation cache (tier 3) of the compile-cache runs, fresh
for each smoke, left out of the tarball."""
TIER2_VAR, TIER2_ROOT = "TORCH_TPU_TIER2_COMPILATION_CACHE", Path("/dev/shm/torch_tpu_cache")
"""torch-tpu's host cache: a name under TIER2_ROOT (the root is a string in its binary). Each
compile-cache run gets a name of its own, so the relaunch cannot be served from the first
launch's host cache and what it loads comes from the persistent folder, as on a new host; the
smoke removes both folders after its runs."""
SHIM_MODULE = "tools.tpu_smoke_shim"
"""--shim: the command that stands in for `python -m torch.tpu.distributed` (a made-up launch
environment)."""


# ------------------------------------------------------------------------------------ logs


_STEP_LINE = re.compile(r"^step\s+(\d+)/\d+\s")


def cache_misses(log_text: str, pattern: str = CACHE_MISS_PATTERN, after_step: int = 3) -> int | None:
    """Lines holding `pattern` after the console line of step `after_step` (rank 0 prints it), or
    None when the log has no such line (the run stopped before it)."""
    lines = log_text.splitlines()
    for i, line in enumerate(lines):
        m = _STEP_LINE.match(line)
        if m and int(m.group(1)) == after_step:
            return sum(pattern in rest for rest in lines[i + 1 :])
    return None


def counter_misses(records: list[dict], after_step: int = 3) -> int | None:
    """Compilation cache misses in the steps after `after_step` by torch-tpu's counter (the
    cumulative `compile_cache_misses` of metrics.jsonl), or None where the run has no counter."""
    by_step = {r["step"]: r.get("compile_cache_misses") for r in records}
    if by_step.get(after_step) is None or not records or records[-1].get("compile_cache_misses") is None:
        return None
    return int(records[-1]["compile_cache_misses"] - by_step[after_step])


def misses_through(records: list[dict], step: int = 3) -> int | None:
    """torch-tpu's cumulative miss count at `step` (start-up and steps 1..step), or None where the
    run logged no counter there."""
    value = next((r.get("compile_cache_misses") for r in records if r["step"] == step), None)
    return None if value is None else int(value)


def relaunch_verdict(first: list[dict], second: list[dict], after_step: int = 3) -> str:
    """The compile cache's verdict line from the metrics.jsonl records of a run (`first`) and of
    its relaunch on the same persistent cache (`second`): "second launch: N misses after step 3,
    M at restart", M counting from the process start through step 3, then the first launch's two
    numbers and what they say. A relaunch served wholly by the cache compiles nothing (0 and 0)."""
    n, m = counter_misses(second, after_step), misses_through(second, after_step)
    if n is None or m is None:
        return (
            f"second launch: not measured (no compile_cache_misses through step {after_step} in its "
            "metrics.jsonl: not on a TPU, or it stopped early)"
        )
    line = f"second launch: {n} misses after step {after_step}, {m} at restart"
    n0, m0 = counter_misses(first, after_step), misses_through(first, after_step)
    if m0 is not None:
        line += f" (first launch: {_fmt(n0, 'd')} after step {after_step}, {m0} at start)"
    if n == 0 and m == 0:
        return line + ": compiled nothing, the cache served every program"
    if m0 is not None and m < m0:
        return line + f": the cache served {m0 - m} of the first launch's {m0} programs, the rest compiled again"
    return line + (
        ": missed as much as a cold start (no cache read, or torch-tpu counts a program loaded "
        "from the cache as a miss: see `compilations` and the first step's time)"
    )


def tail(log_text: str, n: int = TAIL_LINES) -> str:
    return "\n".join(log_text.splitlines()[-n:])


_ERROR_LINE = re.compile(r"^(\[(default)?\d+\]:?\s*|\[rank\d+\]:\s*)?(error: |[A-Za-z_][\w.]*(Error|Exception)\b)")


def error_lines(log_text: str, limit: int = 10) -> list[str]:
    """The trainer's `error:` lines and the exception lines of any traceback, once each (a
    torchrun failure's summary can push a worker's error out of the tail)."""
    seen: dict[str, None] = {}
    for line in log_text.splitlines():
        if _ERROR_LINE.match(line) and len(seen) < limit:
            seen.setdefault(line.rstrip(), None)
    return list(seen)


def banner_lines(log_text: str) -> list[str]:
    """The trainer's start-up lines (`titan-tpu: ...`: mesh, dtype, attention, loss, kernel
    fallbacks), once each, in order."""
    seen: dict[str, None] = {}
    for line in log_text.splitlines():
        if line.startswith("titan-tpu:") and not line.startswith(TRAINER_MISS_LINE):
            seen.setdefault(line.rstrip(), None)
    return list(seen)


def parse_launch_env(text: str) -> dict[str, str]:
    """`KEY=VALUE` / `KEY="VALUE"` lines of `python -m torch.tpu.distributed`'s output."""
    env = {}
    for line in text.splitlines():
        m = re.match(r"^([A-Z_][A-Z0-9_]*)=(.*)$", line.strip())
        if m:
            value = m.group(2)
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
                value = value[1:-1]
            env[m.group(1)] = value
    return env


def read_metrics(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a kill
            pass
    return out


# ---------------------------------------------------------------------------------- the report


def _fmt(value, spec: str = ".4f") -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return format(value, spec)


def summarize(records: list[dict]) -> dict:
    """Numbers of one run from its metrics.jsonl records (one per step, log_freq = 1)."""
    if not records:
        return {}
    first, last = records[0], records[-1]
    steady = [r for r in records if r["step"] >= 3]  # step 1 compiles; step 2 may recompile
    times = [b["elapsed_s"] - a["elapsed_s"] for a, b in zip(records, records[1:]) if b["step"] >= 3]

    def median(key):
        vals = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return {
        "first_step": first["step"],
        "last_step": last["step"],
        "final_loss": last.get("loss"),
        "setup_s": first.get("setup_s"),
        "first_step_s": first.get("elapsed_s"),
        "compile_s": first.get("compile_s"),
        "median_step_s": statistics.median(times) if times else None,
        "tokens_per_sec": median("tokens_per_sec"),
        "mfu_pct": median("mfu_pct"),
        "counter_misses": counter_misses(records, after_step=first["step"] + 2),
        "misses_through_3": misses_through(records, first["step"] + 2),
        "compilations": last.get("compilations"),
        "losses": {r["step"]: r.get("loss") for r in records},
    }


def compare(run: dict, ref: dict, *, exact: bool) -> tuple[str, float | None]:
    """(verdict, relative difference) of a run's losses against its reference's: exact: the
    largest per-step difference; else the medians of the last LAST_STEPS common steps."""
    a, b = run.get("losses") or {}, ref.get("losses") or {}
    common = sorted(s for s in a if s in b)
    if not common:
        return "not compared (no common steps)", None
    if any(a[s] is None or b[s] is None for s in common):
        return "FAIL: non-finite loss", None
    if exact:
        worst = max(abs(a[s] - b[s]) / abs(b[s]) for s in common)
        return ("ok" if worst <= REL_TOL_RESUME else f"DIFFERS (> {REL_TOL_RESUME:g})"), worst
    window = common[-LAST_STEPS:]
    mid_a = statistics.median(a[s] for s in window)
    mid_b = statistics.median(b[s] for s in window)
    rel = (mid_a - mid_b) / abs(mid_b)
    if len(common) > len(window) and mid_a >= a[common[0]]:
        return "FAIL: loss did not fall", rel
    return ("ok" if abs(rel) <= REL_TOL_VS_CPU else f"DIFFERS (> {REL_TOL_VS_CPU:.0%})"), rel


def render_report(out: Path, pattern: str = CACHE_MISS_PATTERN) -> str:
    """report.md from OUT/smoke.json, the logs and the metrics."""
    meta = json.loads((out / "smoke.json").read_text())
    runs = meta["runs"]
    stats, logs = _run_stats(out, meta)
    L = _header_lines(meta, pattern)
    L += _runs_table(runs, stats, logs, pattern)
    L += _relaunch_sections(out, runs, stats)
    L += _resume_section(runs, stats)
    L += _environment_section(out, meta)
    L += _flags_section(runs, logs)
    L += _unfinished_logs_section(runs, logs)
    L += ["## pip freeze", "", "```", _read(out / "pip_freeze.txt").strip(), "```", ""]
    return "\n".join(L)


def _run_stats(out: Path, meta: dict) -> tuple[dict, dict]:
    """Each run's `summarize`d metrics and its log text; a run that exited 0 short of its steps is
    marked failed in `meta` (with the reason)."""
    stats, logs = {}, {}
    for name, r in meta["runs"].items():
        log = out / "runs" / f"{name}.log"
        logs[name] = log.read_text(errors="replace") if log.is_file() else ""
        stats[name] = summarize(read_metrics(out / "runs" / name))
        if r.get("status") == "ok" and stats[name].get("last_step") != r.get("steps", meta["steps"]):
            r["status"] = "failed"
            r["reason"] = f"exit 0 but metrics.jsonl ends at step {stats[name].get('last_step')}"
    return stats, logs


def _header_lines(meta: dict, pattern: str) -> list[str]:
    """The title, the shim's warning, and what every run shares (steps, batch, timeout, misses)."""
    L = ["# TPU smoke report", ""]
    if meta["shim"]:
        L += [
            '**Fake TPU shim (`--shim`, CI): nothing here ran on a TPU.** The "TPU" runs trained on the '
            "CPU with a tiny model (`" + " ".join(SHIM) + "`), the splash run with SDPA, and the topology "
            f"below is made up by `{SHIM_MODULE.replace('.', '/')}.py`; losses and times say nothing about a TPU. "
            "The runs, timeouts, failure capture, report and tarball are the real ones.",
            "",
        ]
    L += [
        f"- started {meta['started']}, finished {meta.get('finished', '-')}; commit {meta['git']}",
        f"- {meta['steps']} steps per run, log every step; global batch {meta['global_batch']} sequences on "
        f"every run ({meta['devices']} device(s): {meta['global_batch'] // max(meta['devices'], 1)} per device); "
        f"timeout {meta['timeout_s']:g} s per run unless noted",
        "- cache misses after step 3: torch-tpu's counter (`compile_cache_misses` in metrics.jsonl, TPU only) "
        f"/ log lines with `{pattern}` (torch-tpu's message) after the step-3 line (a resumed run: after its "
        "own third step)",
        "",
    ]
    return L


def _runs_table(runs: dict, stats: dict, logs: dict, pattern: str) -> list[str]:
    """## Runs: the status counts, one row per run (status, losses against its reference with a
    verdict, times, throughput, cache misses) and what the columns mean."""
    counts = {}
    for r in runs.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    L = ["## Runs", "", ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
    L += [
        "| run | what | status | steps | final loss | vs | Δ loss (rel.) | verdict | setup s | first step s | "
        "graph compile s | median step s | tokens/s/device | MFU % | cache misses after step 3 (counter / log) |",
        "|" + "---|" * 15,
    ]
    for name, r in runs.items():
        L.append(_run_row(name, r, stats, logs[name], pattern))
    L += [
        "",
        "Columns: *Δ loss* is the run's median loss over the last (up to 5) steps both runs logged minus "
        "its reference's, relative (resume: the largest per-step difference from the uninterrupted run). "
        f"*Verdict*: ok within {REL_TOL_VS_CPU:.0%} of the CPU reference (different initial weights: each "
        "device draws them from its own RNG; the spread that causes was measured on the CPU, docs/tpu.md), "
        f"within {REL_TOL_RESUME:g} for the resume (same device, state restored exactly); FAIL when the loss "
        "did not fall or was not finite. *setup s*: start to the first step; *first step s*: the first "
        "step including its compilation; *graph compile s*: graph mode's capture and compile; *median step "
        "s*, *tokens/s/device*, *MFU %*: medians over steps 3 and later (every step syncs to log, so "
        "these are upper bounds on step time).",
        "",
    ]
    return L


def _run_row(name: str, r: dict, stats: dict, log: str, pattern: str) -> str:
    """One run's row of the runs table."""
    s = stats[name]
    status = r["status"]
    if status == "failed":
        status = (f"failed (rc {r.get('rc')})" if r.get("rc") else "failed") + (
            f": {r['reason']}" if r.get("reason") else ""
        )
    elif status == "timed out":
        status = f"timed out after {r['timeout_s']:g} s"
    elif status in ("skipped", "not run"):
        status = f"{status}: {r['reason']}"
    verdict, rel = "-", None
    if r.get("ref") and s and r["ref"] in stats and stats[r["ref"]]:
        verdict, rel = compare(s, stats[r["ref"]], exact=r["exact"])
    third = s["first_step"] + 2 if s else 3  # step 3; a resumed run's own third step
    log_misses = cache_misses(log, pattern, after_step=third) if log else None
    misses = f"{_fmt(s.get('counter_misses'), 'd')} / {_fmt(log_misses, 'd')}"
    steps = f"{s['first_step']}-{s['last_step']}" if s else "-"
    return (
        f"| {name} | {r['what']} | {status} | {steps} | {_fmt(s.get('final_loss'))} | "
        f"{r.get('ref') or '-'} | {_fmt(rel, '+.2e') if r.get('exact') else _fmt(rel, '+.2%')} | {verdict} | "
        f"{_fmt(s.get('setup_s'), '.1f')} | {_fmt(s.get('first_step_s'), '.1f')} | "
        f"{_fmt(s.get('compile_s'), '.1f')} | {_fmt(s.get('median_step_s'), '.3f')} | "
        f"{_fmt(s.get('tokens_per_sec'), ',.0f')} | {_fmt(s.get('mfu_pct'), '.2f')} | "
        f"{misses} |"
    )


def _relaunch_sections(out: Path, runs: dict, stats: dict) -> list[str]:
    """## Compile cache: second launch, per relaunched run: the verdict line and both launches' misses."""
    L = []
    relaunches = [n for n, r in runs.items() if r.get("relaunch_of") in runs]
    for name in relaunches:
        first = runs[name]["relaunch_of"]
        records = {n: read_metrics(out / "runs" / n) for n in (first, name)}
        L += [
            "## Compile cache: second launch",
            "",
            f"**{relaunch_verdict(records[first], records[name])}**",
            "",
            f"`{name}` is `{first}` launched again on the persistent compilation cache `{first}` filled "
            f"(`[compile] cache_dir = {CACHE_FOLDER}/`, TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT), with a host "
            f"cache of its own (TORCH_TPU_TIER2_COMPILATION_CACHE under {TIER2_ROOT}), so what it did not "
            "compile came from the persistent folder. Misses are torch-tpu's counter (`compile_cache_misses` "
            "in metrics.jsonl, TPU only): *at start / at restart* from the process start through step 3, "
            "*after step 3* the rest; *compilations* is torch-tpu's own count of programs compiled "
            "(`compilations`, last step); a launch served by the cache should have few or none.",
            "",
            "| launch | run | status | misses through step 3 | misses after step 3 | compilations | "
            "first step s | graph compile s | persistent cache after (files, MB) | host cache after (files) |",
            "|" + "---|" * 10,
        ]
        for label, n in (("first", first), ("second", name)):
            s, r = stats[n], runs[n]
            t3, t2 = r.get("tier3_after"), r.get("tier2_after")
            L.append(
                f"| {label} | {n} | {r['status']} | {_fmt(s.get('misses_through_3'), 'd')} | "
                f"{_fmt(s.get('counter_misses'), 'd')} | {_fmt(s.get('compilations'), 'd')} | "
                f"{_fmt(s.get('first_step_s'), '.1f')} | {_fmt(s.get('compile_s'), '.1f')} | "
                + (f"{t3['files']}, {t3['bytes'] / 1e6:.1f}" if t3 else "none")
                + " | "
                + (str(t2["files"]) if t2 else "none")
                + " |"
            )
        L.append("")
    return L


def _resume_section(runs: dict, stats: dict) -> list[str]:
    """## Save and resume: the resumed run's losses step by step beside the uninterrupted run's."""
    if not ("resume" in runs and stats.get("resume") and stats.get("save")):
        return []
    a, b = stats["resume"]["losses"], stats["save"]["losses"]
    L = ["## Save and resume", "", "| step | save (uninterrupted) | resume | difference |", "|---|---|---|---|"]
    for step in sorted(set(a) & set(b)):
        diff = a[step] - b[step] if a[step] is not None and b[step] is not None else None
        L.append(f"| {step} | {_fmt(b[step], '.6f')} | {_fmt(a[step], '.6f')} | {_fmt(diff, '+.2e')} |")
    L.append("")
    return L


def _environment_section(out: Path, meta: dict) -> list[str]:
    """## Environment: env.txt and the launch environment the topology command printed."""
    return [
        "## Environment",
        "",
        "```",
        (out / "env.txt").read_text().strip(),
        "```",
        "",
        f"Topology: `python -m {SHIM_MODULE if meta['shim'] else 'torch.tpu.distributed'}` (exit {meta['launch_rc']}):",
        "",
        "```",
        _read(out / "launch_env.txt").strip() or "(no output)",
        "```",
        "",
    ]


def _flags_section(runs: dict, logs: dict) -> list[str]:
    """## Flags and start-up lines per run: each run's environment and command, exit, and the
    trainer's start-up lines."""
    L = ["## Flags and start-up lines per run", ""]
    for name, r in runs.items():
        L += [f"### {name}", ""]
        if "cmd" not in r:
            L += [f"not run: {r.get('reason', '-')}", ""]
            continue
        env = " ".join(f"{k}={v}" for k, v in r["env"].items())
        L += ["```", f"{env} \\", "  " + " ".join(r["cmd"]), "```", ""]
        L += [
            f"exit {r['rc'] if r.get('rc') is not None else 'none (killed)'}, {r.get('wall_s', '-')} s wall"
            + (f"; {r['reason']}" if r.get("reason") else ""),
            "",
        ]
        banner = banner_lines(logs[name])
        if banner:
            L += ["```", *banner, "```", ""]
    return L


def _unfinished_logs_section(runs: dict, logs: dict) -> list[str]:
    """## Logs of the runs that did not finish: their error lines and the tail of each log."""
    failed = [n for n, r in runs.items() if r["status"] in ("failed", "timed out")]
    L = ["## Logs of the runs that did not finish", ""]
    if not failed:
        L += ["none", ""]
    for name in failed:
        L += [f"### {name}: {runs[name]['status']}", ""]
        errors = error_lines(logs[name])
        if errors:
            L += ["Error lines anywhere in the log:", "", "```", *errors, "```", ""]
        L += [f"Last {TAIL_LINES} lines of runs/{name}.log:", "", "```", tail(logs[name]) or "(empty log)", "```", ""]
    return L


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""
