"""Pipeline parallelism (PP) through `torch.distributed.pipelining`, eager mode.

The `pp` mesh axis is outermost (`parallel_dims.build_mesh`): each of its `pp` ranks holds a slice
of the model's layers and runs the rest of the mesh (dp_replicate x dp_shard x cp x tp, the "stage
mesh") over it as before. What this module provides, in the order a job uses it:

- the arithmetic the planner can call without building anything: `schedule_style`,
  `virtual_stages`, `stage_ids` (which stages a pp rank holds), `split_layers` (which layers a
  stage holds: first and last stages lighter by the embedding and by the norm + head), and
  `bubble_fraction` (the idle share of a schedule);
- `prune_model(model, ...)`: the model built on meta, reduced in place to what this pp rank holds
  (other blocks deleted, `tok_embeddings` only with stage 0, `norm` and `output` only with the last
  stage): parameter names stay the model's own (`layers.3` stays `layers.3`), so DCP checkpoints
  reshard between PP and non-PP layouts and the optimizer, clipping and checkpoint code see one
  module per rank as without PP;
- `stage_view(model, ...)`: one stage's module for `PipelineStage`, a shallow copy of the pruned
  model that shares its submodules (and so its parameters and gradients) and holds only that
  stage's blocks; the model's own `forward` runs it (a stage without the embedding takes hidden
  states, one without the head returns them: models/common/decoder.py);
- `build_schedule(...)`: the `PipelineStage`s of this rank and the schedule of
  `[parallelism] pipeline_schedule` (TorchTitan's names, `get_schedule_class`); `stage_module`
  may wrap each stage's view (the step's MoE tap, trainer/step/pipeline.py), and
  `in_chunk_forward()` tells a forward that runs a real chunk from the schedule's metadata
  inference (which runs the stage on a first or a mode-changing call, outside the chunks).

Schedules: `GPipe` and `1F1B` hold one stage per rank; `Interleaved1F1B`, `LoopedBFS` and
`InterleavedZeroBubble` hold `pipeline_virtual_stages` stages per rank in loop order (rank r holds
stages r, r + pp, ...); `ZBVZeroBubble` holds two in V order (rank r holds r and 2 pp - 1 - r, so
rank 0 has the first and the last stage). docs/pipeline_parallel.md.
"""

from __future__ import annotations

import contextvars
import copy
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
"""`[parallelism] pipeline_schedule` values (TorchTitan's names, torch's `get_schedule_class`)."""
SINGLE_STAGE_SCHEDULES = ("GPipe", "1F1B")
"""Schedules with one stage per pp rank."""
V_SCHEDULES = ("ZBVZeroBubble",)
"""Schedules with exactly two stages per rank placed in V order (rank r: r and 2 pp - 1 - r)."""
ZERO_BUBBLE_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble")
"""Schedules that split the backward into an input-gradient (B) and a weight-gradient (W) pass."""


