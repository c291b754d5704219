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
model and the aot_eager backend, the topology comes from tools/tpu_smoke_shim.py (TITAN_SMOKE_SHIM_DEVICES
devices, default 1), and no torch-tpu is needed; the runs, timeouts, failure capture, report
and tarball are the real ones.

The logs' counting and parsing and report.md are tools/tpu_smoke_report.py.

This module imports no torch: the process that launches the TPU runs must not hold the chips.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from tools.tpu_smoke_report import (  # noqa: F401  (the report's names, read here by tests and docs)
    CACHE_FOLDER,
    CACHE_MISS_PATTERN,
    LAST_STEPS,
    REL_TOL_RESUME,
    REL_TOL_VS_CPU,
    SHIM,
    SHIM_MODULE,
    TAIL_LINES,
    TIER2_ROOT,
    TIER2_VAR,
    TRAINER_MISS_LINE,
    banner_lines,
    cache_misses,
    compare,
    counter_misses,
    error_lines,
    misses_through,
    parse_launch_env,
    read_metrics,
    relaunch_verdict,
    render_report,
    summarize,
    tail,
)
from trainer.runtime import cli

ROOT = Path(__file__).resolve().parents[1]

DEFAULT_TIMEOUT_S = 1800
"""Per run: compilation of the debug recipes on a TPU takes minutes; a hang must not take hours."""
KILL_GRACE_S = 15
"""After a run's timeout: SIGTERM (torchrun stops its workers), this many seconds, then SIGKILL
to every process of the run still alive."""
GLOBAL_BATCH = 8
"""Sequences per step of the CPU reference; the TPU runs split the same global batch over their
devices (rounded up to a multiple of the device count), so their losses see the same data."""
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
LLAMA, MOE, MLA = "configs/llama3_debug.toml", "configs/qwen3_moe_debug.toml", "configs/deepseek_v3_debug.toml"
SHIM_RECIPE = {MLA: ["--model.n_dense_layers=1"]}
"""--shim, per recipe: what SHIM's 2 layers need (DeepSeek V3: 1 dense block + 1 MoE block)."""
CACHE_STEPS = 6
"""Steps of the two compile-cache runs: past step 3, where the misses are counted from."""


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
    graph = ["--compile.mode=graph", "--compile.scan_layers=true"]
    doc = ["--training.document_mask=true"]
    return [
        *_reference_runs(doc),
        *_mode_runs(graph),
        *_checkpoint_runs(k, graph),
        *_pod_runs(graph, doc),
        *_cache_runs(graph),
    ]


def _reference_runs(doc: list[str]) -> list[Run]:
    """The CPU references: the dense, MoE, document-mask and MLA debug recipes, eager."""
    return [
        Run("cpu", "Llama 3 debug, eager, CPU reference", LLAMA, PLAIN, device="cpu"),
        Run("cpu_moe", "Qwen 3 MoE debug, eager, CPU reference", MOE, PLAIN, device="cpu"),
        Run("cpu_doc", "Llama 3 debug, eager, document mask, CPU reference", LLAMA, [*PLAIN, *doc], device="cpu"),
        Run("cpu_mla", "DeepSeek V3 debug (MLA, MoE), eager, CPU reference", MLA, PLAIN, device="cpu"),
    ]


def _mode_runs(graph: list[str]) -> list[Run]:
    """Llama 3 in each step mode and with each kernel, and the MoE debug recipe at EP 1 and 2."""
    return [
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
    ]


def _checkpoint_runs(k: int, graph: list[str]) -> list[Run]:
    """Save every `k` steps, resume from step `k`, and read that checkpoint back on the CPU."""
    save = ["--checkpoint.enable=true", f"--checkpoint.interval={k}", "--checkpoint.keep_latest_k=0"]
    return [
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
    ]


def _pod_runs(graph: list[str], doc: list[str]) -> list[Run]:
    """What the pod recipes run beyond the runs above: context parallelism (the 128k recipes: k/v
    all-gather, each rank's own splash ops) and MLA attention with expert parallelism
    (DeepSeek V3 / Kimi K2). Attention is splash there, as `auto` picks on a TPU."""
    splash = [*PLAIN, *graph, "--model.attn_backend=splash"]
    return [
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
    ]


def _cache_runs(graph: list[str]) -> list[Run]:
    """A run that fills a fresh persistent compile cache, and its relaunch on that cache."""
    return [
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
    module = SHIM_MODULE if shim else "torch.tpu.distributed"
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
        from tools.tpu_multislice import main as multislice_main

        return multislice_main(argv[1:], recipe=LLAMA, common=COMMON)
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
