"""The trainer: everything about a job.

The face (loaded on first use, so that `import trainer.config` stays light):
- `train(cfg)` / `main(argv)`: the training loop and its CLI (`python -m trainer.train`);
- `Engine`: the trainer as a library for an RL loop (trainer/engine.py);
- `build_job(cfg)` / `plan_job(cfg, ...)`: the one build every entry point uses, and its
  build-free check (trainer/job.py).

Packages by concern, each with a face in its `__init__`: `step/` (plan and rules, loss, eager
step), `graph/` (the captured step), `tasks/` (lm, flow), `data/` (text, tokenizer, FLUX),
`optim/` (AdamW, Muon, QK clip, lr schedule, expert balance), `checkpoint/` (manager, state,
manifest, initial weights), `runtime/` (device, preemption, watchdog, flops, metrics). Modules:
`config.py` (the recipe), `launch.py` (the multi-host launcher CLI, `python -m trainer.launch`).
"""

_FACE = {
    "train": "trainer.train",
    "main": "trainer.train",
    "Engine": "trainer.engine",
    "build_job": "trainer.job",
    "plan_job": "trainer.job",
    "Job": "trainer.job",
}

__all__ = sorted(_FACE)


def __getattr__(name: str):
    if name in _FACE:
        import importlib

        return getattr(importlib.import_module(_FACE[name]), name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
