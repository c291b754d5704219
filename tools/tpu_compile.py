"""The per-device program a TPU pod runs, compiled deviceless: `scripts/check_recipe.py --compile`.

`compile_recipe(path)` answers, for a recipe with a TPU `[job] target`, "does the program this
recipe runs on one device compile for that chip, and does it fit?" with the compiler's own
memory analysis, beside the planner's figure. How (the worker runs in the XLA tier's `ttpu` venv,
scripts/xla_env.sh: torch 2.13 + torchax + jax 0.10.2 + libtpu 0.0.52; never in the trainer):

1. **The trainer's start-up on the target's fake world**, as the recipe check does it
   (tools/recipe_check.py): `build_job(cfg, purpose="check", device_type="tpu")` inside PyTorch's
   fake process group at the target's world size, the model at full depth on meta tensors,
   parallelized by the real plan (SimpleFSDP, TP, EP, CP, AC), and the step the trainer would
   build, captured once (graph mode: Dynamo + AOTAutograd + the tpu backend's passes, layer
   scan). The captured ATen graph is rank 0's program: local shapes, and every collective as the
   trainer writes it (`_c10d_functional` all-gathers, reduce-scatters, all-reduces and
   all-to-alls with their process-group names).
2. **The kernels a TPU run calls, at the recipe's widths**: before the capture, the model's ops
   are served by opaque `titan_capture::*` ops (titan_kernels/tpu/capture.py: splash, megablox
   gmm, the fused linear + cross-entropy), the context-parallel attention by the per-rank CP
   splash (`titan_program::splash_cp_*`, this rank's causal offsets and segment ids) over the
   all-gathered k/v, and the expert-parallel dispatch by a ragged all-to-all op
   (`titan_program::ragged_all_to_all`, served through titan_kernels.collectives.serve), so the
   dispatch is `dispatch_combine_static` over a ragged all-to-all exactly as `select_dispatch`
   picks it on a TPU, with its reverse in the backward.
3. **Lowered with the collectives as written**: torchax lowers the graph; the whole program runs
   inside one `jax.shard_map` over a mesh of the target's compile-only topology
   (`jax.experimental.topologies`), every input being one device's local tensor, and each
   collective becomes the JAX collective over the mesh axes of its process group (the group's
   ranks are read from the fake world: a group is a product of mesh axes, the axes the
   trainer's DeviceMeshes are built from, refined where the expert mesh splits them). The
   kernels lower to the Pallas kernels (Mosaic calls) for the target's generation. Nothing is
   left to XLA's SPMD partitioner: the per-device program is the one the trainer emits.
4. **Compiled** for the target (libtpu, no device) and its `memory_analysis()` read: arguments,
   outputs, temporaries, generated code. The updated parameters and moments are outputs, not
   donated (torch-tpu's AOT path donates nothing; the planner counts the same).

Where: this module is the outer check (`compile_recipe`, the report, the topology names); the
worker, `python -m tools.tpu_compile SPEC` in the `ttpu` venv, is tools/tpu_compile_capture.py
(steps 1-2) and tools/tpu_compile_worker.py (steps 3-4), whose names are importable from here. A
worker that dies without a result (a libtpu CHECK abort) is reported by libtpu's own fatal and
error lines (`worker_failure`).

torch-tpu's own lowering (`fx_to_mlir`) builds the MLIR and the PJRT executable in one call on a
live device (docs/tpu.md, "What ran where"), so it cannot run here; torchax lowers the same ATen
graph with its own rules. What differs from a TPU run: the JAX rules of torchax for ATen ops, the
rank-0 constants (every rank compiles rank 0's CP offsets here), and the device order (JAX's
`create_device_mesh` over the topology, with split physical axes allowed).

The verdict: "fits" when the compiler accepts the program and its total (arguments + outputs +
temporaries - aliased) is within the usable HBM and within `BAND` of the planner's total;
"does not fit" when the compiler refuses it (CompileTimeHbmOom) or the total exceeds the HBM;
"differs from the plan" when it fits but the two totals differ by more than the band.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GiB = 2.0**30

BAND = 0.15
"""Largest accepted |compiler total - planner total| / planner total. Why 15 %: the planner
counts tensors, not buffers: XLA's temporaries add fusion outputs, layout padding (a lane dim
padded to 128, a sublane to 8/16) and the scheduler's overlap of live ranges, which the dense
full-depth compiles of 2026-12-03 (`2ed2d29`) put at 4-5 % of the total (70B: 24.99 vs 26.1 GiB; 405B: 73.58
vs 74.7); the MoE dispatch buffers and CP gathers are modelled coarser (the worst case, whole).
Three times the dense error leaves room for those and still catches a planner term that is
wrong by a layer's activations or a whole extra copy of the state."""

