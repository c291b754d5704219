"""Probe (ttpu venv): torch-tpu's `tpu` compile backend on a fake 2-rank SimpleFSDP graph step,
run up to its lowering call `fx_to_mlir` (which needs a live TPU: it builds the MLIR and the PJRT
executable in one call; reference/xla_cpu_path.md §D).

    python torch_tpu_path.py unrolled|scan|unrolled_unannotated|scan_flipped|tpu_unrolled|tpu_scan|tpu_moe_ep2[...]|compile_blocks[_unannotated] [...]

Rank 0 of a fake process group of 2 (`FakeStore`, no peer) builds the Llama 3 debug flavor
(2 layers) with SimpleFSDP over dp_shard = 2 and `build_graph_step(backend="tpu")`. Stand-ins
let the real path run on a CPU host: the step's backend check accepts `tpu` on this device,
`trainer.graph.tpu` gets `torch.tpu` without a TPU present, and torch-tpu's `fx_to_mlir`
records the graph it receives and raises. Everything between is real: Dynamo with `spmd_safe`,
our AOT capture and passes (for scans: `tag_reverse_scans`), torch-tpu's TpuBackend (its own
AOT, GQA folding), `SplitCompiler` (which splits the program at each collective not marked
spmd_safe) and `StaticCompiler`.

Variants:
- `unrolled`, `scan`: fp32 parameters, math SDPA, the plain loss, no activation checkpointing;
- `unrolled_unannotated`: the control, `unrolled` without `spmd_safe`, which SplitCompiler must
  split at its collectives (so the one-partition check of the others can fail);
- `scan_flipped`: the control of the reverse tag, `scan` without `tag_reverse_scans`
  (`CaptureBackend.reverse_scans = False`): torch's flipped backward reaches the lowering;
- `tpu_unrolled`, `tpu_scan`: the path a TPU run takes, as the trainer plans it
  (`plan_step(device_type="tpu", ac_mode="full", fused_loss="auto")`): bf16 parameters and
  compute (fp32 reduce), the `titan_tpu::*` Pallas ops of titan_kernels/tpu/register.py (splash
  attention, the fused linear + cross-entropy loss; built through torch-tpu's `jax_op`, with
  the device check `_on_tpu` forced true, as tests/xla/probes/kernels_register.py does: the
  tensors are CPU tensors here), activation checkpointing full (the recomputed ops fenced by
  `titan::optimization_barrier`), layer scan with the reverse-tagged backward scan.
- `tpu_moe_ep2`, `tpu_moe_ep2_unrolled`, `tpu_moe_ep2_equal`: the same TPU plan for the Qwen 3
  MoE debug flavor (`debugmodel_moe`, 2 layers, 8 experts top-2) at ep = 2 (dp_shard = 2, experts
  split over the 2 ranks), with the aux loss: the static-shape dispatch
  (`dispatch_combine_static`), the experts through `titan_tpu::gmm_t` (the `grouped_mm` op
  registered too). `tpu_moe_ep2` (layer scan) and `_unrolled` move the rows with torch-tpu's
  `torch.tpu.ops.ragged_all_to_all`, which `select_dispatch` picks on a TPU (its device check is
  forced here: CPU tensors; the op's Meta kernel traces); `_equal` (layer scan) with the
  equal-split all-to-alls of a traced non-TPU step, the control for the gradient. Also recorded:
  the shapes reaching the lowering (any symbolic one), host reads, the grouped-matmul and
  all-to-all ops per graph, and the ops torch's autograd warned it backpropagated through
  without an autograd kernel (a silently dropped gradient).

- `tpu_cp2`, `tpu_cp2_doc`: the same TPU plan (layer scan) for Llama 3 debug at cp = 2 (the fake
  world of 2 is one cp group; SimpleFSDP shards over dp_shard x cp = 2) at seq 512, so each of the
  2 x cp chunks is one 128-token splash tile. Attention is what `build_job` registers on a TPU
  with cp > 1 (`cp_attention_fn`): k/v (and, with `document_mask`, the segment ids) all-gathered
  over cp, and rank 0's own splash ops `titan_tpu::splash_cp2r0_fwd / _bwd` (`_seg_` with the
  document mask) from `register.build_cp`; the device check (`q.device.type == "tpu"`) is forced
  as for the other Pallas ops. The micro-batch is the LM task's CP shard (`LMTask.prepare`: chunks
  0 and 3 of the window, with their global RoPE positions) and the loss its CP loss (the token
  count all-reduced over cp). `_doc`: two documents per window (`[training] document_mask`).

`compile_blocks`, `compile_blocks_unannotated`: `[compile] mode = "compile"` instead of graph mode
(`run_compile_blocks`): each block compiled with the `tpu` backend under `spmd_safe`
(parallelisms/compile.py), or without it (the control); torch-tpu's per-partition compiler is
replaced by a recorder so that forward and backward both compile, and every SplitCompiler call
is recorded with the partitions it made.

For every scan that reaches the lowering the probe then calls torch-tpu's own scan lowering
(`torch_tpu/_internal/compile/scan.py: _handle_scan_impl`, what `fx_to_mlir`'s interpreter
dispatches the scan op to) on CPU stand-ins of its operands, with the device-bound calls
replaced by recorders: `tpu_torch_compile.placeholder(_like)` (CPU tensors), the body's
`fx_to_mlir` (records the body, returns a stub module) and `create_scan_op` (records its
`scan_direction`). So the direction recorded is the one torch-tpu's code picks for the graph
it would lower.

Prints one JSON line: {"versions": ..., "variants": {variant: result}}.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
import time
import traceback
import warnings

import torch
from torch import fx


class ReachedLowering(Exception):
    """Raised by the stand-in for torch-tpu's fx_to_mlir."""


