"""The trainer: everything about a job.

The face (loaded on first use, so that `import trainer.config` stays light):
- `train(cfg)` / `main(argv)`: the training loop and its CLI (`python -m trainer.train`);
- `Engine`: the trainer as a library for an RL loop (trainer/engine.py);
- `build_job(cfg)` / `plan_job(cfg, ...)`: the one build every entry point uses, and its
  build-free check (trainer/job.py).

Packages by concern, each with a face in its `__init__`: `config/` (the recipe), `step/` (plan and
rules, loss, eager step), `graph/` (the captured step), `tasks/` (lm, flow), `data/` (text,
tokenizer), `flux_data/` (the FLUX data set: build, reader, loader), `optim/` (AdamW, Muon, QK clip,
lr schedule, expert balance), `checkpoint/` (manager, state, manifest, initial weights, gs:// steps),
`runtime/` (device, preemption, watchdog, flops, metrics, storage seam, run lock). Modules:
`launch.py` (the multi-host launcher CLI, `python -m trainer.launch`), `flux_run.py` (a trained
FLUX run rebuilt from its dump folder, for scripts/sample.py and scripts/eval_flux.py), `hf_convert.py`
(DCP checkpoints <-> Hugging Face safetensors, for scripts/convert.py).

The rooms are layered, imports pointing down only (tests/unit/test_layout.py: TRAINER_LAYERS):
runtime < checkpoint, data, optim, step < flux_data < graph, tasks < config < callbacks, job <
the entry points (engine, flux_run, hf_convert, launch, train).
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
