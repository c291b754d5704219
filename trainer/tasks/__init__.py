"""Tasks: what a model family trains on, and how the trainer feeds and measures it.

A family declares its task (`ModelFamily.task`, models/__init__.py); `build_task` returns the
object the trainer (`trainer/job.py`) asks for everything that depends on it:
- `seq_len_to_divide(training)` (static): the sequence length the parallel degrees must divide
  (0: none), read by `trainer.job.plan_job` before any task is built;
- `build_loader(split=..., ...)`: the train / validation loader (`next_batch()`, `check(n)`,
  `state_dict()` / `load_state_dict()`, iteration), bad paths failing before any checkpoint;
- `prepare(batch) -> tuple[Tensor, ...]`: the host-side micro-batch the steps take;
- `loss_fn(step_plan)`: `loss(model, *micro_batch) -> 0-dim fp32 loss`, called by the eager
  and the graph step alike;
- `unit` ("tokens" | "samples"), `units_per_sample` and `flops_per_unit()` for throughput
  and MFU;
- `sample_grid(model)`: an image logged at validation, or None (FLUX's held-out prompts).

Two tasks exist: "lm" (decoder LMs: tokens in, next-token cross entropy) and "flow"
(FLUX: rectified flow on precomputed latents and text embeddings, trainer/tasks/flux.py).
"""

from __future__ import annotations

from trainer.step.plan import TASKS
from trainer.tasks.flux import FlowSettings, FlowTask
from trainer.tasks.lm import LMSettings, LMTask

TASK_CLASSES = {"lm": LMTask, "flow": FlowTask}
assert tuple(TASK_CLASSES) == TASKS, "a task the step plan's rules do not know"

__all__ = ["TASKS", "TASK_CLASSES", "FlowSettings", "FlowTask", "LMSettings", "LMTask", "build_task"]


def build_task(cfg, *, family, args, step_plan=None, compute_dtype=None, cp=None):
    """The task object of `family` (its `task` field) for this run, given the few settings it
    reads (`LMSettings`, `FlowSettings`): `step_plan` (trainer/step) decides what a micro-batch
    carries (LM: segment ids, restart positions); `compute_dtype`: the run's resolved compute
    dtype (`Job.runtime.compute.dtype`, FLUX's input cast); `cp`: the context-parallel group (`CPGroup`)
    when the LM windows are split over cp ranks, else None."""
    task = getattr(family, "task", "lm")
    # An unknown task is refused by the step plan's rules (`plan_job`) before anything is built.
    assert task in TASK_CLASSES, f"{family.name} declares task {task!r}: plan_job refuses it first"
    if task == "flow":  # the FLUX plan never splits the sequence (`seq_len_to_divide`): no cp
        assert compute_dtype is not None, "the run's resolved compute dtype (Job.runtime.compute.dtype)"
        return FlowTask(FlowSettings.of(cfg, compute_dtype), args=args)
    return LMTask(LMSettings.of(cfg, step_plan), args=args, cp=cp)