def _compute_nodes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def _collectives(gm) -> list:
    return [
        n
        for n in gm.graph.nodes
        if n.op == "call_function"
        and str(getattr(n.target, "namespace", "")) == "_c10d_functional"
        and "wait_tensor" not in str(n.target)
    ]


def _scans(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.higher_order.scan)


def _body_collectives(gm) -> tuple[int, int]:
    """(collectives, spmd_safe ones) inside the graph's subgraphs (scan bodies)."""
    total = safe = 0
    for name, sub in gm.named_modules():
        if name and hasattr(sub, "graph"):
            coll = _collectives(sub)
            total += len(coll)
            safe += sum(1 for n in coll if n.meta.get("custom", {}).get("spmd_safe", False))
    return total, safe


def _all_graphs(gm) -> list:
    return [gm, *(sub for name, sub in gm.named_modules() if name and hasattr(sub, "graph"))]


def _count(gm, pred) -> int:
    return sum(1 for g in _all_graphs(gm) for n in g.graph.nodes if n.op == "call_function" and pred(n))


def _op_name(n) -> str:
    target = n.target
    return target.name() if hasattr(target, "name") and callable(target.name) else str(target)


def _fences_a_reduce_scatter(barrier) -> bool:
    """Whether an optimization barrier is `fence_reduce_scatters_pass`'s: its operand is a
    reduce-scatter's waited result (the remat fences take recomputed or forward values)."""
    operands = barrier.args[0] if barrier.args and isinstance(barrier.args[0], (list, tuple)) else barrier.args
    return any(
        isinstance(x, fx.Node)
        and _op_name(x).endswith("wait_tensor")
        and isinstance(x.args[0], fx.Node)
        and "reduce_scatter" in _op_name(x.args[0])
        for x in operands
    )


def _kernels(variant: str) -> None:
    """Serve the model's ops as a TPU run does (titan_kernels.select on a TPU): the Pallas ops."""
    from models.common import ops
    from titan_kernels.tpu import register

    impls = register.build()
    register._on_tpu = lambda *tensors: True  # CPU tensors here; the real check is the device type
    for op in ops.OPS:
        moe_op = op != "grouped_mm" or variant.startswith("tpu_moe")
        ops.register(op, impls[op] if variant.startswith("tpu_") and moe_op else None)


MOE_VARIANTS = {
    "tpu_moe_ep2": {"scan": True, "ragged": True},
    "tpu_moe_ep2_unrolled": {"scan": False, "ragged": True},
    "tpu_moe_ep2_equal": {"scan": True, "ragged": False},
}
"""Qwen 3 MoE debug (2 layers) at ep 2: layer scan or unrolled; torch-tpu's ragged all-to-all as a
TPU run selects it (`select_dispatch`), or the equal-split all-to-alls of a traced CPU step."""


