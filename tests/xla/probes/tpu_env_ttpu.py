"""Probe (ttpu venv): trainer/runtime/tpu_env.py and profiler.py against the real torch-tpu 0.2.0, without a TPU.

    python tpu_env_ttpu.py

- the profiler a TPU `[profiling]` step runs under: `profiler_plan("tpu", ...)` with the real
  `torch.tpu` builds torch-tpu's `TpuProfilerConfig` from the arguments the trainer passes
  (run_dir, worker_rank), and `torch.profiler.profile` accepts the plan's keyword arguments
  (constructed only: starting it needs the TPU's profiler backend);
- the compilation-cache counter the loop reads: `torch.tpu._get_cache_misses` resolves to
  torch-tpu's device module (calling it needs an initialised TPU runtime: recorded, not required).

Prints one JSON line.
"""

from __future__ import annotations

import json
import traceback

import torch


def main() -> None:
    import torch_tpu  # noqa: F401  (autoload is off: installs torch.tpu, no device)

    from trainer.runtime.profiler import profiler_plan
    from trainer.runtime.tpu_env import compilations, compile_cache_misses

    out: dict = {}
    try:
        plan = profiler_plan("tpu", folder="/tmp/titan-profile/step-3", rank=5, tpu_module=torch.tpu)
        config = plan.kwargs["experimental_config"]
        out["config_type"] = f"{type(config).__module__}.{type(config).__qualname__}"
        out["config_is_experimental_config"] = isinstance(config, torch.profiler._ExperimentalConfig)
        out["activities"] = [a.name for a in plan.kwargs["activities"]]
        out["chrome_trace"] = plan.chrome_trace
        torch.profiler.profile(**plan.kwargs)  # constructed, never started
        out["profile_constructed"] = True
    except Exception as e:
        out["profiler_error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-3000:]
    getter = getattr(torch.tpu, "_get_cache_misses", None)
    out["cache_misses_getter"] = callable(getter)
    out["cache_misses_without_device"] = compile_cache_misses("tpu")
    out["compilations_without_device"] = compilations("tpu")
    import importlib.metadata as md

    out["versions"] = {p: md.version(p) for p in ("torch", "torch-tpu", "libtpu")}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
