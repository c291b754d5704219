"""Pipeline parallelism in graph mode: the whole pipeline of a step inside the captured train step,
one SPMD program: every pp rank runs the same code on its own data.

Uniform stages (MaxText's pipeline is the model): every pp rank holds as many blocks
(`pipeline_first/last_stage_less_layers = 0`, `PipelinePlan.uniform`) and also the embedding, the
final norm and the head (`prune_model(first=True, last=True)`, names unchanged). Which of them a
rank uses is data, not code: `PipelinedLoss.stage` is a 0-dim int64 tensor holding the rank's
index in the pp group, a graph input like the batch, and every choice between stages is a
`torch.where` on it. The Python control flow depends only on the iteration t, the same on every
rank; so the captured graph is the same on every pp rank but for the permutes' split sizes (below).

`PipelinedLoss` is the step's `loss_fn(model, inputs, labels)` for `GraphStep`
(trainer/graph/step.py): it splits each accumulation micro-batch into `m` chunks and runs GPipe's
forward as `m + p - 1` pipeline iterations. Every rank embeds every chunk first (stage 0's work;
the others discard theirs). At iteration t each rank applies its blocks to what it holds: stage 0
takes chunk t's embedding (`where(stage == 0)`, t < m), the others what the previous stage sent;
a rank idle in iteration t (the bubble: t - stage outside [0, m)) computes on what it holds and the
result is never used. Then every rank's output moves one stage forward by `stage_permute`, a
point-to-point permute over the pp process group (an all_to_all_single with one nonzero split: rank
r sends to r + 1 mod p and receives from r - 1 mod p; its split sizes are the only per-rank
constants of the graph, and tools/tpu_compile.py lowers it to one `collective_permute`, the same on
every device). The outputs of iterations p - 1 .. T - 1 are the last stage's chunks 0 .. m - 1:
every rank applies the norm, the head and the loss to its own (the last stage's are the real ones)
and keeps the loss where `stage == p - 1`, 0 elsewhere. The backward is autograd through the
`where`s and the permutes (the backward of a permute is the permute the other way), inside the same
graph, every permute's backward on every rank; the unselected branch of a `where` gets exact zeros.

The step's loss is the last stage's, summed over the pp axis (the other ranks add 0), so every rank
returns it; the gradient norm is summed over the pp axis in `clip_grads_` (`GraphStep(pp_mesh=...)`),
which counts the embedding's gradient once (stage 0's; the others' are zeros) and the head's and
norm's once (the last stage's). After clipping, `sync_replicated_` sums those replicated
parameters' gradients over the pp axis, so every rank holds the one real gradient and takes the same
update: the copies stay equal, as a data-parallel replica's do.

Context parallelism (`cp`, a `CPGroup`; docs/pipeline_parallel.md "Context parallelism with PP"):
the cp axis lives inside each stage, as tp does. A micro-batch is this cp rank's shard `(inputs,
labels, positions)` (`LMTask.prepare`), the permutes' pp group pairs the ranks with the same cp
coordinate, and the blocks run the job's CP attention (the op `causal_attention`) in every
iteration. The RoPE rows are the shard's global positions; a stage holds another chunk in each
iteration, but every row of a shard has the same positions, so the first row's serve all (`_rope`).
The loss is the non-PP CP loss (this rank's token sum x cp / the cp group's token count), so
SimpleFSDP's gradient mean over dp_shard x cp gives the micro-batch's mean over all its tokens.

`PipelinedLoss(scan=True)` (`[compile] scan_pipeline_iterations`) runs the iterations as one scan
instead (`_scanned`: one body for every iteration, the stage's parameters passed in as local tensors
and gathered there, `_StageBody`; with SimpleFSDP, CP, EP and TP; not with layer scan, the rules;
the activation-checkpoint mode applies inside its body, trainer/graph/remat.py `scan_remat`).
docs/pipeline_parallel.md, "Graph mode: one program".
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor

from trainer.step.loss import cp_token_mean, lm_loss

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


def _shift_uniform(x: torch.Tensor, shift: int, group: tuple[str, int, int], stage: torch.Tensor) -> torch.Tensor:
    """`_shift` with no per-rank constant: an all-to-all of equal splits over `p` slots of
    `x.numel()` elements, where only the slot of rank `stage + shift` (mod p) holds `x` (a `where` on
    the `stage` tensor, data) and the others zeros; what arrives is the sum of the slots, every one
    zero but the one rank `stage - shift` sent (exact: x + 0 = x). The same graph on every rank
    (split sizes `[n] * p`); the slot a rank keeps for itself is a local copy, so at p = 2 the
    network carries what `_shift` does, at p > 2 `p - 1` times as much."""
    name, size, _ = group
    buf = uniform_slots(x, shift, size, stage)
    n = buf.shape[1]
    out = _c10d.wait_tensor(_c10d.all_to_all_single(buf.view(-1), [n] * size, [n] * size, name))
    return out.view(size, n).sum(0).view(x.shape)


def uniform_slots(x: torch.Tensor, shift: int, size: int, stage: torch.Tensor) -> torch.Tensor:
    """`_shift_uniform`'s send buffer [p, numel]: `x` flattened in slot `stage + shift` (mod p),
    zeros elsewhere (a `where`, so an idle stage's non-finite values never leak into other slots)."""
    flat = x.contiguous().view(-1)
    slots = torch.arange(size, device=flat.device) == (stage + shift) % size
    return torch.where(slots[:, None], flat[None, :], flat.new_zeros(()))


class StagePermute(torch.autograd.Function):
    """Forward: the activation moves one stage forward (r -> r + 1 mod p); backward: its gradient
    moves one stage back (r -> r - 1 mod p). With `stage` (this rank's stage index tensor) the
    rank-independent form (`_shift_uniform`), else one nonzero split each way (`_shift`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: tuple[str, int, int], stage: torch.Tensor | None = None) -> torch.Tensor:
        ctx.group, ctx.stage = group, stage
        return _shift(x, 1, group) if stage is None else _shift_uniform(x, 1, group, stage)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        back = _shift(grad, -1, ctx.group) if ctx.stage is None else _shift_uniform(grad, -1, ctx.group, ctx.stage)
        return back, None, None


def stage_permute(x: torch.Tensor, group: tuple[str, int, int], stage: torch.Tensor | None = None) -> torch.Tensor:
    """`StagePermute.apply`: what the previous stage sent (differentiable); `stage`: the
    rank-independent form."""
    return StagePermute.apply(x, group, stage)


REPLICATED_MODULES = ("tok_embeddings", "norm", "output")
"""The top-level modules every pp rank holds with uniform stages, used by one stage each."""


class PipelinedLoss:
    """`loss_fn(model, inputs, labels)` of a pp rank in graph mode (module docstring).

    - `pp_rank`, `pp`: this rank's stage and the stage count (one stage per rank: GPipe's placement);
      `pp_rank` only fills the `stage` tensor, the program's input;
    - `group_name`: the pp process group's name (`pp_mesh.get_group().group_name`);
    - `microbatches`: chunks per accumulation micro-batch (`m`; must divide its rows);
    - `dim`, `dtype`: the hidden size and the activations' dtype between stages (SimpleFSDP's
      param_dtype), for the state a rank holds before its first chunk arrives;
    - `device`: where the `stage` tensor lives; `fused`: the fused linear + cross-entropy loss
      (`ops.linear_cross_entropy` from the normed hidden states; the step plan's `fused_loss`);
    - `rank_independent`: the permutes as equal-split all-to-alls selected by the `stage` tensor
      (`_shift_uniform`), so the captured graph has no per-rank constant at all and is the same
      text on every pp rank (what torch-tpu's `spmd_safe` assumes); at p = 2 the same bytes on the
      network, at p > 2 `p - 1` times as many. Off: one nonzero split each way (`_shift`), which the
      deviceless compile lowers to one collective permute.
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
        device: torch.device | str = "cpu",
        fused: bool = False,
        rank_independent: bool = False,
        moe: bool = False,
        cp=None,
    ):
        assert 0 <= pp_rank < pp and pp > 1, (pp_rank, pp)
        self.pp_rank, self.pp, self.m = pp_rank, pp, microbatches
        self.group = (group_name, pp, pp_rank)
        self.dim, self.dtype = dim, dtype
        self.scan = scan
        """Run the iterations as one `scan` (`_scanned`) instead of unrolled."""
        self.fused = fused
        self.stage = torch.tensor(pp_rank, dtype=torch.int64, device=device)
        """This rank's stage index: data of the program, the same code on every rank."""
        self.rank_independent = rank_independent
        self.cp = cp if cp is not None and cp.size > 1 else None
        """Context parallelism (a `CPGroup`, module docstring "Context parallelism"), else None."""
        self._stage_body: _StageBody | None = None
        self.moe = moe
        """The model has experts (every pp rank says the same, a rank without MoE layers too): `terms`
        then returns the stage's aux loss and expert loads (module docstring, "MoE")."""

    def _permute(self, out: torch.Tensor) -> torch.Tensor:
        return stage_permute(out, self.group, self.stage if self.rank_independent else None)

    @property
    def iterations(self) -> int:
        """Pipeline iterations per accumulation micro-batch: m + p - 1."""
        return self.m + self.pp - 1

    def __call__(self, model, inputs: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        return self.terms(model, inputs, labels, *extra)[0]

    def terms(
        self, model, inputs: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(loss, aux, load) of one accumulation micro-batch through the pipeline. `loss`: the last
        stage's mean LM loss, the same value on every rank. With `moe` (module docstring, "MoE"):
        `aux`, this rank's stage's load-balancing loss summed over its m chunks / m (the gradient
        of the stage's routers), whose value is the sum over the pp axis (every stage's layers);
        `load`, its MoE layers' expert loads summed over the chunks, flat `[layers x E]` float32
        (`ExpertBalance.pop`'s layout; None on a rank without MoE layers). `positions`: with context
        parallelism the shard's global RoPE positions [rows, seq / cp] (the micro-batch's third
        tensor), else None."""
        rows = inputs.shape[0]
        assert rows % self.m == 0, f"{self.m} pipeline micro-batches do not divide {rows} rows"
        assert (positions is not None) == (self.cp is not None), "positions come with context parallelism only"
        rope = self._rope(model, inputs, positions)
        outs, aux, load = self._scanned(model, inputs, rope) if self.scan else self._unrolled(model, inputs, rope)
        local = self._loss(model, outs, labels)
        if not self.moe:
            # the value every rank reports: the last stage's loss, summed over the pp axis
            value = _c10d.wait_tensor(_c10d.all_reduce(local.detach().float(), "sum", self.group[0]))
            return local + (value - local.detach()), None, None
        aux = aux / self.m if aux is not None else local.new_zeros((), dtype=torch.float32)
        if isinstance(aux, DTensor):
            aux = aux.to_local()
        # one all-reduce for both values: the last stage's loss and every stage's aux term
        both = torch.stack([local.detach().float(), aux.detach().float()])
        both = _c10d.wait_tensor(_c10d.all_reduce(both, "sum", self.group[0]))
        loss = local + (both[0] - local.detach())
        aux = aux + (both[1].to(aux.dtype) - aux.detach())
        return loss, aux, None if load is None else load.detach().reshape(-1)

    def live(self, t: int | torch.Tensor) -> torch.Tensor:
        """Whether this rank's stage works on a chunk in pipeline iteration `t` (0 <= t - stage < m;
        a bool tensor, data; `t` an int or a tensor of iterations): False in the bubble, whose aux
        terms and loads count nothing."""
        return (self.stage <= t) & (self.stage > t - self.m)

    def _mask(self, aux: torch.Tensor | None, load: torch.Tensor | None, live: torch.Tensor):
        """An iteration's aux term and expert loads of the stage (`BlockStack.terms`: returned, not
        kept on the stack, which a forward-then-pop per iteration would not trace as separate values;
        with layer scan it captured aux terms about 1/4 of the one process's, measured 2026-12-07),
        zero where the stage is idle (`live` False: a `where`, so a bubble's values never leak, and
        its aux term gets an exact zero gradient); (None, None) without `moe` or MoE layers."""
        if not self.moe:
            return None, None
        if aux is not None:
            aux = torch.where(live, aux, torch.zeros_like(aux))
        if load is not None:
            load = torch.where(live, load.detach().float(), torch.zeros((), dtype=torch.float32, device=load.device))
        return aux, load

    def _embedded(self, model, inputs: torch.Tensor) -> torch.Tensor:
        """Every chunk's embedding [m, chunk, seq, dim] (every rank computes it; stage 0 uses it).
        With tensor parallelism `seq` is this tp rank's sequence shard (the vocab-parallel
        embedding's reduce-scatter, sequence parallel), which is what the blocks and the permutes
        carry between stages."""
        e = model.tok_embeddings(inputs).to(self.dtype)
        return e.view(self.m, inputs.shape[0] // self.m, *e.shape[1:])

    def _rope(self, model, inputs: torch.Tensor, positions: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The RoPE rows every stage applies: positions 0 .. seq - 1, or with context parallelism the
        cp shard's global positions (module docstring, "Context parallelism"): every row of the
        shard has the same ones (`LMTask.prepare`; document masking, which restarts them per
        document, is refused with PP), so the first row's serve every chunk, whichever chunk a
        stage holds in an iteration."""
        from models.common.rope import rope_rows

        return rope_rows(model.rope_cos, model.rope_sin, inputs.shape[1], None if positions is None else positions[0])

    def _unrolled(
        self, model, inputs: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The iterations as a Python loop (one copy of the stage per iteration in the graph); the
        outputs of iterations p - 1 .. T - 1 stacked [m, chunk, seq, dim], and with `moe` the
        stage's aux terms and loads summed over its live iterations (`BlockStack.terms`, `_mask`; else None)."""
        p, m = self.pp, self.m
        embedded = self._embedded(model, inputs)
        cos, sin = rope
        first = self.stage == 0
        h = torch.zeros_like(embedded[0])
        outs, aux, load = [], None, None
        for t in range(self.iterations):
            x = torch.where(first, embedded[t], h) if t < m else h
            out, a, ld = model.layers.terms(x, cos, sin)
            a, ld = self._mask(a, ld, self.live(t)) if self.moe else (None, None)
            if a is not None:
                aux = a if aux is None else aux + a
            if ld is not None:
                load = ld if load is None else load + ld
            if t >= p - 1:
                outs.append(out)
            if t < self.iterations - 1:
                h = self._permute(out)
        return torch.stack(outs), aux, load

    def _body(self, blocks) -> _StageBody:
        """The iteration scan's view of this rank's stack `blocks` (built once, outside the trace,
        by `capture_context`: `_StageBody`)."""
        if self._stage_body is None or self._stage_body.terms.stack is not blocks:
            self._stage_body = _StageBody(blocks)
        return self._stage_body

    def capture_context(self, model) -> contextlib.AbstractContextManager:
        """What the captured step runs inside (`GraphStep`, around its compiled call): with the
        iteration scan, the stage's blocks on local tensors (`_StageBody.context`); else nothing."""
        if not self.scan:
            return contextlib.nullcontext()
        return self._body(model.layers).context()

    def _scanned(
        self, model, inputs: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The iterations as one `torch.ops.higher_order.scan` whose body is the same on every
        iteration: stage 0's input where t < m (`inject`, data), the blocks, the permute. The graph
        holds one copy of the stage, of the permute and of its backward, whatever m and p. With
        `moe` the body's outputs also hold each iteration's aux term and loads, zeroed outside the
        live iterations after the scan (`live`).

        The stage's parameters enter the body as local tensors (`_StageBody`): a DTensor cannot
        (torch 2.13 lifts its process group as an opaque object, which scan refuses), so the body
        gathers SimpleFSDP's shards (dp_shard, and cp: FSDP shards over dp_shard x cp) by process
        group name in every iteration, as the unrolled iterations' properties do, and an
        expert-parallel layer dispatches with static shapes by group name; the gradient of each
        iteration's gather is reduce-scattered to the shard, summed over the iterations by the scan's
        backward."""
        from torch._higher_order_ops.scan import scan

        p, m = self.pp, self.m
        embedded = self._embedded(model, inputs)
        cos, sin = rope
        feed = torch.cat([embedded, embedded.new_zeros(p - 1, *embedded.shape[1:])])
        steps = torch.arange(self.iterations, device=inputs.device)
        inject = (steps < m) & (self.stage == 0)
        permute, moe = self._permute, self.moe
        stage = self._body(model.layers)
        shards = stage.shards()

        def body(h, x):
            fed, injected = x
            x = torch.where(injected, fed, h)
            out, aux, load = stage(shards, x, cos, sin)
            if aux is None or not moe:  # (a dense model, or a rank without MoE layers)
                return permute(out), (out,)
            return permute(out), (out, aux, load.detach().float())

        _, ys = scan(body, torch.zeros_like(embedded[0]), (feed, inject))
        outs, aux, load = ys[0][p - 1 :], None, None
        if len(ys) == 3:  # the stage's aux terms [T] and loads [T, layers, E], the bubble's zeroed
            live = self.live(steps)
            aux = torch.where(live, ys[1], torch.zeros_like(ys[1])).sum()
            loads = ys[2].detach()  # (a scan output: detached here, not in the body)
            load = torch.where(live[:, None, None], loads, torch.zeros_like(loads)).sum(0)
        return outs, aux, load

    def _loss(self, model, outs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of the last stage's outputs (chunks in row order), kept on the
        last stage (`where`), 0 elsewhere. With context parallelism the non-PP CP loss
        (trainer/step/loss.py `cp_scaled_lm_loss`): this cp rank's token sum x cp / the cp group's
        token count."""
        hidden = model.norm(outs.flatten(0, 1))
        reduction = "mean" if self.cp is None else "sum"
        if self.fused:
            from models.common import ops

            loss = ops.linear_cross_entropy(hidden.flatten(0, 1), model.output.weight, labels.flatten())
            if self.cp is not None:
                loss = loss * (labels != ops.IGNORE_INDEX).sum()
        else:
            loss = lm_loss(model.output(hidden), labels, reduction)
            if isinstance(loss, DTensor):
                # TP's loss parallel (vocab-sharded logits, the loss under `loss_parallel()`, the
                # graph step's loss context): the mean is replicated over tp; its local value, whose
                # gradient goes back as the replicated DTensor's
                loss = loss.to_local()
        if self.cp is not None:  # (a functional collective, traced into the step's graph)
            loss = cp_token_mean(loss, labels, self.cp)
        return torch.where(self.stage == self.pp - 1, loss, torch.zeros_like(loss))

    def replicated(self, model) -> list[torch.Tensor]:
        """The parameters every pp rank holds and one stage uses (`REPLICATED_MODULES`)."""
        return [
            p
            for name in REPLICATED_MODULES
            if getattr(model, name, None) is not None
            for p in getattr(model, name).parameters()
        ]

    def sync_replicated_(self, grads: list[torch.Tensor]) -> None:
        """Sum the replicated parameters' (local) gradients over the pp axis in place: the one stage's
        real gradient on every rank (the others hold zeros)."""
        for g in grads:
            g.copy_(_c10d.wait_tensor(_c10d.all_reduce(g, "sum", self.group[0])))

    def eval_loss(self, model, inputs: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """The loss of one micro-batch through the pipeline's forward only (validation), the same on
        every pp rank; eager, outside the captured step, the iterations unrolled (the iteration scan
        computes the same: one body per iteration). `extra`: the positions with CP."""
        scan, self.scan = self.scan, False
        try:
            with torch.no_grad():
                return self(model, inputs, labels, *extra).detach()
        finally:
            self.scan = scan


class _Terms(torch.nn.Module):
    """`BlockStack.terms` as a module's forward, for `functional_call` (the stack's own forward
    keeps its terms on the stack, which a scan body must not mutate)."""

    def __init__(self, stack):
        super().__init__()
        self.stack = stack

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self.stack.terms(h, cos, sin)


class _StageBody:
    """A pipeline stage's blocks as the iteration scan's body calls them: the stack's parameters
    passed in as local tensors (`shards`, outside the body; a DTensor's `to_local`, whose gradient
    returns as the shard's), mapped in the body to what the blocks compute with by
    `parallelisms.scan.body_param_fn` (SimpleFSDP's gather by group name and EP's gradient scale, as
    layer scan's body does) and applied by `functional_call`; `context()` puts the blocks on local
    tensors (SimpleFSDP's gathering properties off, expert-parallel experts on the static-shape
    dispatch) around the captured step. Without SimpleFSDP (no `param_fn`) the body calls the
    stack as it is."""

    def __init__(self, stack):
        from parallelisms.scan import body_param_fn

        self.terms = _Terms(stack)
        self.param_fn, self.context = body_param_fn(stack, name="layers")
        self.names = [n for n, _ in stack.named_parameters()]

    def shards(self) -> dict[str, torch.Tensor] | None:
        """The stack's parameters as stored (run inside `context`), local: the body's closure."""
        if self.param_fn is None:
            return None
        stack = self.terms.stack
        stored = dict(stack.named_parameters())
        return {n: stored[n].to_local() if isinstance(stored[n], DTensor) else stored[n] for n in self.names}

    def __call__(self, shards: dict[str, torch.Tensor] | None, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        if shards is None:
            return self.terms.stack.terms(h, cos, sin)
        params = {f"stack.{n}": t for n, t in self.param_fn(shards).items()}
        return torch.func.functional_call(self.terms, params, (h, cos, sin))
