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
import math
import subprocess
import sys
import time
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


def topology_devices(topology: str):
    """The compile-only devices of `topology_name`'s string: jax's topology, and with `,slices=N`
    N slices of it (jax's `num_slices`: MegaScale devices carrying `slice_index`, slice-major)."""
    from jax.experimental import topologies

    name, _, slices = topology.partition(",slices=")
    extra = {"num_slices": int(slices)} if slices else {}
    return topologies.get_topology_desc(topology_name=name, platform="tpu", **extra).devices


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
    """Tokens one device's program trains on per step (local batch x seq len x grad-accum steps)."""
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
        worker (the projection passes `XLA_FLAGS=--xla_dump_to=...` to keep the optimized HLO)."""
    import planner
    from models.errors import ConfigError
    from tools.deviceless_env import deviceless_env
    from tools.recipe_check import planned
    from trainer.config import build_config

    report = ProgramCompile(recipe=path)
    t0 = time.perf_counter()
    try:
        cfg = build_config(path, list(overrides))
        if not cfg.job.target:
            raise ConfigError(
                "job.target: the TPU program compile needs a TPU target, e.g. v6e-256; allowed: "
                "a recipe with [job] target"
            )
        target = planner.parse_target(cfg.job.target)
        if target.device_type != "tpu":
            raise ConfigError(f"job.target: {target.name} is not a TPU; allowed: v5e, v5p, v6e, v7x targets")
        report.target, report.topology = target.name, topology_name(target)
        est = planned(cfg, target)
        report.planned_gib, report.usable_gib = est.total / GiB, est.usable / GiB
        report.planned_arguments_gib = (est.params + est.optimizer) / GiB
        report.hbm_gib = target.hbm_bytes / GiB
        report.tokens_per_device = (
            cfg.training.local_batch_size * cfg.training.seq_len * cfg.training.gradient_accumulation_steps
        )
        spec = dict(
            recipe=str(Path(path).resolve()),
            overrides=[list(o) for o in overrides],
            topology=report.topology,
            generation=target.generation.name,
            capture_only=capture_only,
        )
        # tools/deviceless_env.py: the one set-up of every deviceless compile (estimate_xla's too)
        env = deviceless_env(report.topology, extra=extra_env)
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
            tail = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()][-1:] or [f"exit {proc.returncode}"]
            raise RuntimeError(f"compile worker: {tail[0][:400]}")
        res = json.loads(lines[-1])
        for k in (
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
        ):
            if k in res:
                setattr(report, k, res[k])
        if capture_only:
            report.wall_s = time.perf_counter() - t0
            return report
        if report.memory:
            report.compiler_gib = compiler_total(report.memory) / GiB
        report.program = program_summary(report.kernels, report.collectives, report.scans)
        if res.get("error"):
            report.error = res["error"]
    except ConfigError as e:
        report.error = str(e)
    except subprocess.TimeoutExpired:
        report.error = f"the compile took longer than {timeout:.0f} s"
    except Exception as e:  # noqa: BLE001  (a check reports every failure as a row)
        report.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    report.wall_s = time.perf_counter() - t0
    return report


def program_summary(kernels: dict, collectives: dict, scans: int) -> str:
    k = ", ".join(f"{name} {n}" for name, n in sorted(kernels.items())) or "no kernel"
    c = ", ".join(f"{name} {n}" for name, n in sorted(collectives.items())) or "no collective"
    return f"{k}; {c}; {scans} scans"


# ---------------------------------------------------------------------------------------------
# The worker (ttpu venv): capture on the fake world, lower with explicit collectives, compile.

PROGRAM_NS = "titan_program"
_LIB: list = []


def _define_program_ops():
    """`titan_program::ragged_all_to_all` (torch-tpu's contract, titan_kernels/collectives.py) and the
    per-rank CP splash pair (`splash_cp_fwd/bwd`, `splash_cp_seg_fwd/bwd`, the rank and size as ints),
    shape-only, with autograd for the CP pair (the dispatch gets its backward from
    `titan_kernels.collectives.differentiable`, as on a TPU)."""
    import torch

    if _LIB:
        return getattr(torch.ops, PROGRAM_NS)
    lib = torch.library.Library(PROGRAM_NS, "DEF")  # noqa: TOR901 (kept alive in _LIB)
    lib.define(
        "ragged_all_to_all(Tensor operand, Tensor output, Tensor input_offsets, Tensor send_sizes, "
        "Tensor output_offsets, Tensor recv_sizes, str group_name) -> Tensor"
    )
    lib.define("splash_cp_fwd(Tensor q, Tensor k_all, Tensor v_all, int rank, int size) -> Tensor")
    lib.define(
        "splash_cp_bwd(Tensor q, Tensor k_all, Tensor v_all, Tensor dout, int rank, int size) "
        "-> (Tensor, Tensor, Tensor)"
    )
    lib.define(
        "splash_cp_seg_fwd(Tensor q, Tensor k_all, Tensor v_all, Tensor seg, Tensor seg_all, int rank, "
        "int size) -> Tensor"
    )
    lib.define(
        "splash_cp_seg_bwd(Tensor q, Tensor k_all, Tensor v_all, Tensor seg, Tensor seg_all, Tensor dout, "
        "int rank, int size) -> (Tensor, Tensor, Tensor)"
    )
    _LIB.append(lib)
    ns = f"{PROGRAM_NS}::"
    torch.library.register_fake(ns + "ragged_all_to_all", lib=lib)(
        lambda operand, output, *rest: torch.empty_like(output)
    )
    # The output has v's width (MLA: q/k 192, v 128), not q's.
    torch.library.register_fake(ns + "splash_cp_fwd", lib=lib)(
        lambda q, k, v, r, s: q.new_empty(*q.shape[:-1], v.shape[-1])
    )
    torch.library.register_fake(ns + "splash_cp_seg_fwd", lib=lib)(
        lambda q, k, v, a, b, r, s: q.new_empty(*q.shape[:-1], v.shape[-1])
    )
    torch.library.register_fake(ns + "splash_cp_bwd", lib=lib)(
        lambda q, k, v, d, r, s: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    )
    torch.library.register_fake(ns + "splash_cp_seg_bwd", lib=lib)(
        lambda q, k, v, a, b, d, r, s: (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    )
    op = getattr(torch.ops, PROGRAM_NS)

    def setup(ctx, inputs, output):
        ctx.save_for_backward(*(t for t in inputs if isinstance(t, torch.Tensor)))
        ctx.rank, ctx.size = inputs[-2], inputs[-1]

    def backward(ctx, dout):
        return (*op.splash_cp_bwd(*ctx.saved_tensors, dout.contiguous(), ctx.rank, ctx.size), None, None)

    def backward_seg(ctx, dout):
        return (
            *op.splash_cp_seg_bwd(*ctx.saved_tensors, dout.contiguous(), ctx.rank, ctx.size),
            None,
            None,
            None,
            None,
        )

    torch.library.register_autograd(ns + "splash_cp_fwd", backward, setup_context=setup, lib=lib)
    torch.library.register_autograd(ns + "splash_cp_seg_fwd", backward_seg, setup_context=setup, lib=lib)
    return op


def _cp_local_attention(rank: int, size: int):
    """The CP local product as a TPU run calls it (titan_kernels/tpu/register.py build_cp), as
    capture ops."""
    import torch

    op = _define_program_ops()

    def attention(q, k_all, v_all, segment_ids=None, segment_ids_all=None):
        q, k_all, v_all = q.contiguous(), k_all.contiguous(), v_all.contiguous()
        if segment_ids is None:
            return op.splash_cp_fwd(q, k_all, v_all, rank, size)
        return op.splash_cp_seg_fwd(
            q, k_all, v_all, segment_ids.to(torch.int32), segment_ids_all.to(torch.int32), rank, size
        )

    return attention


def refine_axes(boundaries: set[int], world: int) -> list[int]:
    """Row-major radices of the common refinement of mesh layouts over ranks 0..world-1.

    `boundaries`: the strides at which some layout starts a new axis (products of its trailing
    sizes). Sorted, each must divide the next, and the radices are their quotients (outermost
    first). E.g. world 256 as (dp_shard 256) and, for EP 8, (efsdp 32, ep 8): boundaries {1, 8,
    256} -> [32, 8]."""
    cuts = sorted(b for b in boundaries | {1, world} if 1 <= b <= world)
    for a, b in zip(cuts, cuts[1:]):
        if b % a:
            raise ValueError(
                f"mesh layouts do not nest (axis strides {cuts}); the program's groups are not products of mesh axes"
            )
    return [b // a for a, b in reversed(list(zip(cuts, cuts[1:])))] or [1]


def group_axes(ranks: list[int], radices: list[int]) -> tuple[int, ...]:
    """The refined axes (indices) whose span, from rank 0, is exactly `ranks`, in mesh order (the
    group's rank order is then row-major over them, as torch's mesh groups are)."""
    strides = [math.prod(radices[i + 1 :]) for i in range(len(radices))]
    axes = tuple(i for i, (r, s) in enumerate(zip(radices, strides)) if r > 1 and s in set(ranks))
    span = [0]
    for i in axes:
        span = [b + d * strides[i] for b in span for d in range(radices[i])]
    if sorted(span) != sorted(ranks):
        raise ValueError(f"process group of ranks {sorted(ranks)[:8]}... is not a product of mesh axes {radices}")
    return axes


def _capture(spec: dict) -> dict:
    """Step 1-2 of the module docstring: RECORD filled, plus the groups and the program counts."""
    import torch
    import torch._dynamo
    import torch.distributed as dist

    import planner
    from models.common import ops
    from models.common.stack import abstract_model
    from parallelisms.context_parallel import context_parallel_attention, cp_group
    from titan_kernels import collectives
    from titan_kernels.tpu import capture
    from tools.recipe_check import RecipeCheck, with_stand_ins
    from tools.xla_lowering import RECORD, CaptureDone, record_first_call
    from trainer.config import build_config
    from trainer.job import build_job

    cfg = build_config(spec["recipe"], [tuple(o) for o in spec["overrides"]])
    target = planner.parse_target(cfg.job.target)
    notes = RecipeCheck(recipe=spec["recipe"])
    cfg = with_stand_ins(cfg, notes)
    RECORD.clear()
    record_first_call(clone=False, stop=True)
    torch._dynamo.reset()
    program_op = _define_program_ops()
    t = time.perf_counter()
    with planner.fake_process_group(target.devices), abstract_model():
        job = build_job(cfg, purpose="check", device_type="tpu")
        if job.plan.step_plan.mode != "graph":
            raise ValueError(
                f"compile.mode: {job.plan.step_plan.mode}: the TPU program compile takes graph-mode recipes "
                "(one program per step); allowed: graph"
            )
        capture.install()  # splash, gmm, fused CE as opaque ops (after build_job: it clears the op table)
        collectives.serve(program_op.ragged_all_to_all)
        try:
            dims = job.plan.parallel_dims
            if dims.cp_enabled:
                cp = cp_group(job.data.mesh["cp"])
                local = _cp_local_attention(cp.rank, cp.size)
                ops.register(
                    "causal_attention",
                    lambda q, k, v, segment_ids=None: context_parallel_attention(
                        q, k, v, segment_ids, cp=cp, local_attention=local
                    ),
                )
            step = job.build_step(loss_fn=job.data.task.loss_fn(job.plan.step_plan))
            batch = job.data.task.example_batch(job.data.local_batch_size, device=job.runtime.device)
            try:
                step([batch] * job.data.grad_accum_steps, job.cfg.optimizer.lr)
            except CaptureDone:
                pass
        finally:
            collectives.serve(None)
        assert "pre" in RECORD, "the step was not captured"
        gm = RECORD["gm"]
        names = sorted(
            {
                a
                for m in gm.modules()
                if hasattr(m, "graph")
                for n in m.graph.nodes
                for a in n.args
                if isinstance(a, str) and _is_group_name(a)
            }
        )
        groups = {
            name: dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name)) for name in names
        }
    torch._dynamo.reset()
    # Mesh layouts over the world's ranks: the trainer's world mesh and, with EP, its expert mesh.
    world = target.devices
    bounds = set()
    for sizes in (dims.mesh_shape, (dims.dp_replicate, dims.efsdp, dims.ep)):
        bounds |= {math.prod(sizes[i:]) for i in range(len(sizes))}
    radices = refine_axes(bounds, world)
    return dict(
        gm=gm,
        groups=groups,
        radices=radices,
        mesh_shape=tuple(dims.mesh_shape),
        ep=dims.ep,
        capture_s=time.perf_counter() - t,
        notes=notes.notes,
        generation=spec["generation"],
        target=target.name,
    )


def _is_group_name(s: str) -> bool:
    return s.isdigit()  # c10d names its process groups by a decimal counter


def program_counts(gm) -> tuple[dict, dict, int]:
    """(kernels, collectives, scans) named in the graph's text (a scan body counted once)."""
    import torch

    kernels, colls, scans = {}, {}, 0
    for module in gm.modules():
        graph = getattr(module, "graph", None)
        if graph is None:
            continue
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            if n.target is torch.ops.higher_order.scan:
                scans += 1
                continue
            ns = getattr(getattr(n.target, "_schema", None), "name", "")
            if ns.startswith(("titan_capture::", f"{PROGRAM_NS}::")):
                op = ns.split("::")[1]
                if op == "ragged_all_to_all":
                    colls["ragged_all_to_all"] = colls.get("ragged_all_to_all", 0) + 1
                else:
                    kernels[op] = kernels.get(op, 0) + 1
            elif ns.startswith("_c10d_functional::") and "wait_tensor" not in ns:
                kind = ns.split("::")[1].split(".")[0]
                colls[kind] = colls.get(kind, 0) + 1
    return kernels, colls, scans


def kernel_model(gm, generation: str | None) -> dict:
    """`ProgramCompile.kernel_cost` from the captured graph: every `titan_capture::*` node, times
    the trips of the scans around it (a scan's trip count: its xs' leading dim), priced by the
    capture model (titan_kernels/tpu/capture.py) at the node's fake shapes (local: one device's)."""
    import torch

    from titan_kernels.tpu import capture

    out: dict = {}

    def shape(a):
        v = a.meta.get("val") if hasattr(a, "meta") else None
        return tuple(v.shape) if isinstance(v, torch.Tensor) else None

    def itemsize(a):
        return a.meta["val"].dtype.itemsize

    def visit(module, times: float):
        for n in module.graph.nodes:
            if n.op == "call_module":
                visit(getattr(module, n.target), times)
                continue
            if n.op != "call_function":
                continue
            if n.target is torch.ops.higher_order.scan:
                body = getattr(module, n.args[0].target)
                xs = [a for a in n.args[2] if shape(a)]
                visit(body, times * (shape(xs[0])[0] if xs else 1))
                continue
            subgraphs = [
                getattr(module, a.target)
                for a in n.args
                if isinstance(a, torch.fx.Node) and a.op == "get_attr" and hasattr(getattr(module, a.target), "graph")
            ]
            for sub in subgraphs:  # another higher-order op (a wrapped or invoked subgraph): runs once
                visit(sub, times)
            name = getattr(getattr(n.target, "_schema", None), "name", "")
            if not name.startswith("titan_capture::"):
                continue
            op = name.split("::")[1]
            a = n.args
            backward = op.endswith("_bwd")
            rows = 0
            if op.startswith("splash"):
                flops, nbytes = capture.splash_cost(
                    shape(a[0]),
                    shape(a[1])[1],
                    itemsize(a[0]),
                    backward=backward,
                    v_dim=shape(a[2])[-1],
                    causal=not op.startswith("splash_full"),
                )
            elif op.startswith("gmm"):
                (m, k), w = shape(a[0]), shape(a[1])
                rows = m
                flops, nbytes = capture.gmm_cost(m, k, w[2], w[0], itemsize(a[0]), backward=backward)
            elif op.startswith("ce"):
                (rows_, d), vocab = shape(a[0]), shape(a[1])[0]
                flops, nbytes = capture.ce_cost(
                    rows_, d, vocab, itemsize(a[0]), backward=backward, generation=generation
                )
            else:
                continue
            e = out.setdefault(op, {"calls": 0.0, "flops": 0.0, "bytes": 0.0, "rows": 0})
            e["calls"] += times
            e["flops"] += times * flops
            e["bytes"] += times * nbytes
            e["rows"] = max(e["rows"], rows)

    visit(gm, 1.0)
    return out


def permute_shift(output_split_sizes, input_split_sizes, size: int) -> int | None:
    """The shift of an all-to-all that is a permute, or None: rank 0's program sends all of its
    input to one rank d and receives as much from rank -d (mod size), as
    trainer/graph/pipeline.py `StagePermute` does (every rank r sends to r + d); the SPMD
    program is then the collective permute i -> i + d."""
    if not output_split_sizes or not input_split_sizes or size < 2:
        return None
    sent = [i for i, v in enumerate(input_split_sizes) if v]
    got = [i for i, v in enumerate(output_split_sizes) if v]
    if len(sent) != 1 or len(got) != 1 or len(input_split_sizes) != size:
        return None
    d = sent[0]
    if d == 0 or got[0] != (-d) % size or input_split_sizes[d] != output_split_sizes[got[0]]:
        return None
    return d


def _lowerings(env, *, axis_names: list[str], groups: dict, radices: list[int], generation: str) -> None:
    """torchax rules: collectives over their groups' mesh axes, kernels per device (no shard_map:
    the whole program already runs inside one)."""
    import jax
    import jax.numpy as jnp
    import torch
    from torchax import interop

    from titan_kernels.tpu import fused_ce, gmm, splash

    def axes(name: str):
        return tuple(axis_names[i] for i in group_axes(groups[name], radices))

    def size(name: str) -> int:
        return len(groups[name])

    def call(fn, *tensors):
        return interop.call_jax(fn, *tensors)

    c10d = torch.ops._c10d_functional

    def all_gather(x, group_size, group_name):
        return call(lambda a: jax.lax.all_gather(a, axes(group_name), axis=0, tiled=True), x)

    def reduce_scatter(x, reduce_op, group_size, group_name):
        def fn(a):
            out = jax.lax.psum_scatter(a, axes(group_name), scatter_dimension=0, tiled=True)
            return out / size(group_name) if reduce_op == "avg" else out

        return call(fn, x)

    def all_reduce(x, reduce_op, group_name):
        def fn(a):
            if reduce_op in ("sum", "avg"):
                out = jax.lax.psum(a, axes(group_name))
                return out / size(group_name) if reduce_op == "avg" else out
            return {"max": jax.lax.pmax, "min": jax.lax.pmin}[reduce_op](a, axes(group_name))

        return call(fn, x)

    def all_to_all(x, output_split_sizes, input_split_sizes, group_name):
        shift = permute_shift(output_split_sizes, input_split_sizes, size(group_name))
        if shift is not None:  # a permute (graph-mode pipeline parallelism): one collective permute
            n = size(group_name)
            perm = [(i, (i + shift) % n) for i in range(n)]
            return call(lambda a: jax.lax.ppermute(a, axes(group_name), perm), x)
        for splits in (output_split_sizes, input_split_sizes):
            assert splits is None or len(set(splits)) <= 1, f"unequal all-to-all splits {splits} in a traced program"
        return call(lambda a: jax.lax.all_to_all(a, axes(group_name), 0, 0, tiled=True), x)

    def coalesced(single):
        def fn(xs, *rest):
            return [single(x, *rest) for x in xs]

        return fn

    env.override_op_definition(c10d.all_gather_into_tensor.default, all_gather)
    env.override_op_definition(c10d.reduce_scatter_tensor.default, reduce_scatter)
    env.override_op_definition(c10d.all_reduce.default, all_reduce)
    env.override_op_definition(c10d.all_to_all_single.default, all_to_all)
    env.override_op_definition(c10d.all_gather_into_tensor_coalesced.default, coalesced(all_gather))
    env.override_op_definition(c10d.reduce_scatter_tensor_coalesced.default, coalesced(reduce_scatter))
    env.override_op_definition(c10d.wait_tensor.default, lambda x: x)

    program = getattr(torch.ops, PROGRAM_NS)

    def ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name):
        def fn(o, out, io, ss, oo, rs):
            i32 = jnp.int32
            return jax.lax.ragged_all_to_all(
                o, out, io.astype(i32), ss.astype(i32), oo.astype(i32), rs.astype(i32), axis_name=axes(group_name)
            )

        return call(fn, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes)

    env.override_op_definition(program.ragged_all_to_all.default, ragged)

    def cp_fwd(q, k, v, rank, size_, seg=None, seg_all=None):
        return splash.splash_cp_attention(q, k, v, seg, seg_all, cp_rank=rank, cp_size=size_)

    def cp_bwd(q, k, v, dout, rank, size_, seg=None, seg_all=None):
        f = lambda q, k, v: splash.splash_cp_attention(q, k, v, seg, seg_all, cp_rank=rank, cp_size=size_)  # noqa: E731
        return tuple(jax.vjp(f, q, k, v)[1](dout))

    env.override_op_definition(
        program.splash_cp_fwd.default, lambda q, k, v, r, s: call(lambda *a: cp_fwd(*a, r, s), q, k, v)
    )
    env.override_op_definition(
        program.splash_cp_bwd.default, lambda q, k, v, d, r, s: call(lambda *a: cp_bwd(*a, r, s), q, k, v, d)
    )
    env.override_op_definition(
        program.splash_cp_seg_fwd.default,
        lambda q, k, v, a, b, r, s: call(lambda q, k, v, a, b: cp_fwd(q, k, v, r, s, a, b), q, k, v, a, b),
    )
    env.override_op_definition(
        program.splash_cp_seg_bwd.default,
        lambda q, k, v, a, b, d, r, s: call(lambda q, k, v, a, b, d: cp_bwd(q, k, v, d, r, s, a, b), q, k, v, a, b, d),
    )

    cap = torch.ops.titan_capture

    def splash_bwd(q, k, v, dout, seg=None):
        return tuple(jax.vjp(lambda q, k, v: splash.splash_attention(q, k, v, seg), q, k, v)[1](dout))

    def gmm_fwd(x, w, sizes):
        return gmm.grouped_mm(x, w, sizes.astype(jnp.int32), generation=generation)

    def gmm_bwd(x, w, sizes, dy):
        return tuple(jax.vjp(lambda x, w: gmm_fwd(x, w, sizes), x, w)[1](dy))

    env.override_op_definition(cap.splash_fwd.default, lambda q, k, v: call(splash.splash_attention, q, k, v))
    env.override_op_definition(
        cap.splash_seg_fwd.default,
        lambda q, k, v, s: call(lambda q, k, v, s: splash.splash_attention(q, k, v, s), q, k, v, s),
    )
    env.override_op_definition(cap.splash_bwd.default, lambda q, k, v, d: call(splash_bwd, q, k, v, d))
    env.override_op_definition(
        cap.splash_seg_bwd.default,
        lambda q, k, v, s, d: call(lambda q, k, v, s, d: splash_bwd(q, k, v, d, s), q, k, v, s, d),
    )

    def splash_full(q, k, v):
        return splash.splash_attention(q, k, v, generation=generation, causal=False)

    env.override_op_definition(cap.splash_full_fwd.default, lambda q, k, v: call(splash_full, q, k, v))
    env.override_op_definition(
        cap.splash_full_bwd.default,
        lambda q, k, v, d: call(lambda q, k, v, d: tuple(jax.vjp(splash_full, q, k, v)[1](d)), q, k, v, d),
    )
    env.override_op_definition(cap.gmm.default, lambda x, w, s: call(gmm_fwd, x, w, s))
    env.override_op_definition(cap.gmm_bwd.default, lambda x, w, s, d: call(gmm_bwd, x, w, s, d))
    env.override_op_definition(
        cap.ce_fwd.default,
        lambda h, w, lab: call(lambda h, w, lab: fused_ce.forward_rows(h, w, lab, generation=generation), h, w, lab),
    )
    env.override_op_definition(
        cap.ce_bwd.default,
        lambda h, w, lab, lse, g: call(
            lambda h, w, lab, lse, g: fused_ce.backward_rows(h, w, lab, lse, g, generation=generation),
            h,
            w,
            lab,
            lse,
            g,
        ),
    )


