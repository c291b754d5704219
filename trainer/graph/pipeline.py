"""Pipeline parallelism in graph mode: the whole pipeline of a step inside the captured train step.

Each pp rank holds its stage's part of the model (`prune_model`, as eager PP: its blocks, the
embedding on the first stage, the norm and head on the last). `PipelinedLoss` is the step's
`loss_fn(model, inputs, labels)` for `GraphStep` (trainer/graph/step.py): it splits each
accumulation micro-batch into `m` chunks and runs GPipe's forward as a loop of `m + p - 1`
pipeline iterations, MaxText's way. At iteration t stage s applies its blocks to the chunk it
holds (chunk t - s, when 0 <= t - s < m; stage 0 embeds chunk t, the last stage computes the loss of
chunk t - (p - 1)); then every rank's activation moves one stage forward by `stage_permute`, a
point-to-point permute over the pp process group (an all_to_all_single with one nonzero split: rank
r sends to r + 1 mod p and receives from r - 1 mod p). The backward is autograd through the
permutes (the backward of a permute is the permute the other way), inside the same graph: GPipe's
order, every forward iteration then every backward iteration, scheduled by the compiler.

Every rank issues the same permutes in the same order, forward and backward: a rank idle in an
iteration (the bubble) forwards what it holds unchanged, stage 0 adds `0 x` what it received to
the chunk it embeds, and a rank's loss includes `0 x` its last state, so each permute's output
feeds the next iteration on every rank and the backward permutes form one chain, iteration
T - 2 down to 0, on every rank (a permute whose output no rank used would skip its backward on one
rank and not on its peer). The bubble's gradients are exact zeros.

`PipelinedLoss(scan=True)` runs the iterations as one scan instead (`_scanned`: one body for every
rank and iteration, the bubble masked; without SimpleFSDP for now).

The step's loss is the last stage's mean over the chunks, summed over the pp axis (the other
ranks add 0), so every rank returns the step's mean; the gradient norm is summed over the pp axis
in `clip_grads_` (`GraphStep(pp_mesh=...)`). docs/pipeline_parallel.md, "Graph mode: one program".
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from trainer.step.loss import lm_loss

_c10d = torch.ops._c10d_functional


def _shift(x: torch.Tensor, shift: int, group: tuple[str, int, int]) -> torch.Tensor:
    """`x` of rank r goes to rank r + shift (mod p) of the group; returns what rank r - shift sent.
    `group` = (name, size, this rank's index in it)."""
    name, size, rank = group
    flat = x.contiguous().view(-1)
    n = flat.numel()
    send = [0] * size
    recv = [0] * size
    send[(rank + shift) % size] = n
    recv[(rank - shift) % size] = n
    out = _c10d.wait_tensor(_c10d.all_to_all_single(flat, recv, send, name))
    return out.view(x.shape)


class StagePermute(torch.autograd.Function):
    """Forward: the activation moves one stage forward (r -> r + 1 mod p); backward: its gradient
    moves one stage back (r -> r - 1 mod p)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: tuple[str, int, int]) -> torch.Tensor:
        ctx.group = group
        return _shift(x, 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _shift(grad, -1, ctx.group), None


def stage_permute(x: torch.Tensor, group: tuple[str, int, int]) -> torch.Tensor:
    """`StagePermute.apply`: what the previous stage sent (differentiable)."""
    return StagePermute.apply(x, group)


def _anchor(model) -> torch.Tensor:
    """A 0-dim tensor that needs grad: the sum of the rank's first parameter's local shard."""
    param = next(p for p in model.parameters() if p.requires_grad)
    local = param.to_local() if isinstance(param, DTensor) else param
    return local.sum()


class PipelinedLoss:
    """`loss_fn(model, inputs, labels)` of a pp rank in graph mode (module docstring).

    - `pp_rank`, `pp`: this rank's stage and the stage count (one stage per rank: GPipe's placement);
    - `group_name`: the pp process group's name (`pp_mesh.get_group().group_name`);
    - `microbatches`: chunks per accumulation micro-batch (`m`; must divide its rows);
    - `dim`, `dtype`: the hidden size and the activations' dtype between stages (SimpleFSDP's
      param_dtype), for the state a rank holds before its first chunk arrives.
    """

    def __init__(
        self,
        *,
        pp_rank: int,
        pp: int,
        group_name: str,
        microbatches: int,
        dim: int,
        dtype: torch.dtype,
        scan: bool = False,
    ):
        assert 0 <= pp_rank < pp and pp > 1, (pp_rank, pp)
        self.pp_rank, self.pp, self.m = pp_rank, pp, microbatches
        self.group = (group_name, pp, pp_rank)
        self.dim, self.dtype = dim, dtype
        self.scan = scan
        """Run the iterations as one `scan` (`_scanned`) instead of unrolled."""

    @property
    def iterations(self) -> int:
        """Pipeline iterations per accumulation micro-batch: m + p - 1."""
        return self.m + self.pp - 1

    def __call__(self, model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        local = self._scanned(model, inputs, labels) if self.scan else self._unrolled(model, inputs, labels)
        # the value every rank reports: the last stage's mean, summed over the pp axis
        value = _c10d.wait_tensor(_c10d.all_reduce(local.detach().float(), "sum", self.group[0]))
        return local + (value - local.detach())

    def _unrolled(self, model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The iterations as a Python loop (one copy of the stage per active iteration in the graph)."""
        s, p, m = self.pp_rank, self.pp, self.m
        first, last = s == 0, s == p - 1
        rows = inputs.shape[0]
        assert rows % m == 0, f"{m} pipeline micro-batches do not divide {rows} rows"
        chunk = rows // m
        tokens, targets = inputs.split(chunk), labels.split(chunk)
        # What this rank holds before its first chunk arrives (the bubble forwards it unchanged).
        # It carries `0 x` a parameter: a permute's output needs grad only if its input does, and
        # the last stage (which forwards only what it holds) must run every backward permute too.
        h = torch.zeros(chunk, inputs.shape[1], self.dim, dtype=self.dtype, device=inputs.device)
        h = h + 0 * _anchor(model).to(self.dtype)
        loss = None
        iterations = self.iterations
        for t in range(iterations):
            i = t - s  # the chunk this stage holds at iteration t
            active = 0 <= i < m
            if first and active:
                x = model(tokens[i]) if t == 0 else model(tokens[i]) + 0 * h
            elif last:
                if active:
                    chunk_loss = lm_loss(model(h), targets[i])
                    loss = chunk_loss if loss is None else loss + chunk_loss
                x = h  # sent on to stage 0, which drops it
            else:
                x = model(h) if active else h
            if t < iterations - 1:
                h = stage_permute(x, self.group)
        # the other ranks' loss is 0 x their last state: the root of the backward permute chain
        return loss / m if last else (0 * h).sum()

    def _scanned(self, model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The iterations as one `torch.ops.higher_order.scan` whose body is the same on every rank
        and every iteration: the stage's blocks on what it holds (kept where the stage is active,
        `where(0 <= t - s < m)`; the bubble computes and discards), then the permute. Stage 0's
        injection is data (`where(t < m, embedding of chunk t, h)`; the embedding of every chunk runs
        before the scan), the last stage's head and loss run after it on the outputs of iterations
        p - 1 .. T - 1 (chunk 0 .. m - 1, in row order). The graph holds one copy of the stage, of
        the permute and of its backward, whatever m and p."""
        from torch._higher_order_ops.scan import scan

        from models.common.rope import rope_rows

        s, p, m = self.pp_rank, self.pp, self.m
        first, last = s == 0, s == p - 1
        rows, seq = inputs.shape[0], inputs.shape[1]
        assert rows % m == 0, f"{m} pipeline micro-batches do not divide {rows} rows"
        chunk, iterations, device = rows // m, self.iterations, inputs.device
        cos, sin = rope_rows(model.rope_cos, model.rope_sin, seq, None)
        shape = (chunk, seq, self.dim)
        h0 = torch.zeros(shape, dtype=self.dtype, device=device) + 0 * _anchor(model).to(self.dtype)
        if first:
            embedded = model.tok_embeddings(inputs).view(m, *shape)
            feed = torch.cat([embedded, embedded.new_zeros(p - 1, *shape)])
        else:
            feed = torch.zeros(iterations, *shape, dtype=self.dtype, device=device)
        active = torch.tensor([0 <= t - s < m for t in range(iterations)], device=device)
        inject = torch.tensor([first and t < m for t in range(iterations)], device=device)
        blocks, group = model.layers, self.group

        def body(h, x):
            fed, on, injected = x
            h = torch.where(injected, fed, h)
            out = torch.where(on, blocks(h, cos, sin), h)
            return stage_permute(out, group), out

        _, outs = scan(body, h0, (feed, active, inject))
        if last:
            return lm_loss(model.output(model.norm(outs[p - 1 :].flatten(0, 1))), labels)
        return (0 * outs).sum()

    def eval_loss(self, model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch through the pipeline's forward only (validation), the same on
        every pp rank; eager, outside the captured step."""
        with torch.no_grad():
            return self(model, inputs, labels).detach()
