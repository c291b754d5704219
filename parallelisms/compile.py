"""Per-block torch.compile for `[compile] mode = "compile"`.

Each child of the plan's block container is compiled in place with `fullgraph=True`
(`nn.Module.compile` keeps the module and its parameter paths; only its call is routed
through the compiled function). Compiling per block lets every block share one compiled
graph, keeps compile time flat in the number of layers, and traces SimpleFSDP's
all-gathers / reduce-scatters and the TP collectives into each block's graph.

On the TPU backend each block's forward is traced under torch-tpu's `spmd_safe`: torch-tpu's
SplitCompiler otherwise cuts every compiled graph at each collective not so marked, so each
all-gather and reduce-scatter would run as an executable of its own, between the pieces of the
block, with nothing overlapping it. Every rank runs the same blocks with the same shapes, which
is what the annotation asserts; it reaches the AOT backward graph too (the XLA tier's
torch-tpu path probe, `compile_blocks*` variants, counts one partition per block forward and
backward with it, and the splits without it).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from models.common.plan import ModelPlan

__all__ = ["apply_compile"]


def apply_compile(
    model: nn.Module, *, plan: ModelPlan, backend: str, spmd_safe: Callable[[Callable], Callable] | None = None
) -> nn.Module:
    """Compile every block of `model` in place with `backend` (e.g. "inductor").

    `spmd_safe`: a decorator for each block's forward, applied before compiling (the forward
    of the block's class is wrapped on the instance, so module paths and state-dict keys stay);
    default: torch-tpu's `torch.tpu.distributed.spmd_safe` on the `tpu` backend, none otherwise.
    """
    if spmd_safe is None and backend == "tpu":
        import torch

        spmd_safe = torch.tpu.distributed.spmd_safe  # installed by torch-tpu on a TPU host
    for _, block in plan.iter_blocks(model):
        if spmd_safe is not None:
            block.forward = spmd_safe(block.forward)
        block.compile(backend=backend, fullgraph=True)
    return model
