"""The train step: its plan (what `[compile] mode` decides, and the refusal rules), its loss and
the eager step. The graph step is `trainer.graph`; `trainer.job.Job.build_step` picks between them."""

from trainer.step.eager import EagerStep, step_if_finite
from trainer.step.loss import StepOutput, lm_loss, local_scalar, plain_loss
from trainer.step.plan import (
    BACKENDS,
    FUSED_LOSS,
    MODES,
    RULES,
    TASKS,
    Rule,
    StepPlan,
    StepRequest,
    plan_step,
    refusals,
    resolve_backend,
)

__all__ = [
    "BACKENDS",
    "FUSED_LOSS",
    "MODES",
    "RULES",
    "TASKS",
    "EagerStep",
    "Rule",
    "StepOutput",
    "StepPlan",
    "StepRequest",
    "lm_loss",
    "local_scalar",
    "plain_loss",
    "plan_step",
    "refusals",
    "resolve_backend",
    "step_if_finite",
]