def _ragged_as_on_tpu(on: bool) -> None:
    """`select_dispatch` picks torch-tpu's `ragged_all_to_all` for these CPU tensors, as for TPU
    ones, through the same wrapper (`collectives.differentiable`) a TPU run gets."""
    from parallelisms import expert_parallel
    from titan_kernels import collectives

    expert_parallel.ragged_all_to_all_for = (
        (lambda device: collectives.differentiable(torch.tpu.ops.ragged_all_to_all))
        if on
        else collectives.ragged_all_to_all_for
    )


CP_VARIANTS = {"tpu_cp2": {"document_mask": False}, "tpu_cp2_doc": {"document_mask": True}}
"""Llama 3 debug (2 layers, layer scan) at cp 2, seq 512: the CP splash ops of rank 0, without
and with the document mask (segment ids)."""
CP_SEQ_LEN = 512
"""2 x cp chunks of 128 tokens: splash's tile (the TPU rule `training.seq_len / (2 cp) % 128`)."""


def _cp_setup(mesh, plan, tokens: torch.Tensor, document_mask: bool):
    """Attention and data as `build_job` sets them up on a TPU with cp > 1, on CPU tensors: the
    CP attention over rank 0's splash ops (device check forced), the LM task's CP shard of one
    micro-batch and its CP loss. Returns (micro-batch, loss_fn)."""
    from models.common import ops
    from parallelisms.context_parallel import context_parallel_attention, cp_group
    from titan_kernels.tpu import register
    from trainer.config import Config
    from trainer.tasks.lm import LMSettings, LMTask

    cp = cp_group(mesh["cp"])
    local = register.build_cp(cp.rank, cp.size)  # what cp_attention_fn(cp, "tpu") builds on a TPU

    def attention(q, k, v, segment_ids=None):  # cp_attention_fn's closure with q.device.type forced "tpu"
        return context_parallel_attention(q, k, v, segment_ids, cp=cp, local_attention=local)

    ops.register("causal_attention", attention)
    task = LMTask.__new__(LMTask)  # no tokenizer or loader: only its CP shard and loss
    task.settings = LMSettings.of(Config())  # global positions (no step plan: no restart)
    task.cp = cp  # what the constructor keeps of its `cp` argument
    task.args = None  # the model's args: only read for `mtp_depth` (none here: the plain LM loss)
    batch = (tokens[:, :-1], tokens[:, 1:])
    if document_mask:  # two documents per window, the second starting at token 200
        seg = (torch.arange(tokens.shape[1] - 1) >= 200).to(torch.int32).expand(tokens.shape[0], -1)
        batch = (*batch, seg.contiguous())
    return task.prepare(batch), task.loss_fn(plan)