def schedule_style(schedule: str) -> str:
    """How stages are placed on ranks: "single" (one per rank), "loop" (r, r + pp, ...) or "v"."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return "single"
    return "v" if schedule in V_SCHEDULES else "loop"


def virtual_stages(schedule: str, configured: int) -> int:
    """Stages per pp rank: 1 for GPipe / 1F1B, 2 for ZBVZeroBubble, `configured` (0: 2) otherwise."""
    style = schedule_style(schedule)
    if style == "single":
        return 1
    if style == "v":
        return 2
    return configured if configured > 0 else 2


def stage_ids(pp_rank: int, pp: int, schedule: str, num_virtual: int) -> tuple[int, ...]:
    """The stage indices pp rank `pp_rank` holds (of `pp * num_virtual`), in the order its schedule
    lists them."""
    assert 0 <= pp_rank < pp, (pp_rank, pp)
    style = schedule_style(schedule)
    if style == "single":
        return (pp_rank,)
    if style == "v":
        assert num_virtual == 2, num_virtual
        return (pp_rank, 2 * pp - 1 - pp_rank)
    return tuple(pp_rank + i * pp for i in range(num_virtual))


def split_layers(n_layers: int, num_stages: int, *, first_stage_less: int = 1, last_stage_less: int = 1) -> list[range]:
    """The blocks of each stage: `num_stages` consecutive ranges covering `range(n_layers)`.

    The embedding counts as `first_stage_less` blocks on stage 0 and the final norm + output head
    as `last_stage_less` on the last stage (TorchTitan's first/last_stage_less_layers, both 1 by
    default: the head of a large vocabulary costs about a block). The `n_layers + first + last`
    units are dealt as evenly as possible, the earlier stages taking the remainder. ValueError
    when a stage would hold no block (the stage count exceeds what the layers allow).
    """
    if num_stages < 1 or n_layers < 1:
        raise ValueError(f"split_layers: {n_layers} layers into {num_stages} stages")
    if num_stages == 1:
        return [range(n_layers)]
    units = n_layers + first_stage_less + last_stage_less
    base, extra = divmod(units, num_stages)
    sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
    sizes[0] -= first_stage_less
    sizes[-1] -= last_stage_less
    if min(sizes) < 1:
        raise ValueError(
            f"split_layers: {n_layers} layers (+ {first_stage_less} for the embedding, + {last_stage_less} for the "
            f"head) over {num_stages} stages leaves a stage without a block: sizes {sizes}"
        )
    out, start = [], 0
    for size in sizes:
        out.append(range(start, start + size))
        start += size
    assert start == n_layers, (start, n_layers)
    return out


def max_stages(n_layers: int, *, first_stage_less: int = 1, last_stage_less: int = 1) -> int:
    """The most stages `split_layers` accepts for `n_layers` blocks (every stage holds one)."""
    best = 1
    for s in range(2, n_layers + 1):
        try:
            split_layers(n_layers, s, first_stage_less=first_stage_less, last_stage_less=last_stage_less)
        except ValueError:
            break
        best = s
    return best


def bubble_fraction(
    schedule: str, pp: int, microbatches: int, num_virtual: int = 1, *, f: float = 1.0, b: float = 1.0, w: float = 1.0
) -> float:
    """The idle share of a pp rank's step time in the ideal schedule (equal stage costs, free
    communication): bubble / (bubble + compute).

    - GPipe, 1F1B: (p - 1) / (m + p - 1) (1F1B has GPipe's bubble with p, not m, micro-batches
      of activations in flight);
    - Interleaved1F1B, LoopedBFS: (p - 1) / (v m + p - 1): each of the v stages of a rank is 1/v
      of its layers, so the warm-up and drain are v times shorter;
    - InterleavedZeroBubble, ZBVZeroBubble: the backward split into B (input gradient) and W
      (weight gradient) fills the bubble with W passes; with per-micro-batch, full-depth costs
      `f`, `b`, `w` (forward, B, W) what is left is (p - 1) max(0, f + b - 2 w) / v per rank
      (zero when f = b = w, the schedules' design point).
    `p` = pp, `m` = micro-batches per step, `v` = stages per rank.
    """
    p, m, v = pp, microbatches, num_virtual
    if p <= 1:
        return 0.0
    if schedule in ZERO_BUBBLE_SCHEDULES:
        bubble = (p - 1) * max(0.0, f + b - 2 * w) / v
        compute = m * (f + b + w)
        return bubble / (bubble + compute)
    if schedule in SINGLE_STAGE_SCHEDULES:
        return (p - 1) / (m + p - 1)
    return (p - 1) / (v * m + p - 1)


# ------------------------------------------------------------------------------ the stage modules

FIRST_STAGE_MODULES = ("tok_embeddings",)
"""Top-level modules only the first stage holds."""
LAST_STAGE_MODULES = ("norm", "output")
"""Top-level modules only the last stage holds."""


def prune_model(model: nn.Module, *, block: str, layers: list[int], first: bool, last: bool) -> nn.Module:
    """Reduce `model` in place to the blocks `layers` of its stack `block` (keys kept: `layers.3`
    stays `layers.3`), dropping the embedding unless `first` and the norm and head unless `last`.
    Call it on the meta device, before any parallelism."""
    stack = getattr(model, block)
    keep = {str(i) for i in layers}
    for key in list(stack.keys()):
        if key not in keep:
            del stack[key]
    if not first:
        for name in FIRST_STAGE_MODULES:
            setattr(model, name, None)
    if not last:
        for name in LAST_STAGE_MODULES:
            setattr(model, name, None)
    return model


def stage_view(model: nn.Module, *, block: str, layers: list[int], first: bool, last: bool) -> nn.Module:
    """One stage of the pruned `model`: a shallow copy holding that stage's blocks and sharing every
    submodule (so its parameters, gradients and buffers are the model's). Its `forward` is the
    model's: the first stage takes token ids, the others hidden states; the last returns logits."""
    view = copy.copy(model)
    view._modules = dict(model._modules)
    view._parameters = dict(model._parameters)
    view._buffers = dict(model._buffers)
    stack = getattr(model, block)
    sub = copy.copy(stack)
    sub._modules = {str(i): stack[str(i)] for i in layers}
    view._modules[block] = sub
    if not first:
        for name in FIRST_STAGE_MODULES:
            view._modules[name] = None
    if not last:
        for name in LAST_STAGE_MODULES:
            view._modules[name] = None
    return view


_IN_CHUNK = contextvars.ContextVar("titan_pp_chunk_forward", default=False)


def in_chunk_forward() -> bool:
    """True inside a stage forward that the schedule runs on one of its chunks (False in the
    metadata inference `torch.distributed.pipelining` runs before a first step or evaluation: a
    forward on the first chunk's shapes, or on empty tensors, whose outputs are discarded)."""
    return _IN_CHUNK.get()


@functools.cache
def _chunk_stage_class():
    from torch.distributed.pipelining import PipelineStage

    class ChunkStage(PipelineStage):
        """`PipelineStage` whose chunk forwards (`forward_maybe_with_nosync`, every chunk of
        `forward_one_chunk`) run with `in_chunk_forward()` True.

        And a V schedule's forward-only call (`schedule.eval`, validation): torch runs the
        training action list with the stages' `has_backward` off, where each backward action
        returns at once but the hand-off of the input gradient between the two adjacent stages of
        a rank (ZBVZeroBubble's stages p - 1 and p on the last rank, torch's "V-schedule special
        case") asserts `has_backward`; without a backward there is no gradient to hand over, so
        both ends do nothing then."""

        def forward_maybe_with_nosync(self, *args, **kwargs):
            token = _IN_CHUNK.set(True)
            try:
                return super().forward_maybe_with_nosync(*args, **kwargs)
            finally:
                _IN_CHUNK.reset(token)

        def get_local_bwd_output(self, mb_index):
            return super().get_local_bwd_output(mb_index) if self.has_backward else ()

        def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
            if self.has_backward:
                super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)

    return ChunkStage


def build_schedule(
    model: nn.Module,
    *,
    block: str,
    n_layers: int,
    schedule: str,
    pp_rank: int,
    pp: int,
    num_virtual: int,
    microbatches: int,
    pp_group,
    device: torch.device,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    first_stage_less: int = 1,
    last_stage_less: int = 1,
    stage_module: Callable[[nn.Module], nn.Module] | None = None,
):
    """(schedule, stages) of this pp rank over the pruned `model`. `loss_fn(output, target)` runs on
    the last stage per micro-batch; gradients are not rescaled by the schedule (scale_grads=False):
    the loss function carries the 1 / micro-batches factor, so that gradient accumulation over
    several `step` calls adds up like the eager step's. `stage_module(view)`, if given, is the
    module each stage runs in place of its view (a wrapper sharing the view's parameters)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

    stage_cls = _chunk_stage_class()
    num_stages = pp * num_virtual
    split = split_layers(n_layers, num_stages, first_stage_less=first_stage_less, last_stage_less=last_stage_less)
    stages = []
    for s in stage_ids(pp_rank, pp, schedule, num_virtual):
        view = stage_view(model, block=block, layers=list(split[s]), first=s == 0, last=s == num_stages - 1)
        module = stage_module(view) if stage_module is not None else view
        stages.append(stage_cls(module, s, num_stages, device, group=pp_group))
    cls = get_schedule_class(schedule)
    if issubclass(cls, PipelineScheduleSingle):
        assert len(stages) == 1, (schedule, len(stages))
        sched = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    else:
        sched = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return sched, stages


@dataclass(frozen=True)
class PipelinePlan:
    """The resolved `[parallelism] pipeline_*` settings of a run with pp > 1 (the step plan's)."""

    pp: int
    schedule: str
    num_virtual: int
    """Stages per pp rank."""
    microbatches: int
    """Micro-batches per schedule step (each accumulation micro-batch is split into these)."""
    first_stage_less: int = 1
    last_stage_less: int = 1
    uniform: bool = False
    """Graph mode's uniform stages (trainer/graph/pipeline.py): every pp rank holds as many blocks
    (first/last_stage_less 0) and also the embedding, the norm and the head, so that its program is
    every other rank's (SPMD); which of them a rank uses is data (its stage index), not code."""
    scan_iterations: bool = False
    """Graph mode: the pipeline's iterations as one scan (`[compile] scan_pipeline_iterations`)."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.num_virtual

    def split(self, n_layers: int) -> list[range]:
        """`split_layers` of this plan: the blocks of every stage."""
        return split_layers(
            n_layers, self.num_stages, first_stage_less=self.first_stage_less, last_stage_less=self.last_stage_less
        )

    def rank_layers(self, n_layers: int, pp_rank: int) -> list[int]:
        """The blocks pp rank `pp_rank` holds, in layer order."""
        split = self.split(n_layers)
        return sorted(i for s in stage_ids(pp_rank, self.pp, self.schedule, self.num_virtual) for i in split[s])

    def rank_has_first_last(self, pp_rank: int) -> tuple[bool, bool]:
        """(holds stage 0's embedding, holds the last stage's norm and head) for pp rank `pp_rank`
        (both on every rank with uniform stages)."""
        if self.uniform:
            return True, True
        ids = stage_ids(pp_rank, self.pp, self.schedule, self.num_virtual)
        return 0 in ids, self.num_stages - 1 in ids

    def bubble(self) -> float:
        """`bubble_fraction` of this plan (the ideal schedule)."""
        return bubble_fraction(self.schedule, self.pp, self.microbatches, self.num_virtual)


@torch.no_grad()
def init_weights_as_whole(model: nn.Module, whole: nn.Module, *, device: torch.device) -> None:
    """Initialise the pruned (and parallelized, materialized) `model` with the values the whole
    model `whole` (on meta, unpruned) gets from the current RNG state, leaving the RNG where the
    whole model's init leaves it: a PP run starts from the one-process run's weights.

    The whole model is materialized on `device` for the while (plain tensors: one full copy per
    rank, as SimpleFSDP's CPU init already costs); a large model starts from a checkpoint or
    Hugging Face weights instead (`[checkpoint] initial_load_path`).
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if device.type == "cuda" else None
    model.init_weights(buffer_device=device)  # buffers (RoPE tables) and any state beside the weights
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    whole.to_empty(device=device)
    whole.init_weights(buffer_device=device)
    values = dict(whole.named_parameters(remove_duplicate=False))
    for name, param in model.named_parameters():
        full = values[name]
        if isinstance(param, DTensor):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)
    del values
