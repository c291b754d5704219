"""Tensor (and sequence) parallelism from a model's declarative plan.

`apply_tp` reads `ModelPlan.tp` (paths relative to the model) and `ModelPlan.tp_block`
(paths relative to each block), maps each style string to a
`torch.distributed.tensor.parallel` style and applies it with `parallelize_module` on the
`tp` mesh. Between blocks the residual stream is sequence-sharded (dim 1), as in
TorchTitan; inside attention the heads are split (local heads = n_heads / tp), so the
model's `view(bsz, seqlen, -1, head_dim)` sees the local head count. Buffers (RoPE
tables) are not touched and stay replicated plain tensors.

Loss parallel (`enable_loss_parallel=True`) leaves the logits as a vocab-sharded DTensor;
compute the loss inside `loss_parallel_context(True)`. By default the logits are gathered
to full vocab and returned as a plain tensor.
"""

from __future__ import annotations

import contextlib

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from models.common.plan import ModelPlan

__all__ = ["apply_tp", "loss_parallel_context", "style_for"]


class GatherSequenceInput(ParallelStyle):
    """All-gather the first positional input from sequence shards to the full sequence.

    Like `PrepareModuleInput(input_layouts=(Shard(1), ...), desired_input_layouts=
    (Replicate(), ...))` but independent of how many other inputs the module takes. The
    result stays a DTensor so that the colwise projections consume it directly and the
    backward of the gather is a reduce-scatter of their partial input gradients.
    """

    def __init__(self, sequence_dim: int = 1) -> None:
        self.sequence_dim = sequence_dim

    def _gather(self, module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        x, *rest = args
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, (Shard(self.sequence_dim),), run_check=False)
        x = x.redistribute(mesh, (Replicate(),))
        return (x, *rest)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(lambda mod, args: self._gather(mod, args, device_mesh))
        return module


def style_for(style: str, *, enable_loss_parallel: bool = False) -> ParallelStyle:
    """The parallel style object of one plan entry (see models/common/plan.py)."""
    if style == "embedding":
        result = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    elif style == "colwise":
        result = ColwiseParallel()
    elif style == "rowwise":
        result = RowwiseParallel(output_layouts=Shard(1))
    elif style == "sequence_parallel":
        result = SequenceParallel()
    elif style == "head_norm":
        # (batch, seq, heads, head_dim): heads are the TP-sharded dim here.
        result = SequenceParallel(sequence_dim=2, use_local_output=True)
    elif style == "block_input":
        result = GatherSequenceInput()
    elif style == "output":
        result = ColwiseParallel(
            input_layouts=Shard(1),
            output_layouts=Shard(-1) if enable_loss_parallel else Replicate(),
            use_local_output=not enable_loss_parallel,
        )
    else:
        raise AssertionError(f"unknown TP style {style!r}")
    # Every rank holds the same (meta or seeded) weights: take the local copy instead of
    # broadcasting/scattering from rank 0, which also keeps meta-device TP free of comms.
    result.src_data_rank = None
    return result


def apply_tp(
    model: nn.Module,
    *,
    plan: ModelPlan,
    tp_mesh: DeviceMesh,
    enable_loss_parallel: bool = False,
) -> nn.Module:
    """Shard `model` in place over `tp_mesh` following `plan`; returns the model."""
    root = {path: style_for(style, enable_loss_parallel=enable_loss_parallel)
            for path, style in plan.tp.items()}
    if root:
        parallelize_module(model, tp_mesh, root)
    blocks = getattr(model, plan.block)
    for block in blocks.values():
        parallelize_module(block, tp_mesh, {path: style_for(style)
                                            for path, style in plan.tp_block.items()})
    return model


def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Context for the loss computation: `loss_parallel()` when logits are vocab-sharded."""
    return loss_parallel() if enabled else contextlib.nullcontext()
