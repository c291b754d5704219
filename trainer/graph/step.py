"""`build_graph_step`: the whole train step of `[compile] mode = "graph"` as one graph.

One call of the returned `GraphStep` runs, inside one captured graph: for each micro-batch
the forward, the LM loss (mean cross entropy over tokens, plus `aux_loss_coef` times the MoE
load-balancing loss when the model has MoE blocks) and `torch.autograd.grad`, accumulating
the gradients; then global-norm clipping and the optimizer update (AdamW, or Muon:
trainer/optim/muon.py) of parameters and optimizer state in place. The graph is captured on the first call and replayed after that; the
learning rate is a tensor input, so the schedule never recompiles. Gradient accumulation is
unrolled in the graph (the micro-batch count is fixed by the config), so the graph grows
with `gradient_accumulation_steps`, and not with `n_layers` when layer scan is on.

It has the eager step's call shape (trainer/step/): `step(microbatches, lr) -> StepOutput`
(mean LM loss over the micro-batches, global gradient norm before clipping, mean aux loss;
0-dim device tensors; with multi-token prediction each depth's mean loss, [depth]), plus `compile_s` and `graph_nodes`. A non-finite gradient norm skips
the update on the device (parameters, moments and step counts keep their values), as the
eager step's fused AdamW does.
"""

from __future__ import annotations

import contextlib
import itertools
import time
import types
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.stack import BlockStack
from models.errors import ConfigError
from parallelisms.replicate_reduce import canonical, deferred_meshes, reduce_grads
from trainer.graph.capture import CaptureBackend, capture_config, check_torch
from trainer.graph.optim import AdamWSlots, adamw_update_, clip_grads_, grad_reduce_axes, muon_update_
from trainer.step.loss import StepOutput, lm_loss, local_scalar, moe_outputs, with_aux_loss


