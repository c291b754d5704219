"""The train step, and the one place that decodes `[compile] mode`.

`plan_step(...)` turns the compile, activation-checkpointing and parallelism settings into a
`StepPlan`; everything that depends on the mode reads that object and nothing else:
- the compiler backend, resolved once (`resolve_backend`);
- where activation checkpointing is applied: on the blocks by `parallelize_model`, in the
  documented order TP -> EP -> AC -> compile -> SimpleFSDP, in every mode; only a scanned graph
  step, whose blocks run as one scan body, applies it inside that body instead;
- which blocks are compiled (`compile` mode), and whether the step is one captured graph;
- the loss: plain (logits, then fp32 cross entropy) or fused (`ops.linear_cross_entropy` from
  the final hidden states: the logits are never whole, nor upcast to fp32 whole), and the
  loss-parallel context (TP with vocab-sharded logits), for eager and graph steps alike;
- the host-sync policy: the step returns device tensors and never reads them; the loop reads
  them on logged steps and before a checkpoint (`trainer/train.py`).

`EagerStep` is the step of the eager and compile modes; `trainer/graph` provides the graph
step. Both take the step's micro-batches and the learning rate and return `StepOutput`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from models.contract import ModelShape
from models.errors import ConfigError

MODES = ("eager", "compile", "graph")
BACKENDS = ("auto", "inductor", "aot_eager", "eager", "tpu")


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy over all tokens of the micro-batch, computed in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _plain_loss(model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return lm_loss(model(inputs), labels)


def local_scalar(t: torch.Tensor) -> torch.Tensor:
    """A loss computed under loss parallel is a replicated DTensor; logging wants a plain tensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass(frozen=True)
