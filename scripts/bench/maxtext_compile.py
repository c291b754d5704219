#!/usr/bin/env python
"""MaxText's own train step compiled deviceless here and projected by our projector: the
calibration of tools/xla_projection.py against MaxText's published TPU runs (docs/maxtext_calibration.md).

    scripts/xla_env.sh maxtext                     # once: maxtext[tpu] 0.2.5, jax 0.11.1, libtpu 0.0.46
    nice python scripts/bench/maxtext_compile.py --until hlo      # all five runs, stopped at the optimized HLO
    nice python scripts/bench/maxtext_compile.py --runs llama3.1-8b_v6e-256   # one run, the whole compile
    python scripts/bench/maxtext_compile.py --table-only           # re-read the kept compiles (--keep)

Per run (`RUNS`: each published MaxText run at its published settings: per-device batch, remat
policy and offloads, splash blocks, XLA flags, from AI-Hypercomputer/tpu-recipes), a worker in the
`maxtext` venv (scripts/bench/maxtext_worker.py) calls MaxText's AOT path,
`maxtext.trainers.pre_train.train_compile` with `compile_topology=<slice>` and
`compile_topology_num_slices=1`, in tools/deviceless_env.py's environment, the run's XLA flags in
LIBTPU_INIT_ARGS (as the recipe sets them on the TPU VMs) and XLA's dump of the optimized HLO
(`XLA_FLAGS=--xla_dump_to`, as scripts/mfu_suite.py's projections). The dumped per-device program
goes through the same bound as the trainer's own program (tools/mfu_projection.py `program_bound`:
per-op roofline of the XLA ops, loop bodies times their trip counts, each collective priced where
MaxText's mesh puts its group on the torus), with two MaxText-specific inputs: the model FLOPs are
MaxText's own (`calculate_tflops_training_per_device`, what its TFLOP/s log line and the published
MFU count: causal attention halved), and its attention kernels (Mosaic custom calls) are charged
MaxText's attention FLOPs x 7/6 (the fused backward recomputes the scores: 7 matmuls per 6 counted),
whatever estimate the kernel carries; the MoE runs' gmm kernels by their own cost estimate. The
predicted step time and MFU, both ways (exposed = compute + collectives, overlapped = the larger),
are set beside the published MFU, as printed and re-expressed at the compiled MaxText's FLOPs. The
headline is one predicted step (`project_run`'s `step_s`): the program walked in XLA's schedule
(tools/xla_schedule.py via tools/xla_projection.scheduled: async collectives and host offload on
their links, overlapped as scheduled), each op at MXU_EFFICIENCY of the peak (docs/maxtext_calibration.md).

Output (under --out, default docs/results/maxtext_calibration_<date>_<commit>): .csv and .md, the
table with versions, the CPU and each compile's wall time. Exit 0; 1 when a run failed to compile
(its row says why); 2 bad input.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

# the published runs (settings, XLA flags, anchors) live in tools/maxtext_runs.py; their names stay
# importable from here, where scripts/bench and the tests have read them
from tools.maxtext_runs import (  # noqa: F401
    CF_FOR_ALL_GATHER,
    CF_FOR_ALL_GATHER_LIBTPU_0046,
    DATA_PARALLEL_OVERLAP,
    DENSE_VMEM_LIMIT_FLAG,
    ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE,
    HOST_OFFLOAD_FLAGS,
    LAYOUT_FOR_ALL_REDUCE_SCATTER,
    MOE_DEVIATION,
    RUNS,
    SPLASH_2048,
    TRILLIUM_COMMON,
    V6E_DEVIATION,
    Run,
    write_tables,
)

ROOT = Path(__file__).resolve().parents[2]


MAXTEXT_VENV_KIND = "maxtext"
ATTENTION_KERNEL_FACTOR = 7 / 6
"""Splash's FLOPs over MaxText's count of attention (3 x forward): forward 2 matmuls, fused backward 5
(the scores recomputed, dP, dV, dQ, dK), against the 2 + 4 of the 3 x forward convention."""


# ------------------------------------------------------------------------------ pure parts (tested)


def pick_hlo(dump: Path) -> Path | None:
    """The train step's optimized HLO in an XLA dump folder: the largest `*.after_optimizations.txt`
    whose module name has `train_step` (else the largest of all); None when there is none."""
    found = sorted(dump.glob("*after_optimizations.txt"), key=lambda p: p.stat().st_size, reverse=True)
    step = [p for p in found if "train_step" in p.name]
    return (step or found or [None])[0]


def hlo_mesh(text: str) -> list[int] | None:
    """The axis sizes of the `replica_groups=mesh[...]` declaration most of the program's collectives
    name (XLA numbers its axes `axis_0`, `axis_1`, ... over the logical device ids, row-major, which
    are the MaxText mesh's devices in flat order); None when there is none. A collective over another
    declaration (the 405B program: 4 of 70) is priced on its group size over one torus dim."""
    decls = re.findall(r"replica_groups=mesh\[([^\]]*)\]", text)
    if not decls:
        return None
    most = max(set(decls), key=decls.count)
    sizes = re.findall(r"'axis_(\d+)'=(\d+)", most)
    return [int(n) for _, n in sorted(sizes, key=lambda t: int(t[0]))] or None


def host_transfer_bytes(hlo) -> float:
    """Bytes per step between HBM and host memory (layout memory space S(5)): the slices the
    offloaded activations' dynamic-update-slices write to host buffers and the dynamic-slices read
    back, times their loop's trips. The projector's compute counts neither (not HBM traffic); they
    ride on PCIe, which it does not price."""
    from tools import xla_hlo

    total = 0.0
    for comp, times in xla_hlo.executed(hlo):
        for ins in comp.instrs:
            if ins.opcode == "dynamic-update-slice" and "S(5)" in ins.shape and len(ins.operands) > 1:
                total += times * xla_hlo.array_bytes(xla_hlo._operand_shape(comp, ins.operands[1]))
            elif ins.opcode == "dynamic-slice" and ins.operands:
                if "S(5)" in xla_hlo._operand_shape(comp, ins.operands[0]):
                    total += times * xla_hlo.array_bytes(ins.shape)
    return total


def compiler_gib(memory: dict) -> float:
    """Peak HBM bytes on one device (arguments + outputs + temporaries - aliased), GiB: the same sum as
    tools/tpu_compile.py's `compiler_total`."""
    total = (
        memory.get("argument_size_in_bytes", 0)
        + memory.get("output_size_in_bytes", 0)
        + memory.get("temp_size_in_bytes", 0)
        - memory.get("alias_size_in_bytes", 0)
    )
    return total / 2**30


def published(anchor: dict, tokens_per_device: float) -> dict:
    """A published anchor's step time (s) and MFU (MaxText's convention, % of the bf16 peak) per device."""
    per_device = anchor["tokens_per_sec"] / (2 if anchor.get("per") == "chip" and anchor["hardware"] == "v7x" else 1)
    return {
        "published_tokens_per_s_per_device": per_device,
        "published_step_s": tokens_per_device / per_device,
        "published_mfu_pct": anchor["mfu_pct"],
    }


def calibration_row(
    name: str, run: Run, worker: dict, bound: dict | None, anchor: dict, error: str = "", *, peak_tflops: float = 0.0
) -> dict:
    """One row of the calibration table: the published run beside the projector's bound of MaxText's
    compiled program. The published MFU is shown as printed (`published_mfu_pct`: the FLOPs count of
    the MaxText that ran it; the v6e runs' older MaxText counted causal attention in full) and at the
    FLOPs the compiled MaxText counts (`published_mfu_same_flops_pct` = its FLOPs per device and step /
    (peak x the published step time)); error: predicted minus the latter (points), and the predicted
    step over the published one."""
    row = {
        "run": name,
        "target": run.target,
        "compile_topology": run.topology,
        "published_source": anchor.get("source", ""),
        "settings_source": run.source,
        "deviation": run.deviation,
        "note": run.note,
    }
    if worker:
        row.update(_worker_columns(worker, anchor, peak_tflops))
    if bound:
        # the published MFU the prediction is set against: at the compiled MaxText's FLOPs where known
        pub = row.get("published_mfu_same_flops_pct", anchor["mfu_pct"])
        step = row["published_step_s"] if worker else None
        row.update(_bound_columns(bound, pub, step))
        if bound.get("step_s"):
            row.update(_scheduled_columns(bound, pub, step))
    if error:
        row["error"] = error
    return row


def _worker_columns(worker: dict, anchor: dict, peak_tflops: float) -> dict:
    """The compile's columns of a row (wall times, memory, mesh, MaxText's FLOPs) and the published
    run's at its tokens per device."""

    def rounded(key: str, digits: int = 1):
        return round(worker[key], digits) if worker.get(key) is not None else None

    memory = worker.get("memory") or {}
    cols = dict(
        compile_s=rounded("compile_s"),
        hlo_s=rounded("hlo_s"),
        compiler_gib=round(compiler_gib(memory), 2) if memory else None,
        buffer_assignment_gib=(
            round(worker["memory_report_bytes"] / 2**30, 2) if worker.get("memory_report_bytes") else None
        ),
        host_gib=round(
            (memory.get("host_temp_size_in_bytes", 0) + memory.get("host_argument_size_in_bytes", 0)) / 2**30, 2
        ),
        mesh=" ".join(f"{a}={s}" for a, s in zip(worker["mesh_axes"], worker["mesh_shape"]) if s > 1),
        tokens_per_device=worker["tokens_per_device"],
        maxtext_tflops_per_device_step=round(worker["maxtext_tflops_per_device_step"], 2),
    )
    cols.update({k: round(v, 4) for k, v in published(anchor, worker["tokens_per_device"]).items()})
    if peak_tflops:
        cols["published_mfu_same_flops_pct"] = round(
            100 * worker["maxtext_tflops_per_device_step"] / (peak_tflops * cols["published_step_s"]), 2
        )
    return cols


def _bound_columns(bound: dict, pub: float, step: float | None) -> dict:
    """The roofline bounds' columns (exposed = compute + collectives, overlapped = the larger) against
    the published MFU `pub` (points) and step `step` (ratio; None without a compile)."""
    return dict(
        compute_s=round(bound["compute_s"], 4),
        xla_s=round(bound["xla_s"], 4),
        kernel_s=round(bound["kernel_s"], 4),
        comm_s=round(bound["comm_s"], 4),
        comm_by_axis=bound["comm_by_axis"],
        step_exposed_s=round(bound["step_exposed_s"], 4),
        step_overlapped_s=round(bound["step_overlapped_s"], 4),
        mfu_exposed_pct=round(bound["mfu_causal_exposed"], 2),
        mfu_overlapped_pct=round(bound["mfu_causal_overlapped"], 2),
        error_exposed_pts=round(bound["mfu_causal_exposed"] - pub, 2),
        error_overlapped_pts=round(bound["mfu_causal_overlapped"] - pub, 2),
        step_ratio_exposed=round(bound["step_exposed_s"] / step, 3) if step is not None else None,
        step_ratio_overlapped=round(bound["step_overlapped_s"] / step, 3) if step is not None else None,
        loops_without_trip_count=bound.get("loops_without_trip_count", 0),
        kernel_calls_unestimated=bound.get("kernel_calls_unestimated", 0),
        host_transfer_gb=round(bound.get("host_transfer_gb", 0.0), 2),
        attention_kernel_s=round(bound.get("attention_kernel_s", 0.0), 3),
        gmm_s=round(bound.get("gmm_s", 0.0), 3),
        gmm_flops_s=round(bound.get("gmm_flops_s", 0.0), 3),
    )


def _scheduled_columns(bound: dict, pub: float, step: float | None) -> dict:
    """The scheduled walk's columns (the headline prediction): its step and MFU, the error relative
    to the published MFU `pub`, where the step's time went."""
    return dict(
        step_s=round(bound["step_s"], 4),
        mfu_pct=round(bound["mfu_pct"], 2),
        error_pct=round(100.0 * (bound["mfu_pct"] - pub) / pub, 1),
        step_ratio=round(bound["step_s"] / step, 3) if step is not None else None,
        sched_compute_s=round(bound["sched_compute_s"], 4),
        exposed_comm_s=round(bound["exposed_comm_s"], 4),
        exposed_host_s=round(bound["exposed_host_s"], 4),
        host_s=round(bound["host_s"], 4),
        ici_busy_s=round(bound["ici_busy_s"], 4),
        exposed_by=bound["exposed_by"],
        unmatched_done=bound["unmatched_done"],
    )


COLUMNS = [
    "run",
    "target",
    "compile_topology",
    "compile_s",
    "hlo_s",
    "compiler_gib",
    "buffer_assignment_gib",
    "host_gib",
    "mesh",
    "tokens_per_device",
    "maxtext_tflops_per_device_step",
    "published_tokens_per_s_per_device",
    "published_step_s",
    "published_mfu_pct",
    "published_mfu_same_flops_pct",
    "compute_s",
    "xla_s",
    "kernel_s",
    "attention_kernel_s",
    "gmm_s",
    "gmm_flops_s",
    "comm_s",
    "comm_by_axis",
    "step_exposed_s",
    "step_overlapped_s",
    "mfu_exposed_pct",
    "mfu_overlapped_pct",
    "error_exposed_pts",
    "error_overlapped_pts",
    "step_ratio_exposed",
    "step_ratio_overlapped",
    "loops_without_trip_count",
    "kernel_calls_unestimated",
    "host_transfer_gb",
    "step_s",
    "mfu_pct",
    "error_pct",
    "step_ratio",
    "sched_compute_s",
    "exposed_comm_s",
    "exposed_host_s",
    "host_s",
    "ici_busy_s",
    "exposed_by",
    "unmatched_done",
    "error",
    "deviation",
    "note",
    "settings_source",
    "published_source",
]


def _fmt(v, digits: int = 1) -> str:
    if v is None or v == "":
        return "—"
    return f"{v:.{digits}f}" if isinstance(v, float) else str(v)


def markdown(rows: list[dict], header_lines: list[str]) -> str:
    """The calibration table as markdown, with the header lines (versions, CPU) first. GiB/device:
    memory_analysis() of the whole compile, else (`b`) the buffer assignment's report of a compile
    stopped at the HLO; wall s: the whole compile, else (`h`) up to the optimized HLO."""
    out = [*header_lines, ""]
    if any(r.get("step_s") for r in rows):
        out.append(
            "**The prediction** (tools/xla_schedule.py: the program walked in XLA's schedule; error = "
            "(predicted - published) / published, MFU at the compiled MaxText's FLOPs):"
        )
        out.append("")
        out.append(
            "| run | published MFU % | predicted MFU % | error % | published step s | predicted step s "
            "| compute s | exposed collectives s | exposed host transfers s (of busy) | old bound MFU % exposed / overlapped |"
        )
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if not r.get("step_s"):
                out.append(f"| {r['run']} | — | — | — | — | — | — | — | — | {r.get('error', '')} |")
                continue
            out.append(
                f"| {r['run']} | {_fmt(r.get('published_mfu_same_flops_pct'))} | {_fmt(r.get('mfu_pct'))} "
                f"| {r['error_pct']:+.1f} | {_fmt(r.get('published_step_s'), 2)} | {_fmt(r.get('step_s'), 2)} "
                f"| {_fmt(r.get('sched_compute_s'), 2)} | {_fmt(r.get('exposed_comm_s'), 2)} "
                f"| {_fmt(r.get('exposed_host_s'), 2)} ({_fmt(r.get('host_s'), 2)}) "
                f"| {_fmt(r.get('mfu_exposed_pct'))} / {_fmt(r.get('mfu_overlapped_pct'))} |"
            )
        out.append("")
        out.append(
            "The bounds (every op at its roofline; exposed = compute + every collective, overlapped = the larger):"
        )
        out.append("")
    out.append(
        "| run | target | compiled? | GiB/device | wall s | published MFU % (as printed / at these FLOPs) "
        "| predicted MFU % exposed / overlapped | error, pts exposed / overlapped | published step s "
        "| predicted step s exposed / overlapped | predicted / published step | collectives s | host transfer GB |"
    )
    out.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        compiled = "no: " + r["error"] if r.get("error") and "tokens_per_device" not in r else "yes"
        gib = _fmt(r.get("compiler_gib")) if r.get("compiler_gib") is not None else _fmt(r.get("buffer_assignment_gib"))
        gib += " b" if r.get("compiler_gib") is None and r.get("buffer_assignment_gib") is not None else ""
        wall = _fmt(r.get("compile_s"), 0) if r.get("compile_s") is not None else _fmt(r.get("hlo_s"), 0)
        wall += " h" if r.get("compile_s") is None and r.get("hlo_s") is not None else ""
        out.append(
            f"| {r['run']} | {r['target']} | {compiled} | {gib} | {wall} "
            f"| {_fmt(r.get('published_mfu_pct'))} / {_fmt(r.get('published_mfu_same_flops_pct'))} "
            f"| {_fmt(r.get('mfu_exposed_pct'))} / {_fmt(r.get('mfu_overlapped_pct'))} "
            f"| {_fmt(r.get('error_exposed_pts'))} / {_fmt(r.get('error_overlapped_pts'))} "
            f"| {_fmt(r.get('published_step_s'), 2)} "
            f"| {_fmt(r.get('step_exposed_s'), 2)} / {_fmt(r.get('step_overlapped_s'), 2)} "
            f"| {_fmt(r.get('step_ratio_exposed'), 2)} / {_fmt(r.get('step_ratio_overlapped'), 2)} "
            f"| {_fmt(r.get('comm_s'), 2)} | {_fmt(r.get('host_transfer_gb'))} |"
        )
    return "\n".join(out) + "\n"


# ------------------------------------------------------------------------------ compile and project


def maxtext_python() -> Path:
    """The `maxtext` venv's interpreter (made on first use by scripts/xla_env.sh: minutes, the registry)."""
    out = subprocess.run(
        ["bash", str(ROOT / "scripts" / "xla_env.sh"), MAXTEXT_VENV_KIND], capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"scripts/xla_env.sh maxtext exited {out.returncode}: {out.stderr[-600:]}")
    return Path(out.stdout.strip().splitlines()[-1]) / "bin" / "python"


def versions(python: Path) -> dict:
    code = (
        "import importlib.metadata as m, json;"
        "print(json.dumps({p: m.version(p) for p in ('maxtext', 'jax', 'jaxlib', 'libtpu', 'flax', 'tokamax')}))"
    )
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def memory_report_bytes(text: str) -> float | None:
    """HBM bytes of a buffer assignment's memory-usage report (`Total bytes:` of the default memory
    space, the first section): the peak the compiler assigned on one device."""
    m = re.search(r"Memory Space: default.*?\nTotal bytes: (\d+)", text, re.S)
    return float(m.group(1)) if m else None


def _hlo_ready(dump: Path) -> bool:
    """The train step's optimized HLO and its buffer assignment are written (their sizes stable)."""
    hlo = pick_hlo(dump)
    if hlo is None:
        return False
    if not _memory_report(hlo).is_file():
        return False
    size = hlo.stat().st_size
    time.sleep(2)
    return hlo.stat().st_size == size


def compile_run(name: str, run: Run, *, python: Path, folder: Path, timeout: float, until: str = "full") -> dict:
    """The worker's result for one run (compiling unless folder/result.json exists), with `hlo`: the
    optimized HLO's path under folder (the rest of the dump removed). until="hlo": stop the worker
    once XLA has written the optimized HLO and its buffer assignment (the backend's code generation,
    most of a compile's wall time here, changes neither); the memory is then the buffer assignment's
    report and compile_s is None (hlo_s: seconds from the compile's start to that dump)."""
    result, hlo = folder / "result.json", folder / "train_step.after_optimizations.txt"
    if not result.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        dump = folder / "dump"
        shutil.rmtree(dump, ignore_errors=True)
        pre = Path(f"{result}.pre.json")
        pre.unlink(missing_ok=True)
        cmd, env = _worker_command(name, run, python=python, folder=folder, result=result, dump=dump)
        print(f"maxtext_compile: {name}: compiling for {run.topology} (until {until}) ...", file=sys.stderr, flush=True)
        start = time.time()
        returncode, stopped = _wait_worker(cmd, env, folder=folder, timeout=timeout, hlo_done=until == "hlo", pre=pre)
        if stopped:
            _record_stopped(result, pre, pick_hlo(dump))
        elif returncode != 0 or not result.is_file():
            tail = [ln for ln in (folder / "worker.log").read_text().splitlines() if ln.strip()][-3:]
            raise RuntimeError(
                f"worker exited {returncode} after {time.time() - start:.0f} s: {' | '.join(tail)[-500:]}"
            )
        else:
            _record_finished(result, pre, pick_hlo(dump))
        found = pick_hlo(dump)
        if found:
            found.replace(hlo)
        shutil.rmtree(dump, ignore_errors=True)
        shutil.rmtree(folder / "out", ignore_errors=True)
    res = json.loads(result.read_text())
    res["hlo"] = str(hlo) if hlo.is_file() else None
    return res


def _worker_command(name: str, run: Run, *, python: Path, folder: Path, result: Path, dump: Path):
    """The worker's command line and environment: MaxText's arguments for the run's slice, the
    deviceless environment with the recipe's XLA flags in LIBTPU_INIT_ARGS and XLA's dump of the
    train step's HLO into `dump`."""
    from tools.deviceless_env import deviceless_env, with_xla_flags

    topo = run.topology.replace("tpu7x-512", "tpu7x:4x8x8").replace("v6e-256", "v6e:16x16")
    env = deviceless_env(
        topo,
        extra={
            **with_xla_flags(f"--xla_dump_to={dump} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*train_step.*"),
            "LIBTPU_INIT_ARGS": run.xla_flags,
        },
    )
    env.pop("PYTHONPATH", None)  # the worker imports MaxText only (the checkout's packages not needed)
    cmd = [
        str(python),
        str(ROOT / "scripts" / "bench" / "maxtext_worker.py"),
        str(result),
        *run.args,
        f"compile_topology={run.topology}",
        "compile_topology_num_slices=1",
        f"base_output_directory={folder / 'out'}",
        f"run_name={name}",
    ]
    return cmd, env


def _wait_worker(cmd: list[str], env: dict, *, folder: Path, timeout: float, hlo_done: bool, pre: Path):
    """Run the worker in `folder` (its output in worker.log) until it exits or, with `hlo_done`, until
    its start facts (`pre`) and the dump's optimized HLO are written; (its return code, whether it was
    stopped at the HLO). subprocess.TimeoutExpired after `timeout` seconds."""
    start = time.time()
    dump = folder / "dump"
    with open(folder / "worker.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=folder, stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
        while proc.poll() is None:
            if time.time() - start > timeout:
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(cmd, timeout)
            if hlo_done and pre.is_file() and dump.is_dir() and _hlo_ready(dump):
                proc.kill()  # our own child: the codegen that follows changes neither the HLO nor the memory
                proc.wait()
                return proc.returncode, True
            time.sleep(5)
    return proc.returncode, False


def _memory_report(hlo: Path) -> Path:
    """The buffer assignment's memory-usage report XLA dumps beside an optimized HLO."""
    return hlo.with_name(hlo.name.replace(".txt", "-memory-usage-report.txt"))


def _record_stopped(result: Path, pre: Path, found: Path) -> None:
    """result.json of a worker stopped at the HLO: its start facts, the buffer assignment's memory,
    the seconds from the compile's start to the dump."""
    facts = json.loads(pre.read_text())
    facts.update(
        compile_s=None,
        hlo_s=found.stat().st_mtime - facts.pop("compile_started"),
        memory={},
        memory_report_bytes=memory_report_bytes(_memory_report(found).read_text()),
        stopped_at="hlo",
    )
    result.write_text(json.dumps(facts))


def _record_finished(result: Path, pre: Path, found: Path | None) -> None:
    """The finished worker's result.json with the buffer assignment's memory and the seconds to the
    HLO dump added where the dump has them."""
    res = json.loads(result.read_text())
    if found is not None and _memory_report(found).is_file():
        res["memory_report_bytes"] = memory_report_bytes(_memory_report(found).read_text())
    if found and pre.is_file():
        res["hlo_s"] = found.stat().st_mtime - json.loads(pre.read_text())["compile_started"]
    result.write_text(json.dumps(res))


def project_run(run: Run, res: dict, *, anchors: dict) -> dict:
    """The projector's bound of MaxText's compiled program (tools/mfu_projection.py `program_bound`)."""
    import planner
    from parallelisms.tpu_topology import topology_of
    from tools import xla_projection as xp
    from tools.mfu_projection import program_bound
    from tools.xla_hlo import mxu_flops, peak_rates
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    target = planner.parse_target(run.target)
    gen = target.generation.name
    peak = TPU_PEAK_TFLOPS[gen] * 1e12
    hbm = anchors["hbm_gbps_per_device"][gen] * 1e9
    tokens = res["tokens_per_device"]
    model_flops = res["maxtext_tflops_per_device_step"] * 1e12
    facts = {
        "generation": gen,
        "peak": peak,
        "topology": topology_of(target),
        "tokens": tokens,
        "routed_rows": 0,
        "flops_per_token": {
            "causal": model_flops / tokens,
            "palm": (model_flops + res["maxtext_attention_tflops"] * 1e12) / tokens,
        },
    }
    text = Path(res["hlo"]).read_text()
    # the collectives name the axes of the program's own mesh declaration (`axis_<i>`, read as a<i>)
    radices = hlo_mesh(text) or [n for n in res["mesh_shape"] if n > 1] or [1]
    prog = {"radices": radices, "device_coords": res["device_coords"], "hlo": res["hlo"]}
    hlo = xp.parse_hlo(text)
    ops = xp.compute_ops(hlo)
    compute = kernel_compute(ops, attention_flops=res["maxtext_attention_tflops"] * 1e12, peak=peak, hbm=hbm)
    b = program_bound(prog, facts, anchors=anchors, compute_s=compute["compute_s"])
    b["comm_by_axis"] = ", ".join(
        f"{ax}({'x'.join(map(str, radices))}) {t:.3g} s" for ax, t in b["comm_by_axis"].items()
    )
    b.update(
        xla_s=compute["xla_s"],
        kernel_s=compute["kernel_s"],
        kernel_calls_unestimated=compute["unestimated"],
        attention_kernel_s=compute["attention_kernel_s"],
        gmm_s=compute["gmm_s"],
        gmm_flops_s=compute["gmm_flops_s"],
        host_transfer_gb=host_transfer_bytes(hlo) / 1e9,
    )
    topo = facts["topology"]
    own = xp.Placement(
        radices=list(radices), coords=[tuple(c) for c in res["device_coords"]], chips=topo.chips, wrap=topo.wrap[:3]
    )
    ici = anchors["ici"][gen]
    attention_s = attention_kernel_seconds(
        res["maxtext_attention_tflops"] * 1e12, run.head_dims, peak=peak * xp.MXU_EFFICIENCY
    )
    # a float8 dot (the FP8 runs) at the chip's float8 rate (assets/anchors.toml); the bf16 runs have none
    mxu = mxu_flops(hlo, MXU_TILE, peak_rates(anchors, gen))
    seconds = schedule_seconds(ops, compute, peak=peak, hbm=hbm, mxu=mxu, attention_s=attention_s)
    s = xp.scheduled(
        hlo,
        colls=xp.collectives(hlo, own.mesh),
        ici=ici,
        placement=own,
        seconds=seconds,
        host_bytes_per_s=xp.host_link_bytes_per_s(gen, ici),
    )
    host_exposed = sum(v for k, v in s.exposed_by.items() if k.startswith("host"))
    b.update(
        step_s=s.step_s,
        mfu_pct=100.0 * model_flops / (peak * s.step_s),
        sched_compute_s=s.compute_s,
        exposed_s=s.exposed_s,
        exposed_comm_s=s.exposed_s - host_exposed,
        exposed_host_s=host_exposed,
        host_s=sum(v for k, v in s.busy_s.items() if k.startswith("host")),
        ici_busy_s=sum(v for k, v in s.busy_s.items() if k.startswith("ici")),
        unmatched_done=s.unmatched_done,
        exposed_by=", ".join(f"{k} {v:.3g} s" for k, v in sorted(s.exposed_by.items())),
    )
    return b


MXU_TILE = 256
"""Trillium (v6e) and Ironwood (v7x) MXUs are 256 x 256 (MaxText docs/guides/optimization/
custom_model.md; /work/shared/reference/anchors.md)."""


def attention_kernel_seconds(attention_flops: float, head_dims: tuple[int, int], *, peak: float) -> float:
    """Seconds of the splash kernels per step on a MXU_TILE-wide MXU. MaxText's attention FLOPs are 3 x
    the forward's two matmuls, Q K^T (a share qk / (qk + v) of them, contracting the query-key head dim)
    and P V (contracting the sequence). The kernels run 7 such matmuls: forward Q K^T and P V; the
    fused backward Q K^T again, dP = dO V^T (contracting the value head dim), dV, dQ, dK (contracting
    the sequence). A matmul contracting a head dim d < 256 fills d / 256 of the array
    (tools/xla_hlo.mxu_utilization); the others fill it (both free dims >= the block)."""
    from tools.xla_hlo import _pad

    qk, v = head_dims
    u_qk, u_v = qk / _pad(qk, MXU_TILE), v / _pad(v, MXU_TILE)
    a = attention_flops / 3 * qk / (qk + v)  # one Q K^T pass
    b = attention_flops / 3 - a  # one P V pass
    return (2 * a / u_qk + b + b / u_v + b + 2 * a) / peak


def schedule_seconds(
    ops: list, compute: dict, *, peak: float, hbm: float, mxu: dict[str, float] | None = None, attention_s=None
) -> dict[str, float]:
    """Seconds of one run of each op for the scheduled walk: the XLA ops and the estimated kernels
    (gmm) at their roofline, a dot or fusion's FLOPs taken as `mxu` says (its MXU FLOPs, tile padding
    included) where given; the attention kernels (and any kernel without an estimate) each an equal
    share of `attention_s` (default `kernel_compute`'s attention charge) per call."""
    from tools import xla_projection as xp

    eff = peak * xp.MXU_EFFICIENCY
    seconds = xp.op_seconds(ops, peak_flops=eff, hbm_bytes_per_s=hbm)
    for o in ops:
        if mxu and o.name in mxu and o.kind == "xla":
            seconds[o.name] = max(mxu[o.name] / eff, o.bytes / hbm)
    attn = [
        o
        for o in ops
        if o.kind in ("kernel", "kernel-unestimated") and (is_attention_kernel(o) or o.kind == "kernel-unestimated")
    ]
    calls = sum(o.times for o in attn)
    total = compute["attention_kernel_s"] if attention_s is None else max(attention_s, compute["attention_kernel_s"])
    for o in attn:
        seconds[o.name] = total / calls
    return seconds


def is_attention_kernel(op) -> bool:
    """A splash attention kernel call (by its metadata's op_name)."""
    return "splash" in op.source or "splash" in op.name


def kernel_compute(ops: list, *, attention_flops: float, peak: float, hbm: float) -> dict:
    """Compute seconds: the XLA ops' per-op roofline; the kernels with a cost estimate (the MoE
    runs' ragged-dot gmm) by it; the attention kernels at MaxText's attention FLOPs x
    ATTENTION_KERNEL_FACTOR or their operand and result bytes, whichever is slower, whether or not
    they carry an estimate (tokamax splash's counts the masked-out half: 2.6x MaxText's causal FLOPs
    on Qwen3-235B; the DeepSeek-V3 recipe sets its own, `cost_estimate_flops_fwd=5e12`). gmm_s /
    gmm_flops_s: the estimated kernels by their estimate / at their FLOPs alone."""
    from tools import xla_projection as xp

    xla_s = xp.compute_time(ops, peak_flops=peak, hbm_bytes_per_s=hbm, kinds=("xla",))
    kernels = [o for o in ops if o.kind in ("kernel", "kernel-unestimated")]
    attn = [o for o in kernels if is_attention_kernel(o) or o.kind == "kernel-unestimated"]
    est = [o for o in kernels if o not in attn]
    est_s = sum(o.times * max(o.flops / peak, o.bytes / hbm) for o in est)
    attn_io = sum(o.times * o.io for o in attn)
    attn_s = max(attention_flops * ATTENTION_KERNEL_FACTOR / peak, attn_io / hbm) if attn else 0.0
    return {
        "xla_s": xla_s,
        "kernel_s": est_s + attn_s,
        "attention_kernel_s": attn_s,
        "gmm_s": est_s,
        "gmm_flops_s": sum(o.times * o.flops for o in est) / peak,
        "compute_s": xla_s + est_s + attn_s,
        "unestimated": int(sum(o.times for o in kernels if o.kind == "kernel-unestimated")),
    }


# ------------------------------------------------------------------------------ main


def peak_of(run: Run) -> float:
    """The bf16 peak TFLOP/s of one device of the run's target (a v7x device is half a chip)."""
    import planner
    from trainer.runtime.flops import TPU_PEAK_TFLOPS

    return TPU_PEAK_TFLOPS[planner.parse_target(run.target).generation.name]


def parse(argv: list[str]):
    from trainer.runtime import cli

    p = cli.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--keep", type=Path, default=ROOT / "outputs" / "maxtext_compile", help="compile folders (reused)")
    p.add_argument("--out", type=Path, default=None, help="table path without extension")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per compile")
    p.add_argument("--table-only", action="store_true", help="read the kept compiles; compile nothing")
    p.add_argument(
        "--until",
        choices=("full", "hlo"),
        default="full",
        help="full: the whole compile (memory_analysis, compile time); hlo: stop at the optimized HLO dump "
        "(memory from the buffer assignment; the backend's codegen, most of the wall time, skipped)",
    )
    ns = p.parse_args(argv)
    ns.runs = [r for r in ns.runs.split(",") if r]
    ns.keep = ns.keep.resolve()  # the worker runs in the run's folder: its paths must not be relative
    bad = [r for r in ns.runs if r not in RUNS]
    if bad:
        p.error(f"--runs: unknown {', '.join(bad)}; allowed: {', '.join(RUNS)}")
    return ns


def main(argv: list[str] | None = None) -> int:
    from tools.mfu_report import load_anchors
    from trainer.runtime.device import cpu_model

    ns = parse(sys.argv[1:] if argv is None else argv)
    anchors = load_anchors()
    by_id = {a["id"]: a for a in anchors["anchor"]}
    python = maxtext_python()
    vers = versions(python)
    rows, failed = [], False
    for name in ns.runs:
        run, folder = RUNS[name], ns.keep / name
        anchor = by_id[run.anchor]
        if ns.table_only and not (folder / "result.json").is_file():
            rows.append(calibration_row(name, run, {}, None, anchor, error="not compiled (no kept result)"))
            continue
        try:
            res = compile_run(name, run, python=python, folder=folder, timeout=ns.timeout, until=ns.until)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            failed = True
            rows.append(calibration_row(name, run, {}, None, anchor, error=str(e).splitlines()[0][:300]))
            continue
        bound, err = None, ""
        if res.get("hlo"):
            bound = project_run(run, res, anchors=anchors)
        else:
            err = "no optimized HLO in the dump"
        rows.append(calibration_row(name, run, res, bound, anchor, error=err, peak_tflops=peak_of(run)))
        print(json.dumps(rows[-1]), flush=True)

    def header(commit: str) -> list[str]:
        return [
            f"MaxText's train step compiled deviceless (scripts/bench/maxtext_compile.py), projected by "
            f"tools/xla_projection.py; commit {commit}.",
            "",
            "Versions: " + ", ".join(f"{k} {v}" for k, v in vers.items()) + f". CPU: {cpu_model()}.",
            "MFU in MaxText's convention (its own FLOPs per step, causal attention halved) against the bf16 peak.",
        ]

    write_tables(rows, name="maxtext_calibration", out=ns.out, columns=COLUMNS, header=header, markdown=markdown)
    return 1 if failed else 0


if __name__ == "__main__":
    from trainer.runtime import cli

    sys.exit(cli.run(main))