def run(variant: str, seen: dict) -> dict:
    if variant in MOE_VARIANTS:
        from models.qwen3 import FLAVORS, Transformer
        from models.qwen3.plan import PLAN
    else:
        from models.llama3 import FLAVORS, Transformer
        from models.llama3.plan import PLAN
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from trainer.graph import build_graph_step
    from trainer.optim import build_optimizer
    from trainer.step.plan import plan_step

    seen.clear()
    tpu_run = variant.startswith("tpu_")
    moe, cp = MOE_VARIANTS.get(variant), CP_VARIANTS.get(variant)
    scan = variant in ("scan", "scan_flipped", "tpu_scan") or bool(moe and moe["scan"]) or cp is not None
    seq_len = CP_SEQ_LEN if cp else 32
    plan = plan_step(
        mode="graph",
        backend="tpu",
        scan_layers=scan,
        ac_mode="full" if tpu_run else "none",
        device_type="tpu",
        fused_loss="auto" if tpu_run else "off",
        model_has_hidden=True,
        cp_degree=2 if cp else 1,
        seq_len=seq_len,
        document_mask=bool(cp and cp["document_mask"]),
        model_document_mask=cp is not None,
    )
    _kernels(variant)
    _ragged_as_on_tpu(bool(moe and moe["ragged"]))
    dtype = torch.bfloat16 if tpu_run else torch.float32
    dims = ParallelDims(world_size=2, dp_shard=1 if cp else 2, cp=2 if cp else 1, ep=2 if moe else 1)
    mesh = build_mesh(dims, "cpu")
    args = dataclasses.replace(FLAVORS["debugmodel_moe" if moe else "debugmodel"], n_layers=2, max_seq_len=seq_len)
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_model(
        model,
        plan=PLAN,
        parallel_dims=dims,
        mesh=mesh,
        param_dtype=dtype,
        reduce_dtype=torch.float32,
        ac_mode=plan.block_ac,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    opt = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    import trainer.graph.tpu as graph_tpu

    tokens = torch.randint(0, args.vocab_size, (2, seq_len + 1), generator=torch.Generator().manual_seed(0))
    micro_batch, loss_fn = (tokens[:, :-1], tokens[:, 1:]), plan.lm_loss
    if cp:
        micro_batch, loss_fn = _cp_setup(mesh, plan, tokens, cp["document_mask"])
    annotate = graph_tpu.spmd_safe
    if variant == "unrolled_unannotated":
        graph_tpu.spmd_safe = lambda fn: fn
    try:
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend=plan.backend,
            scan_layers=plan.scan,
            ac_mode=plan.scan_ac,
            plan=PLAN,
            loss_fn=loss_fn,
            aux_loss_coef=1e-3 if moe else 0.0,
        )
    finally:
        graph_tpu.spmd_safe = annotate
    if variant == "scan_flipped":
        step.capture.reverse_scans = False  # torch's flipped backward scan, as before tag_reverse_scans
    start = time.perf_counter()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                step([micro_batch], 1e-3)
            finally:
                seen["no_autograd"] = sorted(
                    {
                        str(w.message).split(":")[0]
                        for w in caught
                        if "autograd kernel was not registered" in str(w.message)
                    }
                )
        chain = "the step ran to completion (fx_to_mlir was not reached)"
    except Exception as e:  # walk the chain: Dynamo wraps backend errors
        err, chain = e, []
        while err is not None:
            chain.append(type(err).__name__)
            err = err.__cause__ or err.__context__
        chain = " <- ".join(chain)
        if not isinstance(e, ReachedLowering) and "ReachedLowering" not in chain:
            seen["error_text"] = f"{type(e).__name__}: {e}"[:3000] + "\n" + traceback.format_exc()[-4000:]
    res = {
        "seconds": time.perf_counter() - start,
        "exception_chain": chain,
        "reached_fx_to_mlir": "mlir" in seen,
        "plan": {
            "param_dtype": str(dtype),
            "block_ac": plan.block_ac,
            "scan_ac": plan.scan_ac,
            "fused_loss": plan.fused_loss,
            "scan": plan.scan,
        },
    }
    if moe:  # ops backpropagated through without an autograd kernel (torch's warning: zero gradient)
        res["backprop_without_autograd_kernel"] = seen.get("no_autograd")
    if "mlir" not in seen:
        res["error_text"] = seen.get("error_text")
    project = step.graph_module
    if project is not None:
        res["project_nodes"] = _compute_nodes(project)
        res["project_collectives"] = len(_collectives(project))
        res["project_scans"] = _scans(project)
        res["project_flips"] = _count(project, lambda n: n.target is torch.ops.aten.flip.default)
        if step.stats is not None:
            res["project_recomputed"] = step.stats.recomputed
    if "split" in seen:
        split = seen["split"]
        coll = _collectives(split)
        res["split_input_nodes"] = _compute_nodes(split)
        res["split_collectives"] = len(coll)
        res["split_collectives_spmd_safe"] = sum(1 for n in coll if n.meta.get("custom", {}).get("spmd_safe", False))
        res["split_scans"] = _scans(split)
        res["split_body_collectives"], res["split_body_collectives_spmd_safe"] = _body_collectives(split)
    if "mlir" in seen:
        gm = seen["mlir"]
        res["mlir_nodes"] = _compute_nodes(gm)
        res["mlir_scans"] = _scans(gm)
        res["mlir_collectives"] = len(_collectives(gm))
        names = [_op_name(n) for g in _all_graphs(gm) for n in g.graph.nodes if n.op == "call_function"]
        res["mlir_flips"] = sum(1 for name in names if name in ("aten::flip", "prims::rev"))
        res["mlir_titan_tpu_ops"] = dict(
            sorted(collections.Counter(name for name in names if name.startswith("titan_tpu::")).items())
        )
        barriers = [n for g in _all_graphs(gm) for n in g.graph.nodes if _op_name(n) == "titan::optimization_barrier"]
        fences = sum(1 for n in barriers if _fences_a_reduce_scatter(n))
        res["mlir_barriers"] = len(barriers) - fences  # the remat fences
        res["mlir_reduce_scatter_fences"] = fences
        res["mlir_sdpa"] = sum(1 for name in names if "scaled_dot_product" in name)
        res["mlir_bf16_matmuls"], res["mlir_matmuls"] = _matmul_dtypes(gm)
        res["scan_lowering"] = _lower_scans(gm, seen)
        if moe:
            res.update(_static_facts(gm))
        if cp:
            res.update(_cp_facts(gm))
    return res


