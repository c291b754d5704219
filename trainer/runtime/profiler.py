"""The profiler of a `[profiling]` step, on every device.

On cpu / cuda torch.profiler's CPU (+ CUDA) activities and a Chrome trace; on a TPU torch-tpu's
`TpuProfilerConfig` (an XPlane file for xprof). The TPU path has not run on a TPU (docs/tpu.md).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProfilerPlan:
    """How a profiled step is recorded: keyword arguments of `torch.profiler.profile`, and
    whether the trace is exported as Chrome JSON afterwards (cpu / cuda) or written by the
    backend itself (tpu: torch-tpu's profiler writes an XPlane file that xprof and TensorBoard's
    profile plugin read)."""

    kwargs: dict
    chrome_trace: bool
    what: str


def profiler_plan(device_type: str, *, folder: str, rank: int, tpu_module=None, cuda: bool = False) -> ProfilerPlan:
    """`[profiling]` for one step: on a TPU torch-tpu's `TpuProfilerConfig` (its run_dir is
    `folder`, the file named with this rank) through `experimental_config`, with the CPU and the
    PrivateUse1 (TPU) activities; elsewhere torch.profiler's CPU (+ CUDA) activities and a
    Chrome trace. `tpu_module` stands for `torch.tpu` (tests inject one)."""
    from torch.profiler import ProfilerActivity

    if device_type == "tpu":
        if tpu_module is None:
            import torch

            tpu_module = torch.tpu
        config = tpu_module.profiler.TpuProfilerConfig(run_dir=folder, worker_rank=str(rank))
        return ProfilerPlan(
            kwargs={"activities": [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1], "experimental_config": config},
            chrome_trace=False,
            what=f"XPlane (torch-tpu TpuProfilerConfig) under {folder}",
        )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return ProfilerPlan(
        kwargs={"activities": activities, "record_shapes": True}, chrome_trace=True, what=f"Chrome trace under {folder}"
    )


@contextlib.contextmanager
def profile_step(plan: ProfilerPlan, *, trace_path: str):
    """Run the body under `torch.profiler.profile(**plan.kwargs)`; write the Chrome trace to
    `trace_path` when the plan asks for one (its folder is made)."""
    from torch.profiler import profile

    os.makedirs(os.path.dirname(trace_path), exist_ok=True)
    with profile(**plan.kwargs) as prof:
        yield
    if plan.chrome_trace:
        prof.export_chrome_trace(trace_path)