class GraphStep:
    """The captured train step. Call as `step(microbatches, lr)`; built by `build_graph_step`."""

    def __init__(
        self,
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        aux_loss_coef: float,
        backend: str,
        device: torch.device,
        ac_mode: str,
        dump_graph: str | None,
        grad_accum_steps: int,
        block_stacks: dict[str, nn.Module] | None = None,
        scan_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        loss_fn: Callable | None = None,
        bucket_cap_mb: float = 0.0,
        gloo_all_to_all: bool = True,
        passes_as: str | None = None,
        balance=None,
        replicate_dtype: torch.dtype = torch.float32,
        pp_mesh=None,
    ):
        self.model = model
        # Pipeline parallelism (trainer/graph/pipeline.py): the loss_fn runs the pipeline, and the
        # gradient norm sums over the pp axis (each pp rank holds other parameters).
        self._total_axes = ((pp_mesh, 0),) if pp_mesh is not None else ()
        # Uniform stages: the parameters every pp rank holds and one stage uses (embedding, head),
        # whose gradients `loss_fn.sync_replicated_` sums over the pp axis after clipping.
        replicated = getattr(loss_fn, "replicated", None) if pp_mesh is not None else None
        self._pp_replicated = {id(p) for p in replicated(model)} if replicated is not None else set()
        # MoE with PP: the pipeline's `terms` return each stage's aux loss and expert loads (summed
        # over its chunks, the bubble's masked); `balance` is then the stage's (StageBalance).
        self._pp_terms = pp_mesh is not None and getattr(loss_fn, "moe", False)
        self._current_sync = None
        self.optimizer = optimizer
        self.max_norm = float(max_norm)
        self.aux_loss_coef = float(aux_loss_coef)
        self.grad_accum_steps = grad_accum_steps
        self.ac_mode = ac_mode
        self.block_stacks = dict(block_stacks or {})
        """The `BlockStack`s running as scans, by attribute name in model order (empty: unrolled)."""
        self._stacks = [m for m in model.modules() if isinstance(m, BlockStack)]
        self._scan_context = scan_context
        self._loss_context = loss_context
        self._loss_fn = loss_fn
        # MoE models: the loads leave the graph as an output; the bias update runs after it.
        self.balance = balance
        # `training.replicate_reduce = "step"`: the dtype of the once-per-step dp_replicate mean.
        self.replicate_dtype = replicate_dtype
        self._current_meshes = None
        # One update slot per (stack, parameter name): the stacks' names keep FLUX's two
        # stacks apart, whose blocks may share parameter names.
        stacked = {
            f"{sname}.{pname}": value
            for sname, stack in self.block_stacks.items()
            for pname, value in stack.stacked_parameters().items()
        } or None
        self.slots = AdamWSlots(optimizer, stacked=stacked)
        self._hyper = self.slots.hyperparams()
        self.capture = CaptureBackend(
            backend=backend,
            dump_path=dump_graph,
            bucket_cap_mb=bucket_cap_mb,
            gloo_all_to_all=gloo_all_to_all,
            passes_as=passes_as,
        )
        self._lr = torch.zeros((), dtype=torch.float32, device=device)
        self._arity = 2
        step_fn = _own_code(self._step)
        if backend == "tpu":
            from trainer.graph.tpu import spmd_safe

            step_fn = spmd_safe(step_fn)
        # dynamic=False: a shape change recompiles (and __call__ reports it) instead of
        # silently switching to a symbolic-shape graph.
        self._compiled = torch.compile(step_fn, backend=self.capture, fullgraph=True, dynamic=False)
        self._current_slots = None
        self.compile_s: float | None = None
        """Seconds from the first call to the compiled step starting to run (capture + passes + compile)."""
        self.graph_nodes: int | None = None
        """Node count of the captured top-level graph after the passes."""

    @property
    def graph_module(self):
        """The captured ATen graph after the passes (None before the first call)."""
        return self.capture.graph_module

    @property
    def stats(self):
        """`GraphStats` of the captured graph (None before the first call)."""
        return self.capture.stats

    def __call__(self, microbatches, lr: float) -> StepOutput:
        if len(microbatches) != self.grad_accum_steps:
            raise ValueError(f"graph step built for {self.grad_accum_steps} micro-batches, got {len(microbatches)}")
        # A checkpoint load replaces optimizer-state tensors (and may swap parameter storage):
        # point the stacked storage and the update slots at what model and optimizer hold now.
        for stack in self.block_stacks.values():
            stack.resync_scan_storage()
        for stack in self._stacks:  # the traced program starts from stacks that hold no terms
            stack.forget()
        self.slots.refresh()
        self._current_slots = self.slots.slots()
        # The dp_replicate mesh each slot's gradient still has to be averaged over (None for
        # most: reduced in the backward), found here and not in the traced step.
        deferred = deferred_meshes(self.model)
        self._current_meshes = canonical([deferred.get(id(_slot_param(s))) for s in self._current_slots])
        self._current_sync = [id(_slot_param(s)) in self._pp_replicated for s in self._current_slots]
        set_scalar_(self._lr, lr)
        if len({len(mb) for mb in microbatches}) != 1:
            raise ValueError("graph step: every micro-batch must hold the same number of tensors")
        self._arity = len(microbatches[0])  # a Python int: baked into the graph
        inputs = [t for mb in microbatches for t in mb]
        # scan bodies: layer scan's, or graph-mode PP's iteration scan (trainer/graph/pipeline.py)
        scanning = bool(self.block_stacks) or getattr(self._loss_fn, "scan", False)
        start = time.perf_counter()
        try:
            with (
                capture_config(
                    scan_ac_mode=self.ac_mode if scanning else None,
                    meta=any(s.param.device.type == "meta" for s in self._current_slots[:1]),
                ),
                self._scan_context(),
                self._loss_context(),
                # graph-mode PP's iteration scan: the stage's blocks on local tensors
                # (trainer/graph/pipeline.py `PipelinedLoss.capture_context`)
                getattr(self._loss_fn, "capture_context", lambda _: contextlib.nullcontext())(self.model),
            ):
                loss, grad_norm, aux, load, mtp = self._compiled(inputs, self._lr)
        finally:
            self._current_slots = self._current_meshes = self._current_sync = None
        if self.compile_s is None:
            self.compile_s = (self.capture.ready_at or time.perf_counter()) - start
            self.graph_nodes = self.capture.stats.nodes if self.capture.stats is not None else None
        if self.capture.num_graphs > 1:
            raise RuntimeError(
                f"graph step recompiled ({self.capture.num_graphs} graphs); the step's inputs "
                "must keep their shapes and dtypes from step to step"
            )
        self.slots.set_lr(lr)
        # torch's lr schedulers warn unless they see the optimizer step; the graph stepped it.
        self.optimizer._opt_called = True
        stats = None if self.balance is None else self.balance.finish(load, apply=torch.isfinite(grad_norm))
        return StepOutput(
            loss=loss,
            grad_norm=grad_norm,
            aux_loss=aux,
            mtp_losses=mtp,
            term_names=getattr(self._loss_fn, "term_names", None),
            **moe_outputs(stats),
        )

    def eval_loss(self, inputs: torch.Tensor, labels: torch.Tensor, *extra: torch.Tensor) -> torch.Tensor:
        """Pipeline parallelism: the loss of one held-out micro-batch through the pipeline's
        forward (eager, outside the graph), the same on every pp rank (validation); `extra`: the
        cp shard's positions with context parallelism. With TP's loss parallel the caller runs it
        inside the step plan's `loss_context` (validation does, as for every loss function; the
        context does not nest, so entering it here too failed validation through the trainer)."""
        return self._loss_fn.eval_loss(self.model, inputs, labels, *extra)

    # The function Dynamo traces. What it reads from `self` (model, slots) becomes graph
    # inputs; Python floats (hyperparameters, max_norm, aux_loss_coef) are baked in.
    def _step(self, inputs: list[torch.Tensor], lr: torch.Tensor):
        slots = self._current_slots
        leaves = [s.param for s in slots]
        k = self._arity
        n = len(inputs) // k
        grads, lm_total, aux_total, load, mtp_total = None, None, None, None, None
        # multi-token prediction (trainer/step/loss.py `MTPLoss`): each depth's loss per micro-batch,
        # returned by the loss (no state kept on the loss object inside the traced step)
        with_depths = getattr(self._loss_fn, "with_depths", None)
        for i in range(n):
            microbatch = inputs[k * i : k * (i + 1)]
            if self._pp_terms:  # MoE through the pipeline (trainer/graph/pipeline.py `terms`)
                lm, aux, mb_load = self._loss_fn.terms(self.model, *microbatch)
            else:
                if with_depths is not None:
                    lm, mtp = with_depths(self.model, *microbatch)
                    mtp_total = mtp if mtp_total is None else mtp_total + mtp
                elif self._loss_fn is not None:
                    lm = self._loss_fn(self.model, *microbatch)
                else:
                    lm = lm_loss(self.model(microbatch[0]), microbatch[1])
                aux = self.model.pop_aux_loss()
                mb_load = self.balance.pop() if self.balance is not None else None
            loss = with_aux_loss(lm, aux, self.aux_loss_coef)
            if aux is not None:
                aux_total = aux.detach() if aux_total is None else aux_total + aux.detach()
            if mb_load is not None:
                load = mb_load if load is None else load + mb_load
            mb_grads = torch.autograd.grad(loss / n, leaves, allow_unused=True)
            grads = (
                list(mb_grads)
                if grads is None
                else [b if a is None else (a if b is None else a + b) for a, b in zip(grads, mb_grads)]
            )
            lm_total = lm.detach() if lm_total is None else lm_total + lm.detach()
        with torch.no_grad():
            kept = [k for k, g in enumerate(grads) if g is not None]
            used = [(slots[k], _local(grads[k])) for k in kept]
            meshes = [self._current_meshes[k] for k in kept]
            if any(m is not None for m in meshes):  # replicate_reduce = "step"; None: returned as given
                means = reduce_grads([g for _, g in used], meshes, dtype=self.replicate_dtype)
                used = [(s, g) for (s, _), g in zip(used, means)]
            grad_norm = clip_grads_(
                [g for _, g in used], self.max_norm, [_reduce_axes(s) for s, _ in used], self._total_axes
            )
            if self._pp_replicated:  # uniform pipeline stages (trainer/graph/pipeline.py)
                self._loss_fn.sync_replicated_([g for k, (_, g) in zip(kept, used) if self._current_sync[k]])
            apply = torch.isfinite(grad_norm)
            for slot, g in used:
                if slot.momentum is not None:  # a Muon matrix (trainer/optim/muon.py)
                    muon_update_(
                        _local(slot.param),
                        g,
                        _local(slot.momentum),
                        lr=lr,
                        apply=apply,
                        shards=slot.shards,
                        **self._hyper[slot.group],
                    )
                    continue
                adamw_update_(
                    _local(slot.param),
                    g,
                    _local(slot.exp_avg),
                    _local(slot.exp_avg_sq),
                    slot.step,
                    lr=lr,
                    apply=apply,
                    **self._hyper[slot.group],
                )
        aux_mean = local_scalar(aux_total) / n if aux_total is not None else None
        mtp_mean = mtp_total / n if mtp_total is not None else None
        return local_scalar(lm_total) / n, grad_norm, aux_mean, load, mtp_mean


