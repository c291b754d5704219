"""Steps 1-2 of tools/tpu_compile.py (the `tools.tpu_compile` worker, `ttpu` venv): the trainer's
step captured on the target's fake world with the TPU kernels as opaque ops, and what the
captured program holds (kernels, collectives, scans, the kernels' cost model).

`_capture(spec)` fills tools/xla_lowering.py's RECORD and answers the process groups' ranks and
the program's mesh axes (`refine_axes`); `program_counts` and `kernel_model` read the captured
graph. Importing this module imports neither jax nor torchax (torch only inside the functions).
"""

from __future__ import annotations

import math
import time

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
    """Steps 1-2 of tools/tpu_compile.py's docstring: RECORD filled, plus the process groups' ranks
    and the program's mesh axes (`radices`)."""
    import torch._dynamo

    import planner
    from tools.recipe_check import RecipeCheck, with_stand_ins
    from tools.xla_lowering import RECORD, record_first_call
    from trainer.config import build_config

    cfg = build_config(spec["recipe"], [tuple(o) for o in spec["overrides"]])
    target = planner.parse_target(cfg.job.target)
    notes = RecipeCheck(recipe=spec["recipe"])
    cfg = with_stand_ins(cfg, notes)
    RECORD.clear()
    record_first_call(clone=False, stop=True)
    torch._dynamo.reset()
    t = time.perf_counter()
    with planner.fake_process_group(target.devices):
        gm, groups, dims = _captured_step(cfg)
    torch._dynamo.reset()
    return dict(
        gm=gm,
        groups=groups,
        radices=_program_radices(dims, target.devices),
        mesh_shape=dims.layout_shape,  # pp (graph-mode PP) folded into dp_replicate, the same rank order
        ep=dims.ep,
        capture_s=time.perf_counter() - t,
        notes=notes.notes,
        generation=spec["generation"],
        target=target.name,
    )


def _captured_step(cfg):
    """The trainer's start-up and its step, captured once on the fake world (which must be open):
    (the captured graph, {group name: ranks}, the ParallelDims)."""
    from models.common.stack import abstract_model
    from titan_kernels import collectives
    from titan_kernels.tpu import capture
    from tools.xla_lowering import RECORD, CaptureDone
    from trainer.job import build_job

    program_op = _define_program_ops()
    with abstract_model():
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
                _serve_cp_attention(job)
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
        return gm, _group_ranks(gm), dims


def _serve_cp_attention(job) -> None:
    """`causal_attention` as a CP run serves it: the all-gathered k/v and this rank's CP splash."""
    from models.common import ops
    from parallelisms.context_parallel import context_parallel_attention, cp_group

    cp = cp_group(job.data.mesh["cp"])
    local = _cp_local_attention(cp.rank, cp.size)
    ops.register(
        "causal_attention",
        lambda q, k, v, segment_ids=None: context_parallel_attention(
            q, k, v, segment_ids, cp=cp, local_attention=local
        ),
    )


def _group_ranks(gm) -> dict:
    """{process group name: its ranks} of every group the captured graph names (fake world open)."""
    import torch.distributed as dist

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
    return {name: dist.get_process_group_ranks(dist.distributed_c10d._resolve_process_group(name)) for name in names}


def _program_radices(dims, world: int) -> list[int]:
    """The program's mesh axes: the common refinement of the mesh layouts over the world's ranks,
    the trainer's world mesh and, with EP, its expert mesh."""
    bounds = set()
    for sizes in ((dims.pp, *dims.mesh_shape), (dims.dp_replicate, dims.efsdp, dims.ep)):
        bounds |= {math.prod(sizes[i:]) for i in range(len(sizes))}
    return refine_axes(bounds, world)


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
    """`ProgramCompile.kernel_cost` from the captured graph: every kernel node (`titan_capture::*`,
    and the per-rank CP splash `titan_program::splash_cp_*`), times the trips of the scans around
    it (a scan's trip count: its xs' leading dim), priced by the capture model
    (titan_kernels/tpu/capture.py) at the node's fake shapes (local: one device's)."""
    import torch

    out: dict = {}

    def visit(module, times: float):
        for n in module.graph.nodes:
            if n.op == "call_module":
                visit(getattr(module, n.target), times)
                continue
            if n.op != "call_function":
                continue
            if n.target is torch.ops.higher_order.scan:
                body = getattr(module, n.args[0].target)
                xs = [a for a in n.args[2] if _shape(a)]
                visit(body, times * (_shape(xs[0])[0] if xs else 1))
                continue
            subgraphs = [
                getattr(module, a.target)
                for a in n.args
                if isinstance(a, torch.fx.Node) and a.op == "get_attr" and hasattr(getattr(module, a.target), "graph")
            ]
            for sub in subgraphs:  # another higher-order op (a wrapped or invoked subgraph): runs once
                visit(sub, times)
            name = getattr(getattr(n.target, "_schema", None), "name", "")
            if not name.startswith(("titan_capture::", f"{PROGRAM_NS}::splash_cp")):
                continue
            op = name.split("::")[1]
            priced = _kernel_price(op, n.args, generation)
            if priced is None:
                continue
            flops, nbytes, rows = priced
            e = out.setdefault(op, {"calls": 0.0, "flops": 0.0, "bytes": 0.0, "rows": 0})
            e["calls"] += times
            e["flops"] += times * flops
            e["bytes"] += times * nbytes
            e["rows"] = max(e["rows"], rows)

    visit(gm, 1.0)
    return out