def _cp_facts(gm) -> dict:
    """Per graph (the step, the forward scan body, the backward one): the collectives and the CP
    splash ops that reach the lowering, and every flip with its operand's shape (the CP gather
    puts the late chunks back in global order with a flip over the cp axis, `_rank_major_to_global`;
    a flip over a scan's layer axis would be one `tag_reverse_scans` missed)."""
    per_graph, flips = [], []
    for i, g in enumerate(_all_graphs(gm)):
        names = collections.Counter()
        for n in g.graph.nodes:
            if n.op != "call_function":
                continue
            name = _op_name(n)
            if name.startswith(("_c10d_functional::", "titan_tpu::splash")) and "wait_tensor" not in name:
                names[name] += 1
            if name in ("aten::flip", "prims::rev"):
                src = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
                flips.append({"graph": i, "shape": list(getattr(src, "shape", ())), "dims": list(n.args[1])})
        per_graph.append(dict(sorted(names.items())))
    return {"cp_per_graph": per_graph, "cp_flips": flips}


def _static_facts(gm) -> dict:
    """What the static-shape MoE step must hand the lowering: int shapes only, no host read."""
    symbolic, missing, ops = [], 0, collections.Counter()
    for g in _all_graphs(gm):
        for n in g.graph.nodes:
            if n.op == "call_function":
                ops[_op_name(n)] += 1
            if n.op not in ("placeholder", "call_function"):
                continue
            vals = n.meta.get("val")
            if vals is None:
                missing += n.op == "call_function" and _op_name(n) not in ("_operator.getitem",)
                continue
            for v in vals if isinstance(vals, (list, tuple)) else [vals]:
                if isinstance(v, torch.Tensor) and not all(type(d) is int for d in v.shape):
                    symbolic.append(f"{n.name}: {_op_name(n)} {tuple(v.shape)}")
                elif isinstance(v, torch.SymInt | torch.SymFloat | torch.SymBool):
                    symbolic.append(f"{n.name}: {_op_name(n)} {v}")
    host = {
        k: c
        for k, c in ops.items()
        if k in ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select")
    }
    return {
        "mlir_symbolic_shapes": symbolic[:20],
        "mlir_symbolic_count": len(symbolic),
        "mlir_nodes_without_val": missing,
        "mlir_host_reads": host,
        "mlir_gmm": {k: c for k, c in ops.items() if "gmm" in k or "grouped_mm" in k},
        "mlir_all_to_all": {k: c for k, c in ops.items() if "all_to_all" in k},
        "mlir_per_graph": [
            dict(
                sorted(
                    collections.Counter(
                        _op_name(n)
                        for n in g.graph.nodes
                        if n.op == "call_function"
                        and any(k in _op_name(n) for k in ("gmm", "all_to_all", "grouped_mm"))
                    ).items()
                )
            )
            for g in _all_graphs(gm)
        ],
    }


def _matmul_dtypes(gm) -> tuple[int, int]:
    """(matmuls whose output is bf16, all matmuls) over the graph and its scan bodies."""
    mm = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default)
    bf16 = total = 0
    for g in _all_graphs(gm):
        for n in g.graph.nodes:
            if n.op == "call_function" and n.target in mm:
                total += 1
                val = n.meta.get("val")
                bf16 += int(getattr(val, "dtype", None) == torch.bfloat16)
    return bf16, total