_STEP_IDS = itertools.count()


def set_scalar_(dst: torch.Tensor, value: float) -> None:
    """Write this step's Python number (the lr) into the 0-dim device tensor the captured step
    takes as an input, so the number is data and never a constant of a program.

    On a TPU a host-to-device copy of a CPU scalar: the value travels as the transfer's data
    (torch-tpu 0.2.0 compiles each eager op into a cached program, and a scalar it bakes in as a
    constant would give a new program, a compilation cache miss, per distinct value; its fill
    kernel appears to take the value as an input, but that is read from the binary, not seen).
    Elsewhere `fill_`: a kernel argument on CUDA (a copy from pageable host memory would wait for
    the stream), the same thing on the CPU.
    """
    if dst.device.type == "tpu":
        dst.copy_(torch.tensor(value, dtype=dst.dtype))
    else:
        dst.fill_(value)


def _own_code(method):
    """`method` with a code object of its own.

    Dynamo caches compiled code per code object and guards on `self`; a second GraphStep in
    the same process (tests, benchmarks) would otherwise count as a recompile of the first.
    """
    fn = method.__func__
    code = fn.__code__.replace(co_name=f"graph_step_{next(_STEP_IDS)}")
    return types.MethodType(
        types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__), method.__self__
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    # The update and the norm run on local shards: plain tensors, no DTensor dispatch.
    return t.to_local() if isinstance(t, DTensor) else t


