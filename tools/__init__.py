"""Pre-flight: will a recipe start, compile and fit on its TPU target, and how fast would it run, asked
before a pod is rented; never imported by the trainer (tests/unit/test_layout.py).

- recipe_check: the trainer's own start-up on a fake world of the target's size, without a TPU
  (scripts/check_recipe.py);
- tpu_compile: the per-device program compiled deviceless for the target chip, with the
  compiler's memory analysis (scripts/check_recipe.py --compile, scripts/estimate_xla.py);
- xla_lowering: the captured train step lowered to a JAX function through torchax (tpu_compile,
  scripts/estimate_xla.py, the XLA tier);
- xla_estimate_run: scripts/estimate_xla.py's check (the target and plan, the planner's estimate,
  the worker's spec and launch, the verdict; an EP recipe through tpu_compile);
- xla_estimate: the worker of scripts/estimate_xla.py (capture on meta, lower, compile for a
  topology, the compiler's memory and cost analysis);
- xla_estimate_report: scripts/estimate_xla.py's reports (the compiler's memory and cost beside the
  planner's, the verdict, the discrepancies, the CSV row);
- xla_hlo: the optimized HLO text read: executed computations, trip counts, per-op compute cost;
- xla_projection: the step-time bound of a compiled per-device program, compute plus its
  collectives (scripts/mfu_suite.py --project); maxtext_runs: MaxText's published TPU runs at
  their settings, the projection's calibration inputs (scripts/bench/maxtext_compile.py);
- benchmark: the runner of scripts/benchmark.py and of scripts/mfu_suite.py's sweep (the trainer as
  a subprocess per variant, interleaved repeats, metrics.jsonl summaries, the table and CSVs);
- mfu_projection, mfu_report: scripts/mfu_suite.py's projections (the FSDP bound, the trainer's
  program, weak scaling) and its anchors, tables and plots;
- mfu_suite: scripts/mfu_suite.py's suite (the command line's lists checked, the runs, the FSDP
  projections from scripts/estimate_xla.py and the trainer-program ones, the outputs);
- mfu_runs: scripts/mfu_suite.py's measured side (its runs grouped and resumed) and its outputs
  (the CSVs, plots and <out>.md);
- deviceless_env: the environment of a worker that compiles for a TPU without one;
- torch_tpu_mesh: torch-tpu's own mesh layout on stand-in devices of a slice (the recipe check's
  device order, run in the ttpu venv);
- tpu_smoke: the first-contact smoke runs on a TPU VM (scripts/tpu_smoke.sh); tpu_smoke_report:
  their logs, metrics and report.md; tpu_smoke_shim: the fake launch environment of `--shim`;
  tpu_multislice: the printed plan of a first multislice run (`--multislice`).

Helpers that only tests or benchmarks use live with them (tests/support/, scripts/bench/).
"""
