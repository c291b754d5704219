"""Tools for tests and scripts, never imported by the trainer: the torchax lowering of a captured
train step (xla_lowering; the XLA tier and scripts/estimate_xla.py), a trained FLUX run
rebuilt in one process (flux_run; scripts/sample.py, scripts/eval_flux.py), the recipe
check (recipe_check; scripts/check_recipe.py), the XLA:TPU MFU projection (xla_projection) and
the first-contact smoke runs and their report (tpu_smoke; scripts/tpu_smoke.sh), and thread ranks
over the in-process process group (thread_world; tests and scripts/bench/moe_dispatch_cost.py)."""