def _slot_param(slot) -> torch.Tensor:
    # A stacked tensor of local shards is sharded like each of its layers' parameters.
    return slot.members[0] if slot.members else slot.param


def _reduce_axes(slot) -> tuple:
    return grad_reduce_axes(_slot_param(slot))


def build_graph_step(
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    max_norm: float,
    backend: str,
    scan_layers: bool = False,
    ac_mode: str = "none",
    dump_graph: str | None = None,
    grad_accum_steps: int = 1,
    aux_loss_coef: float = 0.0,
    plan=None,
    loss_context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    loss_fn: Callable | None = None,
    bucket_cap_mb: float = 0.0,
    gloo_all_to_all: bool = True,
    passes_as: str | None = None,
    balance=None,
    replicate_dtype: torch.dtype = torch.float32,
    pp_mesh=None,
) -> GraphStep:
    """Build the graph step for `model` (parallelized, materialized, initialized) and `optimizer`
    (AdamW, or Muon without QK clip; one learning rate for every group).

    The trainer calls this through `trainer.job.Job.build_step`, which resolves every keyword from
    the config and the step plan (`plan_step`). Each keyword is described in docs/graph_trainer.md,
    "The interface" (tests/unit/test_docs.py checks that the list names every one).
    """
    from models.common.plan import ModelPlan
    from parallelisms.activation_checkpoint import AC_MODES

    check_torch()
    # The settings come from a `StepPlan` (trainer/step/plan.py: its RULES refused what cannot
    # run, including `tpu` off a TPU); these are the internal invariants of a direct call.
    assert ac_mode in AC_MODES, ac_mode
    assert ac_mode == "none" or scan_layers or getattr(loss_fn, "scan", False), (
        "ac_mode applies inside a scanned body only (layer scan, or graph-mode PP's iteration scan); checkpoint unrolled "
        "blocks with parallelisms.apply_ac (parallelize_model) first"
    )
    assert backend in ("aot_eager", "inductor", "tpu"), f"an unresolved backend {backend!r} (resolve_backend)"
    if grad_accum_steps < 1:
        raise ConfigError("training.gradient_accumulation_steps: must be >= 1; allowed: a positive integer")
    lrs = {float(g["lr"]) for g in optimizer.param_groups}
    if len(lrs) > 1:
        raise ConfigError(
            f"optimizer: graph mode takes one learning rate for all param groups, got {sorted(lrs)}; allowed: one lr for every group"
        )
    first = next(iter(model.parameters()))
    device = (first.to_local() if isinstance(first, DTensor) else first).device
    plan = plan if plan is not None else ModelPlan()
    block_stacks, scan_context = {}, contextlib.nullcontext
    if scan_layers:
        block_stacks, scan_context = _enable_scans(model, plan, ac_mode)
    return GraphStep(
        model=model,
        optimizer=optimizer,
        max_norm=max_norm,
        aux_loss_coef=aux_loss_coef,
        backend=backend,
        device=device,
        ac_mode=ac_mode,
        dump_graph=dump_graph,
        grad_accum_steps=grad_accum_steps,
        block_stacks=block_stacks,
        scan_context=scan_context,
        loss_context=loss_context,
        loss_fn=loss_fn,
        bucket_cap_mb=bucket_cap_mb,
        gloo_all_to_all=gloo_all_to_all,
        passes_as=passes_as,
        balance=balance,
        replicate_dtype=replicate_dtype,
        pp_mesh=pp_mesh,
    )


