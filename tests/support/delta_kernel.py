"""The TPU delta-rule op's autograd without the TPU, for measuring what a step keeps.

`kernel` has the signature of the op registered as `gated_delta_rule` on TPU and keeps what its
`setup` keeps (the prepared q, k, v, g, beta, the start state and the document resets,
titan_kernels' register.py), with the forward values from the torch reference; its backward is
never called. The planner's tests count the saved tensors of a block or of the CP wrapper with it
(tests/unit/test_planner_delta_block.py, test_planner_cp_linear.py)."""

from __future__ import annotations

import torch

from models.common import gated_delta


class KernelOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, h0, reset):
        ctx.save_for_backward(q, k, v, g, beta, h0, reset)
        with torch.no_grad():
            out, state = gated_delta.chunk_gated_delta_rule(
                *(t.transpose(1, 2) for t in (q, k, v, g, beta)), initial_state=h0, output_final_state=True
            )
        return out.transpose(1, 2).float().contiguous(), state

    @staticmethod
    def backward(ctx, d_out, d_state):  # never called: only what the forward keeps is measured
        raise NotImplementedError


def kernel(q, k, v, g, beta, *, chunk_size=64, **kwargs):
    return gated_delta.call_prepared(KernelOp.apply, q, k, v, g, beta, **kwargs)
