"""The TPU smoke run behind scripts/tpu_smoke.sh: each run under a timeout, one report.md, one tarball.

    python -m tools.tpu_smoke run [STEPS] [--out DIR] [--timeout S] [--run-timeout RUN=S]
                                  [--runs A,B] [--set RUN:--section.key=value] [--shim]
    python -m tools.tpu_smoke report DIR [--cache-miss-pattern TEXT]   # re-assemble DIR/report.md
    python -m tools.tpu_smoke multislice [--zone Z] [--accelerator v6e-8] [--slices 2] ...  # a plan, printed

`run` trains the debug recipes once on the CPU (the reference: bf16 parameters pinned, SDPA, plain
loss) and then on the TPU, one process per device under torchrun with the launch environment
that `python -m torch.tpu.distributed` prints, the same global batch as the CPU (RUNS lists what
each run changes). Every run has its own timeout, log and dump folder; a failed, killed or
skipped run never stops the next one. The report gives versions, topology, flags, and per run
its status, losses against its reference with a verdict, compile and step times, tokens/s, MFU,
the compilation-cache misses after step 3 and, for every run that did not finish, the tail of
its log; everything (report, logs, metrics, launch environment) goes into DIR.tar.gz. Two short
runs show the persistent compilation cache: `cache_cold` fills a fresh cache folder (DIR/
compile_cache), `cache_warm` relaunches the same run on it, and the report's verdict line says
how many programs the second launch still missed ("second launch: N misses after step 3, M at
restart").

`--shim` (what CI runs, tests/e2e/test_tpu_smoke.py): the "TPU" runs train on the CPU with a tiny
model and the aot_eager backend, the topology comes from tests/support/fake_tpu (TITAN_SMOKE_SHIM_DEVICES
devices, default 1), and no torch-tpu is needed; the runs, timeouts, failure capture, report
and tarball are the real ones.

This module imports no torch: the process that launches the TPU runs must not hold the chips.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[1]

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

DEFAULT_TIMEOUT_S = 1800
"""Per run: compilation of the debug recipes on a TPU takes minutes; a hang must not take hours."""
KILL_GRACE_S = 15
"""After a run's timeout: SIGTERM (torchrun stops its workers), this many seconds, then SIGKILL
to every process of the run still alive."""
TAIL_LINES = 40
"""Lines of a failed run's log quoted in the report."""
GLOBAL_BATCH = 8
"""Sequences per step of the CPU reference; the TPU runs split the same global batch over their
devices (rounded up to a multiple of the device count), so their losses see the same data."""
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

COMMON = [
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=false",
    "--training.mixed_precision_param=bfloat16",
]
"""Every run: a record per step, no validation or TensorBoard, bf16 parameters on both devices
(`auto` may pick fp32 on the CPU), no checkpoints unless the run is about them."""
PLAIN = ["--model.attn_backend=sdpa", "--training.fused_loss=off"]
"""The torch references for attention and the loss: the runs that test a mode stay clear of the
Pallas kernels, which have their own runs (the MoE experts take gmm on TPU whatever is set)."""
SHIM = ["--model.n_layers=2", "--training.seq_len=64", "--compile.backend=aot_eager"]
"""--shim: a tiny model and no Inductor, so CI's end-to-end run takes seconds per run."""
LLAMA, MOE, MLA = "configs/llama3_debug.toml", "configs/qwen3_moe_debug.toml", "configs/deepseek_v3_debug.toml"
SHIM_RECIPE = {MLA: ["--model.n_dense_layers=1"]}
"""--shim, per recipe: what SHIM's 2 layers need (DeepSeek V3: 1 dense block + 1 MoE block)."""
CACHE_STEPS = 6
"""Steps of the two compile-cache runs: past step 3, where the misses are counted from."""
CACHE_FOLDER = "compile_cache"
"""DIR/compile_cache: the persistent compilation cache (tier 3) of the compile-cache runs, fresh
for each smoke, left out of the tarball."""
TIER2_VAR, TIER2_ROOT = "TORCH_TPU_TIER2_COMPILATION_CACHE", Path("/dev/shm/torch_tpu_cache")
"""torch-tpu's host cache: a name under TIER2_ROOT (the root is a string in its binary). Each
compile-cache run gets a name of its own, so the relaunch cannot be served from the first
launch's host cache and what it loads comes from the persistent folder, as on a new host; the
smoke removes both folders after its runs."""