def _lower_scans(gm, seen: dict) -> list:
    """Run torch-tpu's scan lowering on each scan of `gm` (module docstring) on CPU stand-ins of its operands; one record each:
    the body's tagged nodes, whether torch-tpu asks for reverse, the direction it passed to
    `create_scan_op`, and the error if its lowering failed before that."""
    import types

    from torch_tpu._internal.compile import scan as tpu_scan

    from trainer.graph.passes import SCAN_REVERSE_ANNOTATION

    real = tpu_scan.tpu_torch_compile

    # The operands' stand-ins live where the graph was captured (the CPU; on a TPU they are TPU
    # placeholders): the body's own ops name that device (e.g. `_to_copy(device=cpu)`).
    def meta(t):
        return torch.empty(t.shape, dtype=t.dtype) if isinstance(t, torch.Tensor) else t

    def create_scan_op(*, inits, inputs, body_module, scan_direction, dummy_ys, num_scan_inputs):
        seen["scan_calls"].append(
            {
                "direction": scan_direction.name,
                "num_scan_inputs": num_scan_inputs,
                "inits": len(inits),
                "inputs": len(inputs),
                "ys": len(dummy_ys),
            }
        )
        return [*inits, *dummy_ys]

    stub = types.SimpleNamespace(
        ScanDirection=real.ScanDirection,
        create_scan_op=create_scan_op,
        placeholder=lambda shape, dtype, requires_grad=False, is_pinned_host=False: torch.empty(shape, dtype=dtype),
        placeholder_like=lambda t, is_pinned_host=False: torch.empty(t.shape, dtype=t.dtype),
    )

    def body_fx_to_mlir(graph_module, args):
        seen["body_lowered"] = _compute_nodes(graph_module)
        assert len(args) == len([n for n in graph_module.graph.nodes if n.op == "placeholder"])
        return types.SimpleNamespace(module="stub body module")

    out = []
    real_export = tpu_scan.export
    tpu_scan.tpu_torch_compile = stub
    tpu_scan.export = types.SimpleNamespace(fx_to_mlir=body_fx_to_mlir)
    try:
        for node in gm.graph.find_nodes(op="call_function", target=torch.ops.higher_order.scan):
            body = getattr(gm, node.args[0].target)
            init, xs, additional = (fx.node.map_arg(a, lambda n: meta(n.meta["val"])) for a in node.args[1:])
            tagged = sum(1 for n in body.graph.nodes if n.meta.get("custom", {}).get(SCAN_REVERSE_ANNOTATION))
            rec = {
                "body_nodes": len(body.graph.nodes),
                "body_tagged_nodes": tagged,
                "asks_for_reverse": tpu_scan._body_asks_for_reverse(body),
                "xs": len(xs),
            }
            seen["scan_calls"] = []
            try:
                tpu_scan._handle_scan_impl(body, list(init), list(xs), list(additional))
            except Exception as e:
                rec["error"] = f"{type(e).__name__}: {e}"[:1500]
                rec["traceback"] = traceback.format_exc()[-2500:]
            if seen["scan_calls"]:
                rec.update(seen["scan_calls"][0])
            rec["body_lowered"] = seen.pop("body_lowered", None)
            out.append(rec)
    finally:
        tpu_scan.tpu_torch_compile = real
        tpu_scan.export = real_export
    return out


COMPILE_VARIANTS = ("compile_blocks", "compile_blocks_unannotated")
"""`[compile] mode = "compile"` on the tpu backend: each block compiled on its own (parallelisms/
compile.py, under torch-tpu's `spmd_safe`); the control without the annotation."""


