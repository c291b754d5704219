"""Capture the train step as one ATen FX graph, run the passes, hand it to a compiler.

Route (the one that works with scan inside on torch 2.13, docs/graph_trainer.md):
`torch.compile(step, fullgraph=True)` with `torch._dynamo.config.trace_autograd_ops=True`
makes Dynamo trace `torch.autograd.grad` into the same graph as the forward and the
optimizer update. `CaptureBackend` is the Dynamo backend: it runs AOTAutograd, which
functionalizes that graph into ATen ops (the backward inline, in-place updates of
parameters and optimizer state kept as `copy_` into the inputs), and receives the ATen
`GraphModule` before any compiler sees it. There the pass pipeline runs, the graph is
dumped, and then it is compiled:
- `aot_eager`: the ATen graph runs as is (op by op), for debugging;
- `inductor`: through Inductor's own entry (`compile_fx`), whose inner compiler we wrap, so
  Inductor's decompositions apply and we transform exactly the graph it compiles;
- `tpu`: see trainer/graph/tpu.py.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable

import torch
from torch import fx

from models.errors import ConfigError
from trainer.graph.passes import GraphStats, graph_text, run_passes
from trainer.graph.remat import scan_remat
from trainer.step.plan import FLIP_FREE_BACKENDS, MODES


class CaptureBackend:
    """A `torch.compile` backend that keeps the captured graph, its stats and timings."""

    def __init__(
        self,
        *,
        backend: str,
        dump_path: str | None = None,
        reverse_scans: bool | None = None,
        fence_remat: bool | None = None,
        bucket_cap_mb: float = 0.0,
        gloo_all_to_all: bool = True,
        passes_as: str | None = None,
    ):
        assert backend in ("aot_eager", "inductor", "tpu"), backend
        self.backend = backend
        self.passes_as = passes_as or backend
        """The backend whose graph passes run: `backend`, or the target's when a check job
        (tools/recipe_check.py) captures with aot_eager what a TPU run would compile."""
        self.bucket_cap_mb = float(bucket_cap_mb)
        """Inductor: bucket independent all-gathers / reduce-scatters up to this size (0: off)."""
        self.dump_path = dump_path
        self.reverse_scans = self.passes_as in FLIP_FREE_BACKENDS if reverse_scans is None else reverse_scans
        """Run backward scans in reverse instead of over flipped copies; default: Inductor and
        tpu. Inductor: `scan_reverse_pass` (a reversed while loop; Inductor lowers every scan to
        such a loop anyway); tpu: `tag_reverse_scans` (the scan op stays, its body tagged for
        torch-tpu's reverse lowering; torch-tpu has no while_loop). aot_eager runs the
        Inductor rewrite when set (the XLA tier needs the scan op, so it leaves this off)."""
        self.gloo_all_to_all = gloo_all_to_all
        """Reduce-scatters on gloo groups as all-to-alls (`gloo_reduce_scatter_pass`)."""
        self.offload = "none"
        """`[activation_checkpoint] offload` (trainer.graph.passes.AC_OFFLOADS): block_inputs keeps
        the block inputs the forward scans save in host memory (`offload_block_inputs_pass`);
        set by the job (trainer/job.py) for graph + scan + full AC."""
        self.fence_remat = self.passes_as == "tpu" if fence_remat is None else fence_remat
        """Fence recomputed ops with optimization barriers, or XLA's CSE undoes checkpointing;
        default: the `tpu` backend. The XLA tier (aot_eager capture, torchax lowering) sets it."""
        self.graph_module: fx.GraphModule | None = None
        self.stats: GraphStats | None = None
        self.num_graphs = 0
        self.ready_at: float | None = None
        """perf_counter() when the compiled step first started running (end of compile)."""

    # Dynamo calls this with its (torch-level) graph once per compilation.
    def __call__(self, gm: fx.GraphModule, example_inputs: list) -> Callable:
        self.num_graphs += 1
        if self.backend == "tpu":
            from trainer.graph.tpu import compile_dynamo_graph

            return self._mark_ready(compile_dynamo_graph(gm, example_inputs, on_graph=self._on_graph))
        if self.backend == "inductor":
            from torch._inductor.compile_fx import compile_fx, compile_fx_inner

            def inner_compile(graph: fx.GraphModule, inputs, **kwargs):
                self._on_graph(graph)
                with torch._inductor.config.patch(self._inductor_options()):
                    return compile_fx_inner(graph, inputs, **kwargs)

            return self._mark_ready(compile_fx(gm, example_inputs, inner_compile=inner_compile))
        from functorch.compile import make_boxed_func
        from torch._functorch.aot_autograd import aot_module_simplified

        def run_as_is(graph: fx.GraphModule, inputs):
            self._on_graph(graph)
            return make_boxed_func(graph.forward)

        return self._mark_ready(
            aot_module_simplified(gm, example_inputs, fw_compiler=run_as_is, keep_inference_input_mutations=True)
        )

    def _inductor_options(self) -> dict:
        options = {}
        if self.stats.prefetched_gathers:
            # Inductor's peak-memory reordering would sink the prefetched all-gathers back
            # next to their waits (seen in its output code); keep the pass's order.
            options["reorder_for_peak_memory"] = False
        if self.bucket_cap_mb > 0 and self.stats.collectives:
            # Inductor's post-grad FX passes: independent collectives of one group and dtype
            # become one collective over a concatenated buffer per bucket (in graph order).
            # The size rule is part of Inductor's cache key, so it must pickle (no lambda).
            cap = functools.partial(_bucket_cap_mb, self.bucket_cap_mb)
            options.update(
                bucket_all_gathers_fx="all",
                bucket_reduce_scatters_fx="all",
                bucket_all_gathers_fx_bucket_size_determinator=cap,
                bucket_reduce_scatters_fx_bucket_size_determinator=cap,
            )
        return options

    def _on_graph(self, graph: fx.GraphModule) -> None:
        decompositions = None
        if self.reverse_scans and self.passes_as == "inductor":
            # scan_reverse_pass traces its loop into a graph Inductor has already decomposed.
            from torch._inductor.decomposition import select_decomp_table

            decompositions = select_decomp_table()
        reverse = ("tag" if self.passes_as == "tpu" else "loop") if self.reverse_scans else None
        self.stats = run_passes(
            graph,
            reverse_scans=reverse,
            decompositions=decompositions,
            fence_remat=self.fence_remat,
            gloo_all_to_all=self.gloo_all_to_all,
            offload=self.offload,
        )
        self.graph_module = graph
        if self.dump_path:
            with open(self.dump_path, "w") as f:
                f.write(graph_text(graph, self.stats))

    def _mark_ready(self, fn: Callable) -> Callable:
        def run(*args):
            if self.ready_at is None:
                self.ready_at = time.perf_counter()
            return fn(*args)

        # Inductor / AOT return boxed callables (they take one list and clear it).
        run._boxed_call = getattr(fn, "_boxed_call", False)
        return run


def _bucket_cap_mb(cap_mb: float, _bucket_index: int) -> float:
    """Inductor's bucket size rule: the same cap for every bucket."""
    return cap_mb


@contextlib.contextmanager
def capture_config(*, scan_ac_mode: str | None, meta: bool = False) -> contextlib.AbstractContextManager:
    """torch settings under which the step is traced (active on every call; cheap).

    `scan_ac_mode`: the activation-checkpoint mode for scan bodies, None when not scanning.
    `meta`: the step runs on meta tensors (the recipe check's and the TPU compile's capture on
    the fake world): `composite_autograd_on_meta` keeps autograd through composite ops.
    """
    with contextlib.ExitStack() as stack:
        if meta:
            stack.enter_context(composite_autograd_on_meta())
        # Trace loss.backward()/autograd.grad into the step graph instead of breaking it.
        stack.enter_context(torch._dynamo.config.patch(trace_autograd_ops=True))
        stack.enter_context(
            _patch_existing(
                torch._functorch.config,
                # Our remat pass replaces torch's (one backward region only, no attention).
                remat_using_tags_for_fwd_loss_bwd_graph=False,
                # A cache hit would skip our passes and leave no graph to inspect.
                enable_autograd_cache=False,
            )
        )
        if scan_ac_mode is not None:
            stack.enter_context(scan_remat(scan_ac_mode))
        yield


@functools.cache
def _meta_shadowed_composites() -> tuple:
    """The ATen overloads whose CompositeImplicitAutograd kernel torch shadows on meta tensors.

    `torch._meta_registrations.activate_meta` registers every decomposition as a Python `Meta`
    kernel (`py_impl(DispatchKey.Meta)`), composite ops included (`aten.nll_loss`,
    `aten.where.ScalarOther`, `aten.var`, `aten.dropout`, ...: 108 overloads on torch 2.13). Under
    the Python dispatcher, which Dynamo enables while it traces, `torch._ops.resolve_key` then
    finds a backend kernel for `AutogradMeta` and skips the composite kernel, so autograd falls
    back to "not implemented" (`WarnNotImplemented`): on meta tensors the op's gradient is lost
    (None with `allow_unused`), or, behind a DTensor's `to_local`, a plain tensor reaches
    `Redistribute.backward` ("'FakeTensor' object has no attribute '_local_tensor'"). On CPU or
    GPU tensors the Meta kernel is not consulted and the composite kernel runs."""
    from torch._C import DispatchKey
    from torch._decomp import global_decomposition_table

    ops = {
        op
        for table in global_decomposition_table.values()
        for op in table
        if isinstance(op, torch._ops.OpOverload)
        and DispatchKey.Meta in op.py_kernels
        and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    }
    return tuple(sorted(ops, key=str))


@contextlib.contextmanager
def composite_autograd_on_meta() -> contextlib.AbstractContextManager:
    """Trace composite ops on meta tensors as on any device: while active, the Python `Meta`
    kernels of `_meta_shadowed_composites` are unregistered, so their composite kernel
    decomposes them under autograd (what the C++ dispatcher does on meta outside Dynamo, and
    what a CPU capture does). Restored on exit; a capture on real tensors never needs it."""
    from torch._C import DispatchKey

    kernels = {
        op: op.py_kernels.pop(DispatchKey.Meta)
        for op in _meta_shadowed_composites()
        if DispatchKey.Meta in op.py_kernels
    }
    for op in kernels:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, fn in kernels.items():
            op.py_kernels[DispatchKey.Meta] = fn
            op._dispatch_cache.clear()


def _patch_existing(config, **values):
    # Older torch (>= 2.11 is supported) may lack a flag; then there is nothing to switch.
    return config.patch(**{k: v for k, v in values.items() if hasattr(config, k)})


def check_torch() -> None:
    """Graph mode needs Dynamo to trace autograd.grad (torch >= 2.11 has the flag)."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        raise ConfigError(
            f"compile.mode: graph needs torch._dynamo.config.trace_autograd_ops "
            f"(torch {torch.__version__} lacks it); allowed here: {', '.join(m for m in MODES if m != 'graph')}"
        )
