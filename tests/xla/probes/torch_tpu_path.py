"""Probe (ttpu venv): torch-tpu's `tpu` compile backend on a fake 2-rank SimpleFSDP graph step,
run up to its lowering call `fx_to_mlir` (which needs a live TPU: it builds the MLIR and the PJRT
executable in one call; reference/xla_cpu_path.md §D).

    python torch_tpu_path.py unrolled|scan|unrolled_unannotated [...]

Rank 0 of a fake process group of 2 (`FakeStore`, no peer) builds the Llama 3 debug flavor
(2 layers) with SimpleFSDP over dp_shard = 2 and `build_graph_step(backend="tpu")`. Three
stand-ins let the real path run on a CPU host: the step's backend check accepts `tpu` on this
device, `trainer.graph.tpu` gets `torch.tpu` without a TPU present, and torch-tpu's
`fx_to_mlir` records the graph it receives and raises. Everything between is real: Dynamo with
`spmd_safe`, our AOT capture and passes, torch-tpu's TpuBackend (its own AOT, GQA folding),
`SplitCompiler` (which splits the program at each collective not marked spmd_safe) and
`StaticCompiler`.

`unrolled_unannotated` is the control: the same step without `spmd_safe`, which SplitCompiler
must split at its collectives (so the one-partition check of the other variants can fail).

Prints one JSON line: {"versions": ..., "variants": {variant: result}}.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import traceback

import torch


class ReachedLowering(Exception):
    """Raised by the stand-in for torch-tpu's fx_to_mlir."""


def _compute_nodes(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "output"))


def _collectives(gm) -> list:
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and str(getattr(n.target, "namespace", "")) == "_c10d_functional"
            and "wait_tensor" not in str(n.target)]


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


def run(variant: str, seen: dict) -> dict:
    from models.llama3 import FLAVORS, Transformer
    from models.llama3.plan import PLAN
    from parallelisms import ParallelDims, build_mesh, parallelize_model
    from trainer.graph import build_graph_step
    from trainer.optim import build_optimizer

    seen.clear()
    dims = ParallelDims(world_size=2, dp_shard=2)
    mesh = build_mesh(dims, "cpu")
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, max_seq_len=32)  # SDPA: no kernel selected
    with torch.device("meta"):
        model = Transformer(args)
    parallelize_model(model, plan=PLAN, parallel_dims=dims, mesh=mesh, param_dtype=torch.float32,
                      reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    opt = build_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    import trainer.graph.tpu as graph_tpu

    annotate = graph_tpu.spmd_safe
    if variant == "unrolled_unannotated":
        graph_tpu.spmd_safe = lambda fn: fn
    try:
        step = build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="tpu",
                                scan_layers=(variant == "scan"), plan=PLAN)
    finally:
        graph_tpu.spmd_safe = annotate
    tokens = torch.randint(0, args.vocab_size, (2, 33), generator=torch.Generator().manual_seed(0))
    start = time.perf_counter()
    try:
        step([(tokens[:, :-1], tokens[:, 1:])], 1e-3)
        chain = "the step ran to completion (fx_to_mlir was not reached)"
    except Exception as e:  # walk the chain: Dynamo wraps backend errors
        err, chain = e, []
        while err is not None:
            chain.append(type(err).__name__)
            err = err.__cause__ or err.__context__
        chain = " <- ".join(chain)
    res = {"seconds": time.perf_counter() - start, "exception_chain": chain,
           "reached_fx_to_mlir": "mlir" in seen}
    project = step.graph_module
    if project is not None:
        res["project_nodes"] = _compute_nodes(project)
        res["project_collectives"] = len(_collectives(project))
        res["project_scans"] = _scans(project)
    if "split" in seen:
        split = seen["split"]
        coll = _collectives(split)
        res["split_input_nodes"] = _compute_nodes(split)
        res["split_collectives"] = len(coll)
        res["split_collectives_spmd_safe"] = sum(
            1 for n in coll if n.meta.get("custom", {}).get("spmd_safe", False))
        res["split_scans"] = _scans(split)
        res["split_body_collectives"], res["split_body_collectives_spmd_safe"] = _body_collectives(split)
    if "mlir" in seen:
        gm = seen["mlir"]
        res["mlir_nodes"] = _compute_nodes(gm)
        res["mlir_scans"] = _scans(gm)
        res["mlir_collectives"] = len(_collectives(gm))
    return res


def main() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch_tpu  # noqa: F401  (autoload is off: installs torch.tpu and the `tpu` backend, no device)
    import torch_tpu._internal.export as tpu_export
    from torch_tpu._internal.compile import split_compiler

    import trainer.graph.step as graph_step
    import trainer.graph.tpu as graph_tpu

    seen: dict = {}
    graph_step._check_backend_device = lambda backend, device_type: None  # `tpu` on a CPU process
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
            results[variant] = run(variant, seen)
        except Exception as e:
            results[variant] = {"error": f"{type(e).__name__}: {e}"[:2000], "traceback": traceback.format_exc()[-3000:]}
    import importlib.metadata as md

    versions = {p: md.version(p) for p in ("torch", "torch-tpu", "libtpu")}
    print(json.dumps({"versions": versions, "variants": results}))


if __name__ == "__main__":
    main()
