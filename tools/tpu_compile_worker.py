"""Steps 3-4 of tools/tpu_compile.py (the `tools.tpu_compile` worker, `ttpu` venv): the captured
program lowered by torchax with its collectives over the mesh axes of their groups and the
kernels for the target's generation, laid on the compile-only topology, compiled, and its memory
analysis read (`worker`; `main` is `python -m tools.tpu_compile SPEC`).
"""

from __future__ import annotations

import json
import math
import time

from tools.tpu_compile_capture import (
    PROGRAM_NS,
    _capture,
    group_axes,
    kernel_model,
    program_counts,
)


def topology_devices(topology: str):
    """The compile-only devices of `topology_name`'s string: jax's topology, and with `,slices=N`
    N slices of it (jax's `num_slices`: MegaScale devices carrying `slice_index`, slice-major)."""
    from jax.experimental import topologies

    name, _, slices = topology.partition(",slices=")
    extra = {"num_slices": int(slices)} if slices else {}
    return topologies.get_topology_desc(topology_name=name, platform="tpu", **extra).devices


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
    the whole program already runs inside one) with the blocks of the target's `generation`
    (titan_kernels/tpu/tiles.toml)."""
    from torchax import interop

    from tools.xla_lowering import add_offload_lowerings

    def axes(name: str):
        return tuple(axis_names[i] for i in group_axes(groups[name], radices))

    def size(name: str) -> int:
        return len(groups[name])

    _collective_rules(env, interop.call_jax, axes, size)
    _program_rules(env, interop.call_jax, axes)
    _kernel_rules(env, interop.call_jax, generation)
    # The layer scan's offloaded block inputs (`[activation_checkpoint] offload`) in pinned host memory.
    add_offload_lowerings(env, host=True)


def _collective_rules(env, call, axes, size) -> None:
    """torch's functional collectives (`_c10d_functional`) as JAX collectives over `axes(group)`;
    an all-to-all that is a permute (`permute_shift`) as one collective permute."""
    import jax
    import torch

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


def _program_rules(env, call, axes) -> None:
    """The `titan_program::*` ops: the EP dispatch's ragged all-to-all over `axes(group)` and the
    per-rank CP splash pair (titan_kernels/tpu/splash.py `splash_cp_attention`)."""
    import jax
    import jax.numpy as jnp
    import torch

    from titan_kernels.tpu import splash

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


def _kernel_rules(env, call, generation: str | None) -> None:
    """The `titan_capture::*` ops (titan_kernels/tpu/capture.py) as the Pallas kernels a TPU run
    calls (`capture.kernel_functions`: splash, splash with sinks, megablox gmm, fused CE, the delta
    rule), each with the blocks of the target's `generation` (titan_kernels/tpu/tiles.toml), the
    causal splash included: without it the splash kernels took the default blocks and a VMEM
    failure of the tile table's blocks stayed hidden from `check_recipe --compile`."""
    import functools

    import torch

    from titan_kernels.tpu import capture

    cap = torch.ops.titan_capture
    for name, fn in capture.kernel_functions(generation).items():
        env.override_op_definition(getattr(cap, name).default, functools.partial(call, fn))


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
    cap = _capture(spec)
    gm = _reverse_scans(cap["gm"])
    kernels, colls, scans = program_counts(gm)
    result = dict(
        kernels=kernels,
        collectives=colls,
        scans=scans,
        capture_s=cap["capture_s"],
        notes=cap["notes"],
        kernel_cost=kernel_model(gm, cap["generation"]),
        radices=list(cap["radices"]),
    )
    if spec.get("capture_only"):
        return result
    lowered, lowering = _lower(spec, cap, gm)
    result.update(lowering)
    _compile(lowered, result)
    return result


def _reverse_scans(gm):
    """The captured graph with torch 2.13's scan-backward flips dropped and the backward scans
    tagged reverse (trainer.graph.passes.tag_reverse_scans; the graph torch-tpu lowers), a copy
    that replaces RECORD's graph; `gm` itself when it has no flips."""
    import copy

    from tools.xla_lowering import RECORD, flip_count
    from trainer.graph.passes import tag_reverse_scans

    if flip_count(gm):
        gm = copy.deepcopy(gm)
        tag_reverse_scans(gm)
        RECORD["gm"] = gm
    return gm


def _jax_dtype(dtype):
    """The JAX dtype of a torch input dtype (int64 as int32, as torchax lowers it)."""
    import jax
    import numpy as np
    import torch

    return {
        torch.float32: np.float32,
        torch.bfloat16: jax.numpy.bfloat16,
        torch.int64: np.int32,
        torch.int32: np.int32,
        torch.bool: np.bool_,
        torch.float16: np.float16,
    }[dtype]


def _lower(spec: dict, cap: dict, gm):
    """Step 3: the program lowered inside one shard_map over the target's compile-only topology,
    the trainer's mesh laid on its chips: (the Lowered, the result's mesh and lowering fields)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    from tools.xla_lowering import RECORD, add_lowerings, as_jax_function, load_torchax, mutated_inputs

    torchax = load_torchax()
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
    mutated = mutated_inputs(gm)
    written = [k for k, i in enumerate(idx) if i in mutated]

    def per_device(*tensors):  # each input is one device's tensor with a leading axis of 1
        outs, updated = fn(*[t[0] for t in tensors])
        return [o[None] for o in outs if o is not None], [updated[k][None] for k in written]

    abstract = [
        jax.ShapeDtypeStruct(
            (len(devices), *pre[i].shape), _jax_dtype(pre[i].dtype), sharding=NamedSharding(mesh, every)
        )
        for i in idx
    ]
    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    t = time.perf_counter()
    lowered = jax.jit(mapped).lower(*abstract)
    return lowered, dict(
        mesh=f"{layout}; axes {' x '.join(str(r) for r in radices)}",
        lower_s=time.perf_counter() - t,
        device_kind=devices[0].device_kind,
        device_coords=[[*d.coords[:3], getattr(d, "core_on_chip", 0)] for d in np.asarray(mesh.devices).flat],
    )


MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "peak_memory_in_bytes",
)
"""The compiled program's `memory_analysis()` fields kept (`ProgramCompile.memory`)."""


def _compile(lowered, result: dict) -> None:
    """Step 4: compile for the target and add to `result` the compile time and the memory
    analysis, or libtpu's refusal: `oom` (the program exceeds the HBM: a verdict) or `error`."""
    t = time.perf_counter()
    try:
        compiled = lowered.compile()
    except Exception as e:  # libtpu refuses a program whose buffers exceed the HBM: a verdict, not a failure
        message = str(e)
        result["compile_s"] = time.perf_counter() - t
        if "CompileTimeHbmOom" in message or "exceeds available HBM" in message:
            result["oom"] = " ".join(message.split())[:400]
        else:
            result["error"] = f"{type(e).__name__}: {' '.join(message.split())[:400]}"
        return
    result["compile_s"] = time.perf_counter() - t
    mem = compiled.memory_analysis()
    result["memory"] = {k: int(getattr(mem, k)) for k in MEMORY_FIELDS if hasattr(mem, k)}


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