def _lay_out(devices, mesh_shape, target: str, ep: int = 1):
    """(devices in `mesh_shape`, description): where the trainer's mesh axes sit on the chips.

    The trainer's layout (`parallelisms.tpu_topology.trainer_layout`): torch-tpu's own
    (`map_mesh`, the port the XLA tier checks against torch-tpu's `create_device_mesh`: whole
    physical axes, split ones where whole ones do not map) with compact EP groups where they
    apply, matched to the compile-only topology's devices by chip coordinates and core; JAX's
    `create_device_mesh` for a slice the port does not know."""
    import numpy as np
    from jax.experimental import mesh_utils

    from parallelisms.tpu_topology import topology_of, trainer_layout

    slices = len({getattr(d, "slice_index", 0) for d in devices})
    if slices > 1:  # the trainer's DCN split (`ParallelDims.dcn_mesh_shape`), as torch-tpu's hybrid mesh
        on_replicate = math.gcd(mesh_shape[0], slices)
        dcn = (on_replicate, slices // on_replicate) + (1,) * (len(mesh_shape) - 2)
        ici = tuple(m // d for m, d in zip(mesh_shape, dcn))
        laid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices=devices, allow_split_physical_axes=True)
        return laid, f"{slices} slices: DCN {dcn} x ICI {ici} (JAX's create_hybrid_device_mesh)"
    topology = topology_of(target)
    if topology is None or topology.devices != len(devices):
        laid = mesh_utils.create_device_mesh(mesh_shape, devices=devices, allow_split_physical_axes=True)
        return laid, "JAX's create_device_mesh (slice not known to the port)"
    mapping = trainer_layout(topology, mesh_shape, ep=ep)
    x_size, y_size, _ = topology.chips
    per_chip = topology.devices_per_chip
    by_id = {
        ((d.coords[2] * y_size + d.coords[1]) * x_size + d.coords[0]) * per_chip
        + (getattr(d, "core_on_chip", 0) if per_chip > 1 else 0): d
        for d in devices
    }
    assert len(by_id) == len(devices), "compile-only devices do not match the slice's chips"
    ids = np.asarray(mapping.device_ids)
    laid = np.vectorize(by_id.__getitem__, otypes=[object])(ids)
    return laid, f"{mapping.summary()} (torch-tpu's layout: {mapping.method})"


def worker(spec: dict) -> dict:
    """Capture, lower and compile one recipe's per-device program; a dict of results."""
    import copy

    import torch

    cap = _capture(spec)
    gm = cap["gm"]
    from tools.xla_lowering import RECORD, add_lowerings, as_jax_function, flip_count, load_torchax, mutated_inputs
    from trainer.graph.passes import tag_reverse_scans

    if flip_count(gm):
        gm = copy.deepcopy(gm)
        tag_reverse_scans(gm)
        RECORD["gm"] = gm
    kernels, colls, scans = program_counts(gm)
    kernel_cost = kernel_model(gm, cap["generation"])
    if spec.get("capture_only"):
        return dict(
            kernels=kernels,
            collectives=colls,
            scans=scans,
            capture_s=cap["capture_s"],
            notes=cap["notes"],
            kernel_cost=kernel_cost,
            radices=list(cap["radices"]),
        )
    torchax = load_torchax()
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    env = torchax.default_env()
    add_lowerings(env)
    radices = cap["radices"]
    axis_names = [f"a{i}" for i in range(len(radices))]
    _lowerings(env, axis_names=axis_names, groups=cap["groups"], radices=radices, generation=cap["generation"])
    devices = topology_devices(spec["topology"])
    laid, layout = _lay_out(devices, cap["mesh_shape"], cap["target"], cap.get("ep", 1))
    # The trainer's mesh laid on the chips, then refined row-major into the program's axes.
    mesh = Mesh(np.asarray(laid).reshape(radices), tuple(axis_names))
    every = PartitionSpec(tuple(axis_names))
    fn, idx = as_jax_function(RECORD)
    pre = RECORD["pre"]
    jdtype = {
        torch.float32: np.float32,
        torch.bfloat16: jax.numpy.bfloat16,
        torch.int64: np.int32,
        torch.int32: np.int32,
        torch.bool: np.bool_,
        torch.float16: np.float16,
    }
    n = len(devices)
    mutated = mutated_inputs(gm)
    written = [k for k, i in enumerate(idx) if i in mutated]

    def per_device(*tensors):  # each input is one device's tensor with a leading axis of 1
        outs, updated = fn(*[t[0] for t in tensors])
        return [o[None] for o in outs if o is not None], [updated[k][None] for k in written]

    abstract = [
        jax.ShapeDtypeStruct((n, *pre[i].shape), jdtype[pre[i].dtype], sharding=NamedSharding(mesh, every)) for i in idx
    ]
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    t = time.perf_counter()
    lowered = jax.jit(mapped).lower(*abstract)
    lower_s = time.perf_counter() - t
    result = dict(
        mesh=f"{layout}; axes {' x '.join(str(r) for r in radices)}",
        kernels=kernels,
        collectives=colls,
        scans=scans,
        capture_s=cap["capture_s"],
        lower_s=lower_s,
        notes=cap["notes"],
        device_kind=devices[0].device_kind,
        radices=list(radices),
        kernel_cost=kernel_cost,
        device_coords=[[*d.coords[:3], getattr(d, "core_on_chip", 0)] for d in np.asarray(mesh.devices).flat],
    )
    t = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # libtpu refuses a program whose buffers exceed the HBM: a verdict, not a failure
        message = str(e)
        result["compile_s"] = time.perf_counter() - t
        if "CompileTimeHbmOom" in message or "exceeds available HBM" in message:
            result["oom"] = " ".join(message.split())[:400]
            return result
        result["error"] = f"{type(e).__name__}: {' '.join(message.split())[:400]}"
        return result
    result["compile_s"] = time.perf_counter() - t
    mem = compiled.memory_analysis()
    names = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    result["memory"] = {k: int(getattr(mem, k)) for k in names if hasattr(mem, k)}
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    try:
        res = worker(spec)
    except Exception as e:  # noqa: BLE001  (the outer process reports it as the recipe's row)
        import traceback

        traceback.print_exc()
        res = {"error": f"{type(e).__name__}: {' '.join(str(e).split())[:400]}"}
    print(json.dumps(res, default=str), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