def _shape(a):
    """A graph node's fake tensor shape, or None."""
    import torch

    v = a.meta.get("val") if hasattr(a, "meta") else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def _itemsize(a) -> int:
    return a.meta["val"].dtype.itemsize


def _static_window(node, depth: int = 6) -> int | None:
    """The value of a sink call's window when the graph makes it from a constant (`aten.full`,
    then views and casts: titan_kernels/tpu/capture.py `sink_attention` on an int window), else
    None (a buffer or a scanned slice of one: known on the device only)."""
    import torch

    for _ in range(depth):
        if not isinstance(node, torch.fx.Node) or node.op != "call_function":
            return None
        if node.target is torch.ops.aten.full.default:
            return int(node.args[1])
        tensors = [x for x in node.args if isinstance(x, torch.fx.Node)]
        if len(tensors) != 1:
            return None
        node = tensors[0]
    return None


def _kernel_price(op: str, a, generation: str | None):
    """(FLOPs, HBM bytes, rows) of one call of kernel op `op` with the node args `a` (the capture
    model's, titan_kernels/tpu/capture.py; rows: a grouped matmul's rows, else 0), or None for an
    op the model does not price. A sink call (args `q, k, v, sinks, window, ..., sliding_window`)
    is priced by `capture.sink_cost`: the window a device value that picks the sliding or the
    causal kernel per layer (gpt-oss's buffer), the mean of the two; a window made in the graph
    from an int (`torch.full`: DeepSeek-V4's), the sliding kernel's price (`_static_window`)."""
    from titan_kernels.tpu import capture

    backward = op.endswith("_bwd")
    if op.startswith("splash_cp"):  # (q, k_all, v_all, ..., rank, size): the ranks' ints last
        q, k = _shape(a[0]), _shape(a[1])
        flops, nbytes = capture.splash_cp_cost(
            q, k[2], k[1], _itemsize(a[0]), backward, v_dim=_shape(a[2])[-1], cp_rank=a[-2], cp_size=a[-1]
        )
        return flops, nbytes, 0
    if op.startswith("sink"):
        sliding = int(a[-1])
        static = sliding > 0 and _static_window(a[4]) == sliding
        flops, nbytes = capture.sink_cost(
            _shape(a[0]), _shape(a[1])[1], _itemsize(a[0]), backward, _shape(a[2])[-1], sliding, static
        )
        return flops, nbytes, 0
    if op.startswith("splash"):
        flops, nbytes = capture.splash_cost(
            _shape(a[0]),
            _shape(a[1])[1],
            _itemsize(a[0]),
            backward=backward,
            v_dim=_shape(a[2])[-1],
            causal=not op.startswith("splash_full"),
            forward_again=not op.startswith("sink"),
        )
        return flops, nbytes, 0
    if op.startswith("gmm"):
        (m, k), w = _shape(a[0]), _shape(a[1])
        flops, nbytes = capture.gmm_cost(m, k, w[2], w[0], _itemsize(a[0]), backward=backward)
        return flops, nbytes, m
    if op.startswith("ce"):
        (rows, d), vocab = _shape(a[0]), _shape(a[1])[0]
        flops, nbytes = capture.ce_cost(rows, d, vocab, _itemsize(a[0]), backward=backward, generation=generation)
        return flops, nbytes, 0
    if op.startswith("gated_delta"):
        b, h, s, dk = _shape(a[0])
        return (*capture.gated_delta_cost(b, h, s, dk, _shape(a[2])[-1], backward=backward), 0)
    return None