def _enable_scans(model: nn.Module, plan, ac_mode: str = "none") -> tuple[dict[str, nn.Module], Callable]:
    """Turn on layer scan for every stack of `plan`; return the stacks and the step's context.

    Each stack is scanned on its own (its own stacked parameters, its own template block and,
    under SimpleFSDP, its own per-row gather), so stacks of different block types (FLUX's
    double- and single-stream blocks) each become one scan in the graph. A stack's unrolled
    prefix (`BlockStack.scan_layout`: DeepSeek-V4's hash-routed blocks) runs outside the scan
    body, so `ac_mode` checkpoints its blocks as the unscanned step's are (`checkpoint_blocks`).
    """
    from parallelisms.activation_checkpoint import checkpoint_blocks
    from parallelisms.scan import scan_param_fn

    stacks: dict[str, BlockStack] = {}
    for name in plan.stacks:
        stack = getattr(model, name, None)
        if not isinstance(stack, BlockStack):
            raise ConfigError(
                f"compile.scan_layers: the model's `{name}` is not a BlockStack; allowed: false for this model"
            )
        stacks[name] = stack
    contexts = []
    for name, stack in stacks.items():
        param_fn, context = scan_param_fn(stack, name=name)
        try:
            stack.enable_scan(param_fn=param_fn)
        except ValueError as e:  # blocks that differ with no periodic tail (`BlockStack.scan_layout`)
            reason = str(e).removeprefix("layer scan: ").split("; allowed:")[0].replace("; ", ": ")
            raise ConfigError(
                f"compile.scan_layers: the model's `{name}` cannot be scanned ({reason}); allowed: false for this model"
            ) from None
        checkpoint_blocks([b for b in stack.scan_prefix() if not hasattr(type(b), "_ac_base")], ac_mode)
        contexts.append(context)

    @contextlib.contextmanager
    def scan_context():
        with contextlib.ExitStack() as exit_stack:
            for context in contexts:
                exit_stack.enter_context(context())
            yield

    return stacks, scan_context
