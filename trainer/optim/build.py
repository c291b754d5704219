"""Optimizer and learning-rate schedule.

AdamW keeps fp32 state for fp32 master parameters (SimpleFSDP casts to the compute dtype only
inside forward/backward). The schedule is a `LambdaLR`: linear warmup, then linear, cosine,
warmup-stable-decay (wsd) or constant. Its factor for optimizer step s (1-based) is `lr_factor(s)`.

On resume the config wins: `Schedule.load_state_dict` takes only the step count from a
checkpoint and recomputes the lr from this run's peak lr and schedule (docs/checkpointing.md).
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR

_FUSED_DEVICES = ("cpu", "cuda")


OPTIMIZERS = ("adamw", "muon")
"""`[optimizer] name` choices (`build_optimizer`; muon: trainer/optim/muon.py)."""

DECAY_TYPES = ("linear", "cosine", "wsd", "constant")
"""`[lr_scheduler] decay_type` choices (`lr_factor`)."""


def build_optimizer(params, *, lr: float, betas, eps: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; fused where torch has the fused kernel for the parameters' device (CPU, CUDA).

    The fused kernel also takes `found_inf`, which the eager step uses to skip a non-finite
    update on the device with no host sync (trainer/step/). The graph step does not call this
    optimizer's `step`: it updates parameters and this optimizer's state in its own graph.
    """
    params = list(params)
    first = params[0]
    device = (first.to_local() if hasattr(first, "to_local") else first).device
    fused = device.type in _FUSED_DEVICES
    return torch.optim.AdamW(
        params,
        lr=lr,
        betas=tuple(betas),
        eps=eps,
        weight_decay=weight_decay,
        fused=fused,
        foreach=None if fused else False,
    )


def build_optimizer_for(
    model,
    *,
    name: str,
    lr: float,
    betas,
    eps: float,
    weight_decay: float,
    muon_momentum: float = 0.95,
    muon_nesterov: bool = True,
    muon_ns_steps: int = 5,
    muon_ns_dtype: str = "bfloat16",
    muon_exclude=None,
    qk_clip_tau: float = 0.0,
) -> torch.optim.Optimizer:
    """The `[optimizer] name` optimizer over `model`'s parameters (the job's one entry point).

    adamw: `build_optimizer`; muon: `trainer.optim.muon.Muon` (Muon for the blocks' matrices, AdamW
    with these betas/eps for the rest; `muon_exclude`: `trainer.optim.muon.split_muon_params`;
    `qk_clip_tau` > 0: MuonClip, trainer/optim/qk_clip.py).
    """
    assert name in OPTIMIZERS, name
    assert not (qk_clip_tau > 0 and name != "muon"), (
        f"qk_clip_tau > 0 with optimizer {name}: the step plan's RULES refuse it first"
    )
    if name == "adamw":
        return build_optimizer(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    from trainer.optim.muon import MUON_EXCLUDE_DEFAULT, build_muon

    return build_muon(
        model,
        lr=lr,
        weight_decay=weight_decay,
        betas=betas,
        eps=eps,
        momentum=muon_momentum,
        nesterov=muon_nesterov,
        ns_steps=muon_ns_steps,
        ns_dtype=muon_ns_dtype,
        exclude=MUON_EXCLUDE_DEFAULT if muon_exclude is None else tuple(muon_exclude),
        qk_clip_tau=qk_clip_tau,
    )


def lr_factor(
    step: int, *, total_steps: int, warmup_steps: int, decay_type: str, decay_ratio: float, min_lr_factor: float
) -> float:
    """Multiplier of the peak lr at optimizer step `step` (1-based).

    Warmup is `step / warmup_steps` whatever `total_steps` is: a run shorter than its warmup
    stops part-way up the ramp (at total_steps / warmup_steps of the peak) and never decays, so
    resuming it with more steps continues the same ramp.
    """
    if step <= warmup_steps:
        return step / warmup_steps
    if decay_type == "constant":
        return 1.0
    if decay_type == "wsd":
        decay_steps = max(1, math.ceil(decay_ratio * total_steps))
        decay_start = max(warmup_steps, total_steps - decay_steps)
        if step <= decay_start:
            return 1.0
        progress = (step - decay_start) / max(1, total_steps - decay_start)
        return 1.0 - (1.0 - min_lr_factor) * progress
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if decay_type == "linear":
        return 1.0 - (1.0 - min_lr_factor) * progress
    if decay_type == "cosine":
        return min_lr_factor + (1.0 - min_lr_factor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise AssertionError(decay_type)


class Schedule(LambdaLR):
    """A `LambdaLR` whose resume keeps this run's peak lr and schedule (the config).

    `load_state_dict` takes only the step count (`last_epoch`) from a checkpoint; the peak lr
    (`base_lrs`) stays the one this run was built with and the lr of the optimizer's groups is
    recomputed for the loaded step, exactly as `step()` would have computed it, so an unchanged
    config resumes bit for bit and a changed one (a lower lr after a rollback, a longer run, a
    new warmup) takes effect from the first resumed step. `resume_notes` says what changed.
    """

    def load_state_dict(self, state_dict: dict) -> None:
        own = list(self.base_lrs)
        saved_base = list(state_dict.get("base_lrs", own))
        saved_lr = list(state_dict.get("_last_lr", []))
        super().load_state_dict(state_dict)
        self.base_lrs = own
        for group, base, fn in zip(self.optimizer.param_groups, self.base_lrs, self.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * fn(self.last_epoch)
        self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.resume_notes = []
        if saved_base != own:
            self.resume_notes.append(
                f"optimizer.lr (peak): checkpoint {saved_base[0]:.6g} -> config {own[0]:.6g} (the config wins)"
            )
        if saved_lr and saved_lr != self._last_lr:
            self.resume_notes.append(
                f"lr of step {self.last_epoch + 1}: checkpoint schedule {saved_lr[0]:.6g} -> "
                f"config schedule {self._last_lr[0]:.6g} (the config wins)"
            )


def build_lr_scheduler(
    optimizer, *, total_steps: int, warmup_steps: int, decay_type: str, decay_ratio: float, min_lr_factor: float
) -> Schedule:
    # LambdaLR evaluates its lambda at 0 on construction (the lr of step 1), then at i for step i+1.
    def factor(i: int) -> float:
        return lr_factor(
            i + 1,
            total_steps=total_steps,
            warmup_steps=warmup_steps,
            decay_type=decay_type,
            decay_ratio=decay_ratio,
            min_lr_factor=min_lr_factor,
        )

    return Schedule(optimizer, factor)
