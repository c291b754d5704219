"""The run's environment: the device and process group (device), the heap policy and the CPU
matmul probe (device), preemption (SIGTERM -> save -> exit 75), the hang watchdog and the
start-up barrier (watchdog), FLOPs and peak tables (flops), metrics.jsonl / TensorBoard (metrics).

The face loads each module on first use of one of its names: `trainer.runtime.device` must stay
importable alone, before anything else, so that the heap policy is applied to a process that
has allocated as little as possible (tests/e2e/test_device.py runs it in a bare subprocess).
"""

import importlib

_FACE = {
    "trainer.runtime.device": (
        "ComputeDtype",
        "DistInfo",
        "configure_host_malloc",
        "cpu_backend",
        "gather_objects",
        "global_mean",
        "init_distributed",
        "pick_device",
        "resolve_compute_dtype",
        "set_seed",
        "shutdown_distributed",
        "torch_dtype",
    ),
    "trainer.runtime.flops": ("best_peak_flops", "flops_per_token", "peak_flops_per_device"),
    "trainer.runtime.metrics": ("MetricsLogger",),
    "trainer.runtime.preemption": ("PREEMPTED_EXIT_CODE", "Preempted", "PreemptionHandler", "lost_peer"),
    "trainer.runtime.watchdog": ("StartupTimeout", "StepWatchdog", "arrival_barrier"),
}
_WHERE = {name: module for module, names in _FACE.items() for name in names}

__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'trainer.runtime' has no attribute {name!r}")
