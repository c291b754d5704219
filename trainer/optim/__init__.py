"""The optimizer step's parts: optimizers, the lr schedule, and what runs after each update.

- `build.py`: AdamW (`build_optimizer`), the `[optimizer] name` entry point
  (`build_optimizer_for`) and the `[lr_scheduler]` schedule (`build_lr_scheduler`, `lr_factor`);
- `muon.py`: Muon (orthogonalised momentum for the blocks' matrices, AdamW for the rest);
- `qk_clip.py`: MuonClip's QK clip (Kimi K2);
- `expert_balance.py`: the MoE expert loads and the auxiliary-loss-free bias step.
"""

from trainer.optim.build import (
    DECAY_TYPES,
    OPTIMIZERS,
    Schedule,
    build_lr_scheduler,
    build_optimizer,
    build_optimizer_for,
    lr_factor,
)

__all__ = [
    "DECAY_TYPES",
    "OPTIMIZERS",
    "Schedule",
    "build_lr_scheduler",
    "build_optimizer",
    "build_optimizer_for",
    "lr_factor",
]