def run_compile_blocks(variant: str) -> dict:
    """Llama 3 debug (2 layers, fp32, plain loss, no AC) with SimpleFSDP over dp_shard = 2 and
    `compile_backend="tpu"`, as `parallelize_model` builds it for compile mode on a TPU; one
    forward and backward. torch-tpu's TpuBackend runs for real (Dynamo, its AOT, SplitCompiler);
    its per-partition compiler (`StaticCompiler.__call__`, which lowers and needs a TPU) is
    replaced by a recorder that returns the partition's graph to run on the CPU, so the backward
    is compiled too. Recorded per SplitCompiler call: forward or backward, its functional
    collectives, how many carry `spmd_safe`, and the partitions it made."""
    import functools

    from torch_tpu._internal.compile import compiler as tpu_compiler
    from torch_tpu._internal.compile import split_compiler

    import parallelisms.parallelize as parallelize_mod
    from models.llama3 import FLAVORS, Transformer
    from models.llama3.plan import PLAN
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from parallelisms.compile import apply_compile
    from trainer.step.loss import lm_loss

    torch._dynamo.reset()
    calls: list = []
    real_static, real_split = tpu_compiler.StaticCompiler.__call__, split_compiler.SplitCompiler._compile_graph

    def static_call(self, graph_module, example_inputs, is_fwd=True, module_name=None, **kwargs):
        calls[-1]["partitions"] += 1
        calls[-1]["partition_nodes"].append(_compute_nodes(graph_module))
        return graph_module  # runs the partition on the CPU

    def split_call(self, graph_module, example_inputs, is_fwd=True, *args, **kwargs):
        coll = _collectives(graph_module)
        calls.append(
            {
                "is_fwd": is_fwd,
                "nodes": _compute_nodes(graph_module),
                "collectives": len(coll),
                "spmd_safe": sum(1 for n in coll if n.meta.get("custom", {}).get("spmd_safe", False)),
                "partitions": 0,
                "partition_nodes": [],
            }
        )
        return real_split(self, graph_module, example_inputs, is_fwd, *args, **kwargs)

    tpu_compiler.StaticCompiler.__call__ = static_call
    split_compiler.SplitCompiler._compile_graph = split_call
    real_apply = parallelize_mod.apply_compile
    if variant == "compile_blocks_unannotated":
        parallelize_mod.apply_compile = functools.partial(apply_compile, spmd_safe=lambda fn: fn)
    start = time.perf_counter()
    try:
        dims = ParallelDims(world_size=2, dp_shard=2)
        mesh = build_mesh(dims, "cpu")
        args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, max_seq_len=32)
        with torch.device("meta"):
            model = Transformer(args)
        parallelize_model(
            model,
            plan=PLAN,
            parallel_dims=dims,
            mesh=mesh,
            param_dtype=torch.float32,
            reduce_dtype=torch.float32,
            compile_backend="tpu",
        )
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights()
        tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
        with torch._functorch.config.patch(enable_autograd_cache=False):
            loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
            loss.backward()
        grads = sum(1 for p in model.parameters() if p.grad is not None)
    finally:
        tpu_compiler.StaticCompiler.__call__ = real_static
        split_compiler.SplitCompiler._compile_graph = real_split
        parallelize_mod.apply_compile = real_apply
        torch._dynamo.reset()
    wrapped = [type(b.forward).__name__ for _, b in PLAN.iter_blocks(model)]
    return {
        "seconds": time.perf_counter() - start,
        "split_calls": calls,
        "params_with_grad": grads,
        "params": sum(1 for _ in model.parameters()),
        "block_forward_types": wrapped,
    }


def main() -> None:
    import torch.distributed as dist
    import torch_tpu  # noqa: F401  (autoload is off: installs torch.tpu and the `tpu` backend, no device)
    import torch_tpu._internal.export as tpu_export
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch_tpu._internal.compile import split_compiler

    import trainer.graph.tpu as graph_tpu

    seen: dict = {}
    graph_tpu._torch_tpu = lambda: torch.tpu

    def fx_to_mlir(graph_module, *args, **kwargs):
        seen["mlir"] = graph_module
        raise ReachedLowering("fx_to_mlir reached")

    tpu_export.fx_to_mlir = fx_to_mlir
    original = split_compiler.SplitCompiler._compile_graph

    def compile_graph(self, graph_module, *args, **kwargs):
        seen["split"] = graph_module
        return original(self, graph_module, *args, **kwargs)

    split_compiler.SplitCompiler._compile_graph = compile_graph
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch.set_num_threads(1)
    results = {}
    for variant in sys.argv[1:]:
        try:
            results[variant] = run_compile_blocks(variant) if variant in COMPILE_VARIANTS else run(variant, seen)
        except Exception as e:
            results[variant] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("torch", "torch-tpu", "libtpu")}
    print(json.dumps({"versions": versions, "variants": results}))


if __name__ == "__main__":
    main()