class StepPlan:
    """Everything `[compile] mode` decides, resolved once (see the module docstring)."""

    mode: str
    """eager | compile | graph."""
    backend: str | None
    """The resolved compiler backend (inductor | aot_eager | eager | tpu); None in eager mode."""
    block_ac: str
    """AC mode `parallelize_model` applies to the blocks (none | full | selective)."""
    block_compile: str | None
    """Backend that `parallelize_model` compiles each block with; None: blocks stay eager."""
    scan: bool
    """Graph mode runs the repeated blocks as one scan."""
    scan_ac: str
    """AC mode applied inside the scan body (graph + scan); "none" otherwise."""
    loss_parallel: bool
    """The LM loss runs on vocab-sharded logits under `loss_parallel_context` (TP only)."""
    fused_loss: bool = False
    """The LM loss is `ops.linear_cross_entropy(model.hidden(x), model.output.weight, y)`."""

    def loss_context(self) -> contextlib.AbstractContextManager:
        from parallelisms import loss_parallel_context

        return loss_parallel_context(self.loss_parallel)

    def lm_loss(self, model, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of `model` on one micro-batch (fp32, 0-dim)."""
        if self.fused_loss:
            from models.common import ops

            # The weight is read here, after the forward, on every call: under SimpleFSDP the
            # access is the all-gather, which must not be cached across steps.
            return ops.linear_cross_entropy(model.hidden(inputs).flatten(0, 1), model.output.weight,
                                            labels.flatten())
        return lm_loss(model(inputs), labels)


def resolve_backend(backend: str, *, mode: str, device_type: str) -> str:
    """The compiler backend for `mode` on `device_type`: auto -> tpu on a TPU, inductor elsewhere.

    In graph mode `eager` means `aot_eager` (the captured graph runs op by op).
    """
    if backend not in BACKENDS:
        raise ConfigError(f"compile.backend: {backend!r}; allowed: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "tpu" if device_type == "tpu" else "inductor"
    if backend == "tpu" and device_type != "tpu":
        allowed = ", ".join(b for b in BACKENDS if b != "tpu")
        raise ConfigError(f"compile.backend: tpu needs a TPU device; allowed here: {allowed}")
    if mode == "graph" and backend == "eager":
        return "aot_eager"
    return backend


def plan_step(*, mode: str, backend: str, scan_layers: bool, ac_mode: str, loss_parallel: bool,
              tp_enabled: bool, device_type: str, shape: ModelShape | None = None,
              fused_loss: str = "off", model_has_hidden: bool = False) -> StepPlan:
    """The `StepPlan` of a run; ConfigError for combinations that cannot be honoured.

    `shape` (the model's `args.shape()`) is accepted for callers that pass it; MoE blocks scan
    like any others (their load-balancing loss is a per-layer scan output, models/common/stack.py).
    `fused_loss` (auto | on | off): auto fuses on TPU; it needs a model with `hidden()` (the
    contract's optional part) and no tensor parallelism (the op takes the whole vocabulary).
    """
    if fused_loss not in ("auto", "on", "off"):
        raise ConfigError(f"training.fused_loss: {fused_loss!r}; allowed: auto, on, off")
    if fused_loss == "on" and tp_enabled:
        raise ConfigError("training.fused_loss: on needs the whole vocabulary on each rank, but tensor "
                          "parallelism shards it; allowed with tensor_parallel_degree > 1: auto, off")
    if fused_loss == "on" and not model_has_hidden:
        raise ConfigError("training.fused_loss: on needs a model with hidden() (models/contract.py); "
                          "allowed for this model: auto, off")
    fused = model_has_hidden and not tp_enabled and (fused_loss == "on" or (fused_loss == "auto"
                                                                             and device_type == "tpu"))
    if mode not in MODES:
        raise ConfigError(f"compile.mode: {mode!r}; allowed: {', '.join(MODES)}")
    if scan_layers and mode != "graph":
        raise ConfigError('compile.scan_layers: needs compile.mode = "graph"')
    resolved = None if mode == "eager" else resolve_backend(backend, mode=mode, device_type=device_type)
    scan = mode == "graph" and scan_layers
    return StepPlan(
        mode=mode,
        backend=resolved,
        block_ac="none" if scan else ac_mode,
        block_compile=resolved if mode == "compile" else None,
        scan=scan,
        scan_ac=ac_mode if scan else "none",
        loss_parallel=loss_parallel and tp_enabled,
        fused_loss=fused,
    )


@dataclass
class StepOutput:
    """What one step returns: device tensors, never read by the step itself."""

    loss: torch.Tensor
    """Mean loss (LM cross entropy, or the task's loss) over the step's micro-batches (0-dim,
    this rank's value)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (0-dim, equal on every rank)."""
    aux_loss: torch.Tensor | None = None
    """Mean auxiliary (MoE load-balancing) loss over the micro-batches, unscaled; None without."""


def build_step(plan: StepPlan, *, model, optimizer, max_norm: float, aux_loss_coef: float,
               grad_accum_steps: int, model_plan, dump_graph: str | None = None, loss_fn=None,
               bucket_cap_mb: float = 0.0, gloo_all_to_all: bool = True):
    """The step object of `plan`: `step(microbatches, lr) -> StepOutput`.

    A micro-batch is a tuple of tensors; `loss_fn(model, *micro_batch)` is its mean loss (the
    task's, trainer/tasks.py); None: the LM loss of `plan` on (inputs, labels).
    """
    loss_fn = loss_fn if loss_fn is not None else plan.lm_loss
    if plan.mode != "graph":
        from parallelisms import clip_grad_norm_

        return EagerStep(model=model, optimizer=optimizer, max_norm=max_norm, aux_loss_coef=aux_loss_coef,
                         clip_grad_norm=clip_grad_norm_, loss_context=plan.loss_context, loss_fn=loss_fn)
    from trainer.graph import build_graph_step

    return build_graph_step(
        model=model, optimizer=optimizer, plan=model_plan, max_norm=max_norm, aux_loss_coef=aux_loss_coef,
        backend=plan.backend, scan_layers=plan.scan, ac_mode=plan.scan_ac, dump_graph=dump_graph,
        grad_accum_steps=grad_accum_steps, loss_context=plan.loss_context, loss_fn=loss_fn,
        bucket_cap_mb=bucket_cap_mb, gloo_all_to_all=gloo_all_to_all,
    )


class EagerStep:
    """Plain PyTorch step with gradient accumulation over the given micro-batches."""

    compile_s = None
    graph_nodes = None

    def __init__(self, *, model, optimizer, max_norm: float, aux_loss_coef: float, clip_grad_norm,
                 loss_context=contextlib.nullcontext, loss_fn=None):
        self.model = model
        self.optimizer = optimizer
        self.max_norm = max_norm
        self.aux_loss_coef = aux_loss_coef
        self.clip_grad_norm = clip_grad_norm
        # With TP loss parallel the loss and its backward run on vocab-sharded logits inside
        # this context (parallelisms.loss_parallel_context).
        self.loss_context = loss_context
        # loss_fn(model, *micro_batch) -> the micro-batch's mean loss (trainer/tasks.py); default:
        # an LM micro-batch (inputs, labels): logits, then lm_loss.
        self.loss_fn = loss_fn if loss_fn is not None else _plain_loss

    def __call__(self, microbatches, lr: float | None = None) -> StepOutput:
        # The lr scheduler already wrote `lr` into the optimizer's param groups.
        self.optimizer.zero_grad(set_to_none=True)
        n = len(microbatches)
        lm_sum, aux_sum = 0.0, None
        for microbatch in microbatches:
            with self.loss_context():
                lm = self.loss_fn(self.model, *microbatch)
                aux = self.model.pop_aux_loss()
                loss = lm if aux is None else lm + self.aux_loss_coef * aux
                (loss / n).backward()
            lm_sum = lm_sum + local_scalar(lm.detach())
            if aux is not None:
                aux = local_scalar(aux.detach())
                aux_sum = aux if aux_sum is None else aux_sum + aux
        max_norm = self.max_norm if self.max_norm > 0 else float("inf")
        grad_norm = self.clip_grad_norm([p for p in self.model.parameters() if p.grad is not None], max_norm)
        self._step_if_finite(grad_norm)
        return StepOutput(loss=lm_sum / n, grad_norm=grad_norm, aux_loss=None if aux_sum is None else aux_sum / n)

    def _step_if_finite(self, grad_norm: torch.Tensor) -> None:
        """Apply the update unless the (global) gradient norm is not finite.

        A fused AdamW skips on the device (`found_inf`: parameters, moments and step counts keep
        their values); other optimizers need the verdict on the host, one sync per step.
        """
        nonfinite = ~torch.isfinite(grad_norm)
        if all(group.get("fused") for group in self.optimizer.param_groups):
            self.optimizer.found_inf = nonfinite.to(torch.float32)
            self.optimizer.step()
        elif not bool(nonfinite):
            self.optimizer.step()