@dataclasses.dataclass
class Run:
    """One training run of the smoke."""

    name: str
    what: str
    recipe: str
    args: list[str]
    device: str = "tpu"
    """cpu: one process, the CPU reference; tpu: torchrun, one process per device."""
    ref: str | None = None
    """The run whose losses this one is compared with."""
    exact: bool = False
    """Compared with REL_TOL_RESUME (same device and state) instead of REL_TOL_VS_CPU."""
    min_devices: int = 1
    resume_of: str | None = None
    """Starts from this run's checkpoint at step `checkpoint_step` (copied into its folder)."""
    cp: int = 1
    """Context-parallel degree: the run sets it, and the device count must divide by it."""
    steps: int | None = None
    """At most this many steps (default: the smoke's STEPS)."""
    cache: bool = False
    """Uses the smoke's persistent compilation cache DIR/compile_cache and a host cache of its own."""
    relaunch_of: str | None = None
    """The second launch of this run on the same persistent cache (skipped if that one did not run)."""


def run_steps(run: Run, steps: int) -> int:
    """The steps `run` trains when the smoke's runs train `steps`."""
    return min(steps, run.steps) if run.steps else steps


def checkpoint_step(steps: int) -> int:
    """The step the save run checkpoints and the resume run starts from: half way."""
    return max(1, steps // 2)


def plan(steps: int) -> list[Run]:
    """The runs in order: the CPU references first, then the TPU runs."""
    k = checkpoint_step(steps)
    save = ["--checkpoint.enable=true", f"--checkpoint.interval={k}", "--checkpoint.keep_latest_k=0"]
    graph = ["--compile.mode=graph", "--compile.scan_layers=true"]
    doc = ["--training.document_mask=true"]
    # What the pod recipes run beyond the runs above: context parallelism (the 128k recipes: k/v
    # all-gather, each rank's own splash ops) and MLA attention with expert parallelism
    # (DeepSeek V3 / Kimi K2). Attention is splash there, as `auto` picks on a TPU.
    splash = [*PLAIN, *graph, "--model.attn_backend=splash"]
    return [
        Run("cpu", "Llama 3 debug, eager, CPU reference", LLAMA, PLAIN, device="cpu"),
        Run("cpu_moe", "Qwen 3 MoE debug, eager, CPU reference", MOE, PLAIN, device="cpu"),
        Run("cpu_doc", "Llama 3 debug, eager, document mask, CPU reference", LLAMA, [*PLAIN, *doc], device="cpu"),
        Run("cpu_mla", "DeepSeek V3 debug (MLA, MoE), eager, CPU reference", MLA, PLAIN, device="cpu"),
        Run("eager", "Llama 3 debug, eager", LLAMA, [*PLAIN, "--compile.mode=eager"], ref="cpu"),
        Run("compile", "Llama 3 debug, torch.compile per block", LLAMA, [*PLAIN, "--compile.mode=compile"], ref="cpu"),
        Run("graph_scan", "Llama 3 debug, graph mode, layer scan", LLAMA, [*PLAIN, *graph], ref="cpu"),
        Run(
            "ac_full",
            "graph_scan + full activation checkpointing",
            LLAMA,
            [*PLAIN, *graph, "--activation_checkpoint.mode=full"],
            ref="cpu",
        ),
        Run(
            "fused_loss",
            "graph_scan + the fused linear + cross-entropy kernel",
            LLAMA,
            [*PLAIN, *graph, "--training.fused_loss=on"],
            ref="cpu",
        ),
        Run(
            "splash", "graph_scan + splash attention", LLAMA, [*PLAIN, *graph, "--model.attn_backend=splash"], ref="cpu"
        ),
        Run(
            "moe_ep1",
            "Qwen 3 MoE debug, graph + scan, gmm experts, EP 1",
            MOE,
            [*PLAIN, *graph, "--parallelism.expert_parallel_degree=1"],
            ref="cpu_moe",
        ),
        Run(
            "moe_ep2",
            "Qwen 3 MoE debug, graph + scan, gmm experts, EP 2",
            MOE,
            [*PLAIN, *graph, "--parallelism.expert_parallel_degree=2"],
            ref="cpu_moe",
            min_devices=2,
        ),
        Run("save", f"graph_scan, checkpoints every {k} steps", LLAMA, [*PLAIN, *graph, *save], ref="cpu"),
        Run(
            "resume",
            f"resumes save's step-{k} checkpoint and continues",
            LLAMA,
            [*PLAIN, *graph, *save],
            ref="save",
            exact=True,
            resume_of="save",
        ),
        Run(
            "reload_cpu",
            f"save's step-{k} checkpoint, written in the TPU's device order, read in one CPU process "
            "(DCP's full tensors) and continued eagerly",
            LLAMA,
            [*PLAIN, *save],
            device="cpu",
            ref="resume",
            resume_of="save",
        ),
        Run(
            "cp2",
            "graph_scan + context parallel 2 (k/v all-gather, per-rank CP splash), splash attention",
            LLAMA,
            splash,
            ref="cpu",
            min_devices=2,
            cp=2,
        ),
        Run(
            "cp2_doc",
            "cp2 + document mask (CP splash with segment ids)",
            LLAMA,
            [*splash, *doc],
            ref="cpu_doc",
            min_devices=2,
            cp=2,
        ),
        Run(
            "mla_ep2",
            "DeepSeek V3 debug: MLA attention (splash), MoE, graph + scan, gmm experts, EP 2",
            MLA,
            [*splash, "--parallelism.expert_parallel_degree=2"],
            ref="cpu_mla",
            min_devices=2,
        ),
        Run(
            "cache_cold",
            f"graph_scan, {CACHE_STEPS} steps, fills a fresh persistent compile cache",
            LLAMA,
            [*PLAIN, *graph],
            steps=CACHE_STEPS,
            cache=True,
        ),  # graph_scan has the loss verdict
        Run(
            "cache_warm",
            "cache_cold launched again on its persistent compile cache",
            LLAMA,
            [*PLAIN, *graph],
            ref="cache_cold",
            exact=True,
            steps=CACHE_STEPS,
            cache=True,
            relaunch_of="cache_cold",
        ),
    ]


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


# ---------------------------------------------------------------------------------- running


def _descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (Linux /proc; empty elsewhere). torchrun starts its workers
    in their own sessions, so a process-group kill does not reach them."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            stat = entry.read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the run (torchrun forwards it), then SIGKILL what is left after KILL_GRACE_S."""
    tree = [proc.pid, *_descendants(proc.pid)]
    for pid in tree:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    for pid in [*tree, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def run_logged(cmd: list[str], *, env: dict[str, str], log: Path, timeout_s: float) -> tuple[int | None, float]:
    """Run `cmd` from the repository root with stdout and stderr in `log`; (exit code or None if
    it timed out and was killed, wall seconds)."""
    t0 = time.perf_counter()
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
        )
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill(proc)
            rc = None
            f.write(
                f"\n== tools.tpu_smoke: timed out after {timeout_s:g} s: SIGTERM, SIGKILL after "
                f"{KILL_GRACE_S} s\n".encode()
            )
        except KeyboardInterrupt:  # Ctrl-C: stop this run's processes too, then the caller reports
            _kill(proc)
            f.write(b"\n== tools.tpu_smoke: interrupted (Ctrl-C)\n")
            raise
    return rc, time.perf_counter() - t0


def _topology_cmd(shim: bool) -> list[str]:
    module = "tests.support.fake_tpu.distributed" if shim else "torch.tpu.distributed"
    return [sys.executable, "-m", module]


def topology(out: Path, *, shim: bool, env: dict[str, str], name: str = "launch_env") -> tuple[int | None, dict]:
    """Run the launch-environment command into OUT/<name>.txt; (its exit code, the variables)."""
    path = out / f"{name}.txt"
    rc, _ = run_logged(_topology_cmd(shim), env={**env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}, log=path, timeout_s=300)
    return rc, parse_launch_env(path.read_text())


def _launch(run: Run, nproc: int) -> list[str]:
    if run.device == "cpu":
        return [sys.executable, "-m", "trainer.train"]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "trainer.train",
    ]


