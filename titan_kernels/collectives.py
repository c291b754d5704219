"""Ragged all-to-all for MoE expert parallelism: torch-tpu's op on TPU, an emulation elsewhere.

The contract is torch-tpu's `torch.tpu.ops.ragged_all_to_all(operand, output, input_offsets,
send_sizes, output_offsets, recv_sizes, process_group_name)` (XLA's ragged all-to-all): this
rank sends rows `input_offsets[j] : input_offsets[j] + send_sizes[j]` of `operand` to rank `j`,
which writes them into its copy of `output` starting at row `output_offsets[j]` (the offset as
the sender sees it); `recv_sizes[j]` rows arrive from rank `j`; rows nobody writes keep the
values of `output`. Offsets and sizes are device tensors: nothing is read on the host, shapes
are those of `operand` and `output`, and only the real rows travel.

- `ragged_all_to_all_for(device)`: the op for tensors on `device`: torch-tpu's on a TPU (the
  process that holds a TPU tensor has imported torch-tpu already; nothing here imports it),
  else None (the caller takes its own equal-split path).
- `emulate_ragged_all_to_all`: the same contract from torch's equal-split functional
  all-to-all on worst-case buffers (`max_rows` per peer), differentiable, on any backend. It
  lets CPU tests check offset arithmetic written for the TPU op; it moves `ep x max_rows` rows
  per rank, so it is not a fast path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed._functional_collectives as funcol

_SERVED: list[Callable] = []
"""A ragged all-to-all served for every device (`serve`): the TPU program compile
(tools/tpu_compile.py) captures the dispatch a TPU run emits, on meta tensors."""


def serve(op: Callable | None) -> None:
    """Serve `op` (the module docstring's contract, no autograd) for tensors on any device from
    now on; None: back to torch-tpu's on TPU only."""
    _SERVED.clear()
    if op is not None:
        _SERVED.append(op)


def ragged_all_to_all_for(device: torch.device) -> Callable | None:
    """torch-tpu's `ragged_all_to_all` for TPU tensors, with its backward (`differentiable`);
    the op given to `serve` for any device; None elsewhere."""
    if _SERVED:
        return differentiable(_SERVED[0])
    if device.type != "tpu":
        return None
    ops = getattr(getattr(torch, "tpu", None), "ops", None)
    op = getattr(ops, "ragged_all_to_all", None)
    if op is None:
        raise RuntimeError(
            "torch.tpu.ops.ragged_all_to_all is missing: this torch-tpu build has no "
            "ragged all-to-all (torch-tpu 0.2.0 has it)"
        )
    return differentiable(op)


def _exchange(t: torch.Tensor, group) -> torch.Tensor:
    """Equal-split all-to-all of one entry per rank: entry j of the result is rank j's entry for
    this rank (`group`: a process-group name or a 1-D mesh)."""
    # The raw functional ops, one wait: traced, funcol's wrapper already waits, and torch-tpu's
    # SplitCompiler refuses a wait whose producer is another wait; eager, the result must be
    # waited before it feeds the next collective.
    splits = [1] * t.numel()
    c10d = torch.ops._c10d_functional
    name = group if isinstance(group, str) else funcol._resolve_group_name(group)
    return c10d.wait_tensor(c10d.all_to_all_single(t.contiguous(), splits, splits, name))


class _RaggedAllToAll(torch.autograd.Function):
    """A ragged all-to-all `op` without autograd of its own; backward: the reverse ragged
    all-to-all of the output's gradient (each peer's rows sent back from where they landed, to
    where they came from)."""

    @staticmethod
    def forward(ctx, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name, op, kwargs):
        ctx.op, ctx.group, ctx.kwargs, ctx.operand_shape = op, group_name, kwargs, operand.shape
        ctx.save_for_backward(input_offsets, send_sizes, output_offsets, recv_sizes)
        with torch.no_grad():
            return op(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, group_name, **kwargs)

    @staticmethod
    def backward(ctx, grad):
        input_offsets, send_sizes, output_offsets, recv_sizes = ctx.saved_tensors
        # Where each peer's rows sit in this rank's output, and where in each peer's operand
        # this rank's rows came from (one integer per peer each way).
        landed = _exchange(output_offsets, ctx.group)
        came_from = _exchange(input_offsets, ctx.group)
        grad_operand = ctx.op(
            grad.contiguous(),
            grad.new_zeros(ctx.operand_shape),
            landed,
            recv_sizes,
            came_from,
            send_sizes,
            ctx.group,
            **ctx.kwargs,
        )
        return grad_operand, None, None, None, None, None, None, None, None


def differentiable(op: Callable) -> Callable:
    """`op` (the module docstring's contract) with a backward to its operand: torch-tpu 0.2.0
    registers no autograd kernel for `tpu::_ragged_all_to_all`, so without this the experts and
    the tokens got no gradient through the dispatch on a TPU (the torch-tpu path probe saw the
    backward scan body without the reverse all-to-alls). The initial `output` buffer gets no
    gradient (the dispatch passes zeros)."""

    def call(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, process_group_name, **kwargs):
        return _RaggedAllToAll.apply(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, process_group_name, op, kwargs
        )

    return call


def emulate_ragged_all_to_all(
    operand: torch.Tensor,
    output: torch.Tensor,
    input_offsets: torch.Tensor,
    send_sizes: torch.Tensor,
    output_offsets: torch.Tensor,
    recv_sizes: torch.Tensor,
    process_group_name: str,
    *,
    max_rows: int,
) -> torch.Tensor:
    """`ragged_all_to_all` (module docstring) on any backend; every send size <= `max_rows`."""
    num_ranks = input_offsets.numel()
    rows, dim = operand.shape
    slot = torch.arange(max_rows, device=operand.device)
    # Send buffer [ranks, max_rows, dim]: slot s for rank j is row input_offsets[j] + s (zero past send_sizes[j]).
    src = (input_offsets.unsqueeze(1) + slot).clamp(max=max(rows - 1, 0))
    sent = slot < send_sizes.unsqueeze(1)
    send = torch.where(sent.unsqueeze(-1), operand[src], operand.new_zeros(()))
    recv = funcol.all_to_all_single_autograd(send.reshape(-1, dim), None, None, group=process_group_name)
    # Where each sender's slice starts here (its output_offsets entry for this rank).
    starts = funcol.all_to_all_single(output_offsets, None, None, group=process_group_name)
    out_rows = output.shape[0]
    got = slot < recv_sizes.unsqueeze(1)
    # Slots that carry nothing write distinct rows past the end (sliced off): unique indices.
    spare = out_rows + torch.arange(num_ranks * max_rows, device=operand.device).view(num_ranks, max_rows)
    dest = torch.where(got, starts.unsqueeze(1) + slot, spare)
    extended = torch.cat([output, output.new_zeros(num_ranks * max_rows, dim)])
    return extended.index_copy(0, dest.reshape(-1), recv)[:out_rows]
