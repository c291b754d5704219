"""Per-block torch.compile for `[compile] mode = "compile"`.

Each child of the plan's block container is compiled in place with `fullgraph=True`
(`nn.Module.compile` keeps the module and its parameter paths; only its call is routed
through the compiled function). Compiling per block lets every block share one compiled
graph, keeps compile time flat in the number of layers, and traces SimpleFSDP's
all-gathers / reduce-scatters and the TP collectives into each block's graph.
"""

from __future__ import annotations

from torch import nn

from models.common.plan import ModelPlan

__all__ = ["apply_compile"]


def apply_compile(model: nn.Module, *, plan: ModelPlan, backend: str) -> nn.Module:
    """Compile every block of `model` in place with `backend` (e.g. "inductor")."""
    for _, block in plan.iter_blocks(model):
        block.compile(backend=backend, fullgraph=True)
    return model