def command(
    run: Run, *, steps: int, nproc: int, global_batch: int, out: Path, shim: bool, extra: list[str]
) -> list[str]:
    """The full command line of `run` (what the report records as its flags)."""
    procs = 1 if run.device == "cpu" else nproc
    device = "cpu" if run.device == "cpu" or shim else "tpu"
    args = list(run.args)
    if shim:  # no splash off the TPU: the shim's splash run checks the plumbing with SDPA
        args = [a if a != "--model.attn_backend=splash" else "--model.attn_backend=sdpa" for a in args]
    if run.cp > 1:  # cp ranks share their data-parallel rank's sequences: dp = procs / cp
        args.append(f"--parallelism.context_parallel_degree={run.cp}")
    if run.cache:
        args.append(f"--compile.cache_dir={out / CACHE_FOLDER}")
    return [
        *_launch(run, procs),
        "--config",
        run.recipe,
        f"--training.steps={run_steps(run, steps)}",
        *COMMON,
        *([*SHIM, *SHIM_RECIPE.get(run.recipe, [])] if shim else []),
        *args,
        f"--device.type={device}",
        f"--training.local_batch_size={global_batch * run.cp // procs}",
        f"--job.dump_folder={out / 'runs' / run.name}",
        *extra,
    ]


def run_all(args: argparse.Namespace) -> int:
    out: Path = args.out
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True)
    base_env = dict(os.environ)
    base_env.setdefault("PYTHONUNBUFFERED", "1")
    started = time.time()
    write_environment(out, base_env)

    rc, launch = topology(out, shim=args.shim, env=base_env)
    nnodes = int(launch.get("NNODES") or 1)
    nproc = int(launch.get("WORLD_SIZE") or 0) if rc == 0 else 0
    if rc == 0 and nnodes > 1:
        cli.error_line(
            f"tpu_smoke.sh runs on one host; this slice has NNODES={nnodes} hosts "
            "(use a single-host slice, e.g. v6e-8 or v5litepod-8)"
        )
        return 2
    global_batch = GLOBAL_BATCH if nproc <= 1 else -(-GLOBAL_BATCH // nproc) * nproc
    selected = plan(args.steps)
    if args.runs:
        selected = [r for r in selected if r.name in args.runs]
    meta = {
        "steps": args.steps,
        "timeout_s": args.timeout,
        "shim": args.shim,
        "devices": nproc,
        "global_batch": global_batch,
        "checkpoint_step": checkpoint_step(args.steps),
        "cache_miss_pattern": CACHE_MISS_PATTERN,
        "started": _utc(started),
        "launch_rc": rc,
        "python": sys.executable,
        "git": _git(),
        "runs": {},
    }
    for run in selected:
        meta["runs"][run.name] = {
            "what": run.what,
            "device": run.device,
            "ref": run.ref,
            "exact": run.exact,
            "recipe": run.recipe,
            "steps": run_steps(run, args.steps),
            "relaunch_of": run.relaunch_of,
            "status": "not run",
            "reason": "not reached",
        }
    # Ctrl-C must reach us as KeyboardInterrupt even when this process started with SIGINT
    # ignored (a background job of a non-interactive shell, a pytest-xdist worker's child):
    # Python installs its handler only where SIGINT was not ignored at start-up.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for run in selected:
            _one(run, meta, args=args, out=out, base_env=base_env, launch_rc=rc, nproc=nproc)
            (out / "smoke.json").write_text(json.dumps(meta, indent=1) + "\n")  # `report` works mid-way
    except KeyboardInterrupt:
        print("interrupted: writing the report of the runs so far", file=sys.stderr)
        for r in meta["runs"].values():
            if r["status"] == "running":
                r.update(status="failed", reason="interrupted (Ctrl-C)", rc=None)
            elif r["status"] == "not run":
                r["reason"] = "interrupted before it started"
    finally:  # the compile-cache runs' host caches live in /dev/shm (memory): ours, named per run
        for r in meta["runs"].values():
            if r.get("tier2"):
                shutil.rmtree(TIER2_ROOT / r["tier2"], ignore_errors=True)
    meta["finished"] = _utc(time.time())
    (out / "smoke.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "report.md").write_text(render_report(out))
    tarball = pack(out)
    print(f"report: {out / 'report.md'}", file=sys.stderr)
    print(f"tarball: {tarball}", file=sys.stderr)
    return 0


def _one(
    run: Run,
    meta: dict,
    *,
    args: argparse.Namespace,
    out: Path,
    base_env: dict[str, str],
    launch_rc: int | None,
    nproc: int,
) -> None:
    """Run one of the smoke's runs (or skip it), recording what happened in meta["runs"]."""
    runs_dir, rc, global_batch = out / "runs", launch_rc, meta["global_batch"]
    result = meta["runs"][run.name]
    timeout_s = args.run_timeout.get(run.name, args.timeout)
    result["timeout_s"] = timeout_s
    skip = None
    if run.device == "tpu" and rc != 0:
        skip = f"no launch environment (`{' '.join(_topology_cmd(args.shim)[1:])}` exited {rc}; launch_env.txt)"
    elif run.device == "tpu" and nproc < run.min_devices:
        skip = f"needs {run.min_devices} devices, this host has {nproc}"
    elif run.device == "tpu" and nproc % run.cp:
        skip = f"context parallel {run.cp} needs a device count divisible by {run.cp}, this host has {nproc}"
    elif run.relaunch_of is not None and meta["runs"].get(run.relaunch_of, {}).get("status") in (
        None,
        "skipped",
        "not run",
    ):
        skip = f"relaunches {run.relaunch_of}, which did not run"
    elif run.resume_of is not None:
        src = runs_dir / run.resume_of / "checkpoints" / f"step-{checkpoint_step(args.steps)}"
        if not src.is_dir():
            skip = f"{run.resume_of} left no checkpoint {src.relative_to(out)}"
        else:
            shutil.copytree(src, runs_dir / run.name / "checkpoints" / src.name)
    if skip:
        result.update(status="skipped", reason=skip)
        print(f"== {run.name}: skipped ({skip})", file=sys.stderr, flush=True)
        return
    env = {**base_env, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1" if run.device == "tpu" and not args.shim else "0"}
    set_env = {"TORCH_DEVICE_BACKEND_AUTOLOAD": env["TORCH_DEVICE_BACKEND_AUTOLOAD"]}
    if run.cache:  # a host cache of its own (TIER2_ROOT), the persistent one shared: DIR/compile_cache
        result["tier2"] = set_env[TIER2_VAR] = env[TIER2_VAR] = re.sub(
            r"[^A-Za-z0-9_.-]", "-", f"titan-smoke-{out.name}-{run.name}"
        )
    if run.device == "tpu":  # fresh ports for each run: a killed run's may still be held
        trc, launch_run = topology(runs_dir, shim=args.shim, env=base_env, name=f"{run.name}.launch_env")
        if trc != 0:
            result.update(
                status="skipped",
                reason=f"the launch environment failed this time (exit {trc}; runs/{run.name}.launch_env.txt)",
            )
            return
        env.update(launch_run)
        set_env.update(launch_run)
    cmd = command(
        run,
        steps=args.steps,
        nproc=nproc,
        global_batch=global_batch,
        out=out,
        shim=args.shim,
        extra=args.set.get(run.name, []),
    )
    result.update(cmd=["python", *cmd[1:]], env=set_env, status="running", reason=None)
    print(f"== {run.name}: {run.what} (timeout {timeout_s:g} s)", file=sys.stderr, flush=True)
    code, wall = run_logged(cmd, env=env, log=runs_dir / f"{run.name}.log", timeout_s=timeout_s)
    result.update(
        rc=code, wall_s=round(wall, 1), status="timed out" if code is None else ("ok" if code == 0 else "failed")
    )
    if run.cache:  # what each launch left in the caches: written at all, and by which tier
        result["tier3_after"] = folder_stats(out / CACHE_FOLDER)
        result["tier2_after"] = folder_stats(TIER2_ROOT / result["tier2"])
    print(f"   {result['status']}" + (f" (rc {code})" if code else "") + f", {wall:.0f} s", file=sys.stderr, flush=True)


def folder_stats(folder: Path) -> dict | None:
    """{"files": n, "bytes": b} of everything under `folder`, or None if there is no such folder."""
    if not folder.is_dir():
        return None
    files = [f for f in folder.rglob("*") if f.is_file()]
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}


def _utc(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _git() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (" (with local changes)" if dirty else "")


FLAG_VARS = re.compile(
    r"^(LIBTPU_INIT_ARGS|XLA_FLAGS|JAX_PLATFORMS|JAX_.*|TPU_.*|TORCH_TPU_.*|PJRT_.*|"
    r"TORCH_DEVICE_BACKEND_AUTOLOAD|OMP_NUM_THREADS|TITAN_.*)$"
)
"""Environment variables the report records: what libtpu, XLA, JAX and torch-tpu read."""


def write_environment(out: Path, env: dict[str, str]) -> None:
    """OUT/pip_freeze.txt and OUT/env.txt (python, host, the flag variables)."""
    freeze = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True, timeout=300)
    if freeze.returncode == 0:
        text = freeze.stdout
    else:  # a venv made by uv has no pip: the same list from the installed distributions
        dists = {(d.metadata["Name"] or "?"): d.version for d in importlib.metadata.distributions()}
        text = "# pip not in this venv: from importlib.metadata\n" + "".join(
            f"{n}=={v}\n" for n, v in sorted(dists.items(), key=lambda kv: kv[0].lower())
        )
    (out / "pip_freeze.txt").write_text(text)
    lines = [
        f"python {platform.python_version()} ({sys.executable})",
        f"host {platform.node()}",
        f"platform {platform.platform()}",
        f"cpus {os.cpu_count()}",
    ]
    lines += [f"{k}={v}" for k, v in sorted(env.items()) if FLAG_VARS.match(k)]
    (out / "env.txt").write_text("\n".join(lines) + "\n")


def pack(out: Path) -> Path:
    """OUT.tar.gz with everything in OUT but the checkpoints (the metrics carry what they showed)."""
    tarball = out.with_name(out.name + ".tar.gz")

    def keep(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
        return None if "/checkpoints" in info.name or f"/{CACHE_FOLDER}" in info.name else info

    with tarfile.open(tarball, "w:gz") as tar:
        tar.add(out, arcname=out.name, filter=keep)
    return tarball


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
    stats, logs = {}, {}
    for name, r in runs.items():
        log = out / "runs" / f"{name}.log"
        logs[name] = log.read_text(errors="replace") if log.is_file() else ""
        stats[name] = summarize(read_metrics(out / "runs" / name))
        if r.get("status") == "ok" and stats[name].get("last_step") != r.get("steps", meta["steps"]):
            r["status"] = "failed"
            r["reason"] = f"exit 0 but metrics.jsonl ends at step {stats[name].get('last_step')}"

    L = ["# TPU smoke report", ""]
    if meta["shim"]:
        L += [
            '**Fake TPU shim (`--shim`, CI): nothing here ran on a TPU.** The "TPU" runs trained on the '
            "CPU with a tiny model (`" + " ".join(SHIM) + "`), the splash run with SDPA, and the topology "
            "below is made up by `tests/support/fake_tpu/distributed.py`; losses and times say nothing about a TPU. "
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

    counts = {}
    for r in runs.values():
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    L += ["## Runs", "", ", ".join(f"{n} {s}" for s, n in counts.items()), ""]
    L += [
        "| run | what | status | steps | final loss | vs | Δ loss (rel.) | verdict | setup s | first step s | "
        "graph compile s | median step s | tokens/s/device | MFU % | cache misses after step 3 (counter / log) |",
        "|" + "---|" * 15,
    ]
    for name, r in runs.items():
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
        log_misses = cache_misses(logs[name], pattern, after_step=third) if logs[name] else None
        misses = f"{_fmt(s.get('counter_misses'), 'd')} / {_fmt(log_misses, 'd')}"
        steps = f"{s['first_step']}-{s['last_step']}" if s else "-"
        L.append(
            f"| {name} | {r['what']} | {status} | {steps} | {_fmt(s.get('final_loss'))} | "
            f"{r.get('ref') or '-'} | {_fmt(rel, '+.2e') if r.get('exact') else _fmt(rel, '+.2%')} | {verdict} | "
            f"{_fmt(s.get('setup_s'), '.1f')} | {_fmt(s.get('first_step_s'), '.1f')} | "
            f"{_fmt(s.get('compile_s'), '.1f')} | {_fmt(s.get('median_step_s'), '.3f')} | "
            f"{_fmt(s.get('tokens_per_sec'), ',.0f')} | {_fmt(s.get('mfu_pct'), '.2f')} | "
            f"{misses} |"
        )
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

    if "resume" in runs and stats.get("resume") and stats.get("save"):
        a, b = stats["resume"]["losses"], stats["save"]["losses"]
        L += ["## Save and resume", "", "| step | save (uninterrupted) | resume | difference |", "|---|---|---|---|"]
        for step in sorted(set(a) & set(b)):
            diff = a[step] - b[step] if a[step] is not None and b[step] is not None else None
            L.append(f"| {step} | {_fmt(b[step], '.6f')} | {_fmt(a[step], '.6f')} | {_fmt(diff, '+.2e')} |")
        L.append("")

    L += [
        "## Environment",
        "",
        "```",
        (out / "env.txt").read_text().strip(),
        "```",
        "",
        f"Topology: `{'python -m tests.support.fake_tpu.distributed' if meta['shim'] else 'python -m torch.tpu.distributed'}` "
        f"(exit {meta['launch_rc']}):",
        "",
        "```",
        _read(out / "launch_env.txt").strip() or "(no output)",
        "```",
        "",
    ]

    L += ["## Flags and start-up lines per run", ""]
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

    failed = [n for n, r in runs.items() if r["status"] in ("failed", "timed out")]
    L += ["## Logs of the runs that did not finish", ""]
    if not failed:
        L += ["none", ""]
    for name in failed:
        L += [f"### {name}: {runs[name]['status']}", ""]
        errors = error_lines(logs[name])
        if errors:
            L += ["Error lines anywhere in the log:", "", "```", *errors, "```", ""]
        L += [f"Last {TAIL_LINES} lines of runs/{name}.log:", "", "```", tail(logs[name]) or "(empty log)", "```", ""]

    L += ["## pip freeze", "", "```", _read(out / "pip_freeze.txt").strip(), "```", ""]
    return "\n".join(L)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.is_file() else ""


# ---------------------------------------------------------------------------------- command line


class _Fail(Exception):
    """Bad input: one `error:` line, exit 2."""


def _run_timeouts(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            raise _Fail(f"--run-timeout {item!r}: expected RUN=SECONDS") from None
        if out[name] <= 0:
            raise _Fail(f"--run-timeout {item!r}: seconds must be > 0")
    return out


def _sets(items: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, arg = item.partition(":")
        if not sep or not arg.startswith("--"):
            raise _Fail(f"--set {item!r}: expected RUN:--section.key=value")
        out.setdefault(name, []).append(arg)
    return out


# --- --multislice: the plan of a first 2-slice run ------------------------------------------------

MULTISLICE_RECIPE = LLAMA
MULTISLICE_RUNTIME = {"v6e": "v2-alpha-tpuv6e", "v5litepod": "v2-alpha-tpuv5-lite", "v5p": "v2-alpha-tpuv5"}
"""TPU VM software versions by generation (Cloud TPU's documented runtime images)."""


def multislice_plan(args: argparse.Namespace) -> str:
    """The commands, in order, for the owner of two small slices to check a multislice start
    (docs/launch.md, "Several slices"): what a CPU cannot tell is which rank torch-tpu indexes its
    per-slice slice-builder address list with, and whether libtpu's MegaScale client forms with the
    coordinator the launcher exports. Printed, never run here."""
    name, zone, acc, n = args.name, args.zone, args.accelerator, args.slices
    project = f" --project {args.project}" if args.project else ""
    runtime = args.runtime_version or MULTISLICE_RUNTIME.get(acc.split("-")[0], "RUNTIME_VERSION")
    where = f"{name} --zone {zone}{project}"
    ssh = f"gcloud compute tpus queued-resources ssh {where} --node=all --worker=all"
    train = (
        f"--config {MULTISLICE_RECIPE} --training.steps={args.steps} "
        f"--parallelism.data_parallel_replicate_degree={n} --parallelism.data_parallel_shard_degree=-1 "
        f"{' '.join(COMMON)} --job.dump_folder=outputs/multislice_smoke"
    )
    repo = args.repo
    return "\n".join(
        [
            f"plan only (nothing was run here): a first multislice run on {n} x {acc} "
            f"(queued resource {name}, zone {zone}), for the owner of the slices to run step by step.",
            "It answers what no CPU test can: which rank torch-tpu indexes its per-slice slice-builder address "
            "list with, and whether libtpu's MegaScale client forms with the coordinator the launcher exports.",
            "",
            f"1. Create {n} slices as one queued resource (each node a slice):",
            f"   gcloud compute tpus queued-resources create {where} --node-count {n} --node-prefix {name} "
            f"--accelerator-type {acc} --runtime-version {runtime}",
            f"   gcloud compute tpus queued-resources describe {where}   # until ACTIVE",
            "2. The same checkout at the same path on every host, and the TPU venv (Python 3.11, torch-tpu, gcsfs):",
            f"   {ssh} --command 'git clone REPO_URL {repo} && cd {repo} && source scripts/env.sh tpu'",
            f"3. One slice at a time first (optional, single host): {ssh} --command "
            f"'cd {repo} && scripts/tpu_smoke.sh --runs cpu,eager'",
            "4. Every process's view, without training: each host prints its plan, its MegaScale variables (the "
            "coordinator with a port, MEGASCALE_PORT unset) and one '# process' line per device with its RANK "
            "and slice_builder[i] entry:",
            f"   {ssh} --command 'cd {repo} && bash scripts/launch_pod.sh host tpu --platform tpu-vm --dry-run -- "
            f"{train}'",
            f"5. The run ({args.steps} steps, HSDP: one replica per slice, FSDP inside each; no checkpoints):",
            f"   cd {repo} && scripts/launch_pod.sh qr {name} {zone}{' ' + args.project if args.project else ''} -- "
            f"{train}",
            "   Look for: every host's 'launch: tpu-vm: node R/N, ... slice S/" + str(n) + "' line; step lines "
            "from rank 0. On a failure: 'invalid world_size configuration' or a hang before step 1 (possibly torch-tpu "
            "indexing its slice-builder list by the global RANK rather than the place in the slice), or a MegaScale "
            "error naming the coordinator. Send back every host's output.",
            "6. Delete the slices:",
            f"   gcloud compute tpus queued-resources delete {where} --force --async",
        ]
    )


def parse_multislice(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(
        prog="scripts/tpu_smoke.sh --multislice",
        description="Print the plan of a first multislice run (2 x v6e-8 by default) for the owner of the "
        "slices; nothing is run here.",
    )
    p.add_argument("--name", default="titan-multislice", help="the queued resource's name (default %(default)s)")
    p.add_argument("--zone", default="ZONE", help="its zone, e.g. us-east5-b")
    p.add_argument("--project", default="", help="the Google Cloud project (default: gcloud's)")
    p.add_argument("--accelerator", default="v6e-8", help="each slice's type (default %(default)s: one host)")
    p.add_argument("--slices", type=int, default=2, help="how many slices (default %(default)s)")
    p.add_argument("--runtime-version", default="", help="the TPU VM image (default: by generation)")
    p.add_argument("--steps", type=int, default=20, help="training steps (default %(default)s)")
    p.add_argument("--repo", default="titan-tpu", help="the checkout's path on every host (default %(default)s)")
    args = p.parse_args(argv)
    if args.slices < 2:
        raise _Fail(f"--slices: {args.slices}; allowed: 2 or more (a multislice run)")
    if args.steps < 1:
        raise _Fail(f"--steps: {args.steps}; allowed: >= 1")
    return args


def parse(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(prog="python -m tools.tpu_smoke", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="train every run, write report.md and the tarball")
    r.add_argument("steps", nargs="?", type=int, default=None, help="steps per run (default 20; --shim 5)")
    r.add_argument(
        "--out", type=Path, default=None, help="new folder for everything (default outputs/tpu_smoke/<UTC time>)"
    )
    r.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per run (default %(default)s)")
    r.add_argument("--run-timeout", action="append", default=[], metavar="RUN=S", help="one run's timeout")
    r.add_argument("--runs", default="", help="comma-separated subset of: " + ", ".join(x.name for x in plan(2)))
    r.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="RUN:--KEY=VALUE",
        help="one more trainer override for one run (repeatable)",
    )
    r.add_argument(
        "--shim",
        action="store_true",
        default=os.environ.get("TITAN_SMOKE_SHIM") == "1",
        help="fake TPU: CPU runs, tiny model, made-up topology (CI; also TITAN_SMOKE_SHIM=1)",
    )
    rep = sub.add_parser("report", help="re-assemble DIR/report.md from DIR")
    rep.add_argument("dir", type=Path)
    rep.add_argument("--cache-miss-pattern", default=CACHE_MISS_PATTERN)
    args = p.parse_args(argv)
    if args.cmd == "report":
        if not (args.dir / "smoke.json").is_file():
            raise _Fail(f"{args.dir}: no smoke.json there (not a folder `tools.tpu_smoke run` wrote)")
        return args
    names = [x.name for x in plan(2)]
    args.steps = args.steps if args.steps is not None else (5 if args.shim else 20)
    if args.steps < 4:
        raise _Fail(f"steps: {args.steps} is too few; allowed: >= 4 (cache misses are counted after step 3)")
    if args.timeout <= 0:
        raise _Fail(f"--timeout: {args.timeout:g} must be > 0 seconds")
    args.runs = [x for x in args.runs.split(",") if x]
    args.run_timeout, args.set = _run_timeouts(args.run_timeout), _sets(args.set)
    for name in [*args.runs, *args.run_timeout, *args.set]:
        if name not in names:
            raise _Fail(f"run {name!r} is not one of the smoke's runs; allowed: {', '.join(names)}")
    if args.out is None:
        args.out = (
            ROOT / "outputs" / "tpu_smoke" / datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        )
    args.out = args.out.resolve()
    if args.out.exists() and any(args.out.iterdir()):
        raise _Fail(
            f"--out {args.out}: exists and is not empty (a run there would resume its checkpoints); "
            "allowed: a new or empty folder"
        )
    if not args.shim:
        if sys.version_info[:2] != (3, 11):
            raise _Fail(
                f"python {platform.python_version()} ({sys.executable}): torch-tpu 0.2.0 is cp311 only; "
                "allowed: a Python 3.11 venv (scripts/env.sh tpu makes one)"
            )
        if importlib.util.find_spec("torch_tpu") is None:
            raise _Fail(
                f"torch-tpu is not installed in {sys.prefix}; install it with `source scripts/env.sh tpu` "
                "on the TPU VM (or run with --shim to check the script on a CPU)"
            )
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["multislice"]:  # scripts/tpu_smoke.sh --multislice: a plan, printed
        try:
            print(multislice_plan(parse_multislice(argv[1:])))
        except _Fail as e:
            cli.error_line(str(e))
            return 2
        return 0
    try:
        args = parse(argv)
    except _Fail as e:  # a bad flag: ConfigError (or a plain exit 2 without torch), through cli.run
        cli.error_line(str(e))
        return 2
    if args.cmd == "report":
        (args.dir / "report.md").write_text(render_report(args.dir, args.cache_miss_pattern))
        print(f"report: {args.dir / 'report.md'}", file=sys.stderr)
        return 0
    return run_all(args)


if __name__ == "__main__":
    sys.exit(cli.run(main))