JAX_TOPOLOGY_PREFIX = {"v4": "v4", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e", "v7x": "tpu7x"}
"""The generation's name in `jax.experimental.topologies` (`v6e:16x16`, `tpu7x:4x8x8`)."""


def topology_name(target, *, key: str = "job.target") -> str:
    """The jax compile-only topology of a planner Target, from the slice's chip grid
    (parallelisms/tpu_topology.py): v6e-256 -> v6e:16x16, v7x-512 -> tpu7x:4x8x8."""
    from models.errors import ConfigError
    from parallelisms.tpu_topology import topology_of

    gen = target.generation.name
    if gen not in JAX_TOPOLOGY_PREFIX:
        raise ConfigError(
            f"{key}: {target.name}: no compile-only topology for {gen}; "
            f"allowed: {', '.join(JAX_TOPOLOGY_PREFIX)} targets"
        )
    if getattr(target, "num_slices", 1) > 1:  # v6e-16x2 -> v6e:4x4,slices=2 (`topology_devices`)
        import planner

        one = planner.parse_target(target.name.rsplit("x", 1)[0], key=key)
        return f"{topology_name(one, key=key)},slices={target.num_slices}"
    topology = topology_of(target)
    if topology is None:
        raise ConfigError(
            f"{key}: {target.name}: {target.devices} devices is no single slice known here; allowed: "
            f"a slice size of {gen}, e.g. {gen}-256"
        )
    x, y, z = topology.chips
    dims = (x, y) if gen in ("v5e", "v6e") else (x, y, z)
    return f"{JAX_TOPOLOGY_PREFIX[gen]}:{'x'.join(str(d) for d in dims)}"


@dataclass
class ProgramCompile:
    """What `compile_recipe` found for one recipe."""

    recipe: str
    target: str = "-"
    topology: str = "-"
    mesh: str = "-"
    """The JAX mesh the program was compiled over (axes and sizes, refined from the trainer's)."""
    program: str = "-"
    """Kernels by name, collectives by kind and count, scans (counted in the program text: a scan
    body's ops once)."""
    kernels: dict = field(default_factory=dict)
    collectives: dict = field(default_factory=dict)
    scans: int = 0
    capture_s: float = 0.0
    lower_s: float = 0.0
    compile_s: float = 0.0
    wall_s: float = 0.0
    memory: dict = field(default_factory=dict)
    """The compiler's memory analysis, bytes per device."""
    compiler_gib: float | None = None
    planned_gib: float | None = None
    planned_arguments_gib: float | None = None
    """The planner's state the program reads (parameters and optimizer moments), the compiler's
    `arguments` counterpart."""
    usable_gib: float | None = None
    hbm_gib: float | None = None
    oom: str | None = None
    """libtpu's CompileTimeHbmOom message, when the compiler refused the program."""
    radices: list = field(default_factory=list)
    """The program's mesh axes' sizes (`a0`, `a1`, ...: the trainer's axes refined, outermost first)."""
    device_coords: list = field(default_factory=list)
    """Per device of the mesh in row-major order: its chip's (x, y, z) and its core on the chip
    (tools/xla_projection.py places each collective's group on the torus with them)."""
    kernel_cost: dict = field(default_factory=dict)
    """Per Pallas kernel op (`titan_capture::*`): calls per step (a scan body's calls times its
    trips), FLOPs and HBM bytes of titan_kernels/tpu/capture.py's model at the graph's shapes, and
    for the grouped matmuls the rows per call (the worst-case buffer, `rows`)."""
    tokens_per_device: int = 0
    """Tokens one device's program trains on per step: local batch x seq len x grad-accum steps /
    (tp x cp x pp), the planner's `tokens_per_device_step` (a CP rank holds seq len / cp tokens of
    each sequence; the ranks of a TP group or a pipeline share their dp rank's tokens)."""
    flags: dict = field(default_factory=dict)
    """LIBTPU_INIT_ARGS / XLA_FLAGS the program was compiled under (`recipe_flag_env`: the
    generation's bundle < the recipe's < the environment's), so a kept compile can be told stale."""
    error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> str:
        if self.error:
            return "failed"
        if self.oom or (
            self.compiler_gib is not None and self.hbm_gib is not None and self.compiler_gib > self.hbm_gib
        ):
            return "does not fit"
        if self.compiler_gib is None or self.planned_gib is None:
            return "failed"
        if abs(self.compiler_gib - self.planned_gib) > BAND * self.planned_gib:
            return "differs from the plan"
        return "fits"

    @property
    def ok(self) -> bool:
        return self.verdict == "fits"


def compiler_total(memory: dict) -> int:
    """Peak bytes on one device: arguments + outputs + temporaries, less what outputs alias."""
    return (
        memory.get("argument_size_in_bytes", 0)
        + memory.get("output_size_in_bytes", 0)
        + memory.get("temp_size_in_bytes", 0)
        - memory.get("alias_size_in_bytes", 0)
    )


def ttpu_python() -> str:
    """The XLA tier's torch-tpu venv's interpreter (made on first use by scripts/xla_env.sh)."""
    venv = (
        subprocess.run(
            ["bash", str(ROOT / "scripts" / "xla_env.sh"), "ttpu"], check=True, capture_output=True, text=True
        )
        .stdout.strip()
        .splitlines()[-1]
    )
    return str(Path(venv) / "bin" / "python")


def compile_recipe(
    path: str,
    *,
    overrides=(),
    timeout: float = 3600,
    python: str | None = None,
    extra_env: dict | None = None,
    capture_only: bool = False,
) -> ProgramCompile:
    """Compile `path`'s per-device program for its `[job] target` (module docstring); never raises
    for the recipe's own faults (the report's `error`). `capture_only`: stop after the capture (the
    program's counts and `kernel_cost`, no lowering, no compile). `extra_env`: more environment for the
    worker (the projection passes `XLA_FLAGS=--xla_dump_to=...` to keep the optimized HLO), layered
    over the recipe's flags (`layer_worker_env`)."""
    from models.errors import ConfigError

    report = ProgramCompile(recipe=path)
    t0 = time.perf_counter()
    try:
        cfg, target = _recipe_target(path, overrides)
        _plan(report, cfg, target)
        spec = dict(
            recipe=str(Path(path).resolve()),
            overrides=[list(o) for o in overrides],
            topology=report.topology,
            generation=target.generation.name,
            capture_only=capture_only,
        )
        report.flags = recipe_flag_env(cfg, target.generation.name)
        env = layer_worker_env(report.flags, extra_env)
        res = _run_worker(spec, python=python, extra_env=env, timeout=timeout)
        _read_result(report, res, capture_only=capture_only)
    except ConfigError as e:
        report.error = str(e)
    except subprocess.TimeoutExpired:
        report.error = f"the compile took longer than {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001  (a check reports every failure as a row)
        report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report.wall_s = time.perf_counter() - t0
    return report


def recipe_flag_env(cfg, generation: str | None = None, environ=None) -> dict[str, str]:
    """LIBTPU_INIT_ARGS / XLA_FLAGS for the worker, layered as trainer/runtime/tpu_env.py merges them
    at run time (later wins): the `[device] flag_bundle` for `generation` (auto: the generation's
    recorded bundle, what a run on that chip gets by default), the recipe's own `[device]
    libtpu_init_args` / `xla_flags` (flux_dev_v7x's), then the caller's exported ones. So the
    deviceless compile sees the flags the run's first compile sees: a bundle flag libtpu refuses
    for the chip fails here, not at step 1 on the pod."""
    from trainer.runtime.tpu_env import merge_flags, pick_bundle

    environ = os.environ if environ is None else environ
    bundle = pick_bundle(cfg.device.flag_bundle, generation)
    out = {}
    for var, own, recorded in (
        ("LIBTPU_INIT_ARGS", cfg.device.libtpu_init_args, bundle.libtpu_init_args if bundle else ()),
        ("XLA_FLAGS", cfg.device.xla_flags, bundle.xla_flags if bundle else ()),
    ):
        merged = merge_flags(recorded, own, shlex.split(environ.get(var, "")))
        if merged:
            out[var] = " ".join(merged)
    return out


FLAG_VARIABLES = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")
"""The variables that hold flag lists, layered rather than replaced (`layer_worker_env`)."""


def layer_worker_env(flags: Mapping[str, str], extra_env: Mapping[str, str] | None) -> dict[str, str]:
    """The worker's extra environment: `flags` (`recipe_flag_env`: the bundle < recipe < environment)
    with a caller's `extra_env` over it. A flag variable (`FLAG_VARIABLES`) in both is layered, the
    recipe's flags first and the caller's after, a flag named in both taking the caller's value
    (`merge_flags`), so a caller that adds `--xla_dump_to` still compiles under the recipe's flags
    (it replaced them before); any other variable is the caller's."""
    from trainer.runtime.tpu_env import merge_flags

    env = {**flags, **(extra_env or {})}
    for var in FLAG_VARIABLES:
        if var in flags and var in (extra_env or {}):
            env[var] = " ".join(merge_flags(shlex.split(flags[var]), shlex.split(extra_env[var])))
    return env


def compile_flags(path: str, overrides) -> dict[str, str]:
    """The flags `compile_recipe` compiles `path` with `overrides` under (`ProgramCompile.flags`)."""
    cfg, target = _recipe_target(path, overrides)
    return recipe_flag_env(cfg, target.generation.name)


def _recipe_target(path: str, overrides):
    """The recipe's config and its TPU target; a ConfigError for a recipe without one."""
    import planner
    from models.errors import ConfigError
    from trainer.config import build_config

    cfg = build_config(path, list(overrides))
    if not cfg.job.target:
        raise ConfigError(
            "job.target: the TPU program compile needs a TPU target, e.g. v6e-256; allowed: a recipe with [job] target"
        )
    target = planner.parse_target(cfg.job.target)
    if target.device_type != "tpu":
        raise ConfigError(f"job.target: {target.name} is not a TPU; allowed: v5e, v5p, v6e, v7x targets")
    return cfg, target


def _plan(report: ProgramCompile, cfg, target) -> None:
    """The report's target, topology and the planner's figures for the recipe on `target`."""
    from tools.recipe_check import planned

    report.target, report.topology = target.name, topology_name(target)
    est = planned(cfg, target)
    report.planned_gib, report.usable_gib = est.total / GiB, est.usable / GiB
    report.planned_arguments_gib = (est.params + est.optimizer) / GiB
    report.hbm_gib = target.hbm_bytes / GiB
    # A CP rank holds seq_len / cp tokens of each sequence; TP and PP ranks share their dp rank's.
    report.tokens_per_device = round(est.tokens_per_device_step)


def _run_worker(spec: dict, *, python: str | None, extra_env: dict | None, timeout: float) -> dict:
    """The worker's result dict (`python -m tools.tpu_compile SPEC` in the `ttpu` venv); a
    RuntimeError naming libtpu's own lines (`worker_failure`) when it dies without one."""
    from tools.deviceless_env import deviceless_env

    # tools/deviceless_env.py: the one set-up of every deviceless compile (estimate_xla's too)
    env = deviceless_env(spec["topology"], extra=extra_env)
    proc = subprocess.run(
        [python or ttpu_python(), "-m", "tools.tpu_compile", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=str(ROOT),
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"compile worker: {worker_failure(proc.stderr, proc.returncode)}")
    return json.loads(lines[-1])


RESULT_FIELDS = (
    "mesh",
    "kernels",
    "collectives",
    "scans",
    "capture_s",
    "lower_s",
    "compile_s",
    "memory",
    "oom",
    "notes",
    "radices",
    "device_coords",
    "kernel_cost",
)
"""The worker's result fields copied into the report as they are."""


def _read_result(report: ProgramCompile, res: dict, *, capture_only: bool) -> None:
    """The worker's result into the report: its fields, the worker's own error (a capture's too:
    a capture-only report without one read as an empty program), the compiler's total, the
    program line."""
    for k in RESULT_FIELDS:
        if k in res:
            setattr(report, k, res[k])
    if res.get("error"):
        report.error = res["error"]
    if capture_only:
        return
    if report.memory:
        report.compiler_gib = compiler_total(report.memory) / GiB
    report.program = program_summary(report.kernels, report.collectives, report.scans)


GLOG_LINE = re.compile(r"^([FE])\d{4} [\d:.]+\s+\d+\s+(\S+:\d+\].*)$")
"""A libtpu (glog) fatal or error line: `F1206 13:58:24.067303   28899 fusion_emitter.cc:13652] Check
failed: ...`; the level and `file:line] message` are kept."""


def worker_failure(stderr: str, returncode: int, *, limit: int = 400, most: int = 3) -> str:
    """Why a compile worker died without a result, from its stderr: libtpu's fatal (`F`) then error
    (`E`) lines, at most `most`, each cut to `limit` characters, without the crash handler's own
    (`RAW:`, e.g. "Raising signal 6 with default behavior", which is always the last line of an
    abort), led by the exit status; else the last non-empty line, as before; else the exit status."""
    fatal, errors = [], []
    for line in stderr.splitlines():
        m = GLOG_LINE.match(line.strip())
        if m is None or "] RAW: " in line:
            continue
        text = f"{m.group(1)} {m.group(2)}"[:limit]
        kept = fatal if m.group(1) == "F" else errors
        if text not in kept:  # libtpu repeats its check line in the crash report
            kept.append(text)
    checks = (fatal + errors)[:most]
    if checks:
        return f"exit {returncode}: " + " | ".join(checks)
    tail = [ln for ln in stderr.strip().splitlines() if ln.strip()][-1:]
    return tail[0][:limit] if tail else f"exit {returncode}"


def program_summary(kernels: dict, collectives: dict, scans: int) -> str:
    k = ", ".join(f"{name} {n}" for name, n in sorted(kernels.items())) or "no kernel"
    c = ", ".join(f"{name} {n}" for name, n in sorted(collectives.items())) or "no collective"
    return f"{k}; {c}; {scans} scans"


# The worker (ttpu venv; `python -m tools.tpu_compile SPEC`): its names stay importable from here.
from tools.tpu_compile_capture import (  # noqa: E402, F401  (tests/xla/probes import the private ones)
    PROGRAM_NS,
    _capture,
    _define_program_ops,
    group_axes,
    kernel_model,
    program_counts,
    refine_axes,
)
from tools.tpu_compile_worker import (  # noqa: E402, F401
    _lay_out,
    _lowerings,
    main,
    permute_shift,
    topology_devices,
    worker,
)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
