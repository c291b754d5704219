"""Run TorchTitan 0.3.0's own trainer (`torchtitan.train.main`) with the changes it needs on a CPU.

This file runs inside the peer venv (scripts/bench/peer_env.sh), never in ours. It is the whole shim:

1. **Device helpers.** `torchtitan.tools.utils` decides its device once, at import:
   `_get_available_device_type() or "cuda"`, so a machine without CUDA gets "cuda" and the trainer
   fails at `torch.cuda.set_device`. Without CUDA we set that module's `device_type` to "cpu" and
   `device_module` to a thin stand-in for `torch.cpu` that adds the memory-statistics calls the
   metrics code makes (memory_stats() is empty, so TorchTitan's memory column reads -0.00 GiB: the
   CPU has no caching allocator to ask) and an integer current_device(). This happens before any
   other torchtitan module imports those two names. With CUDA present nothing is changed.
2. **Attention.** The debug model's inner attention is FlexAttention, which has no CPU backward in
   torch 2.13. The config function `llama3_debugmodel_sdpa` below is TorchTitan's own
   `llama3_debugmodel()` with every layer's `inner_attention` set to TorchTitan's own
   `ScaledDotProductAttention` module (causal, no document mask), the same swap its graph_trainer
   tests make. The trainer already handles this maskless backend (it then builds no masks). On
   CUDA we keep the swap too, so both devices run the same model (FlexAttention would add TorchTitan's
   per-document mask; SDPA, like ours, is causal over the whole window).
3. **One torch name.** After step 1 TorchTitan calls `torch.distributed.set_timeout`, which the
   torch 2.13.0 release has only as `distributed_c10d._set_pg_timeout` (same signature): we alias it
   when it is missing (on every device; TorchTitan 0.3.0 was cut against a newer nightly).
4. **The MoE model** (`qwen3_moe_debug_sdpa`, TorchTitan's `qwen3_moe_debug()`: Qwen 3 debugmodel_moe,
   64 experts, top-8) needs only shim 2 on top of shims 1 and 3: its `qwen3` model registry defaults
   to FlexAttention too, so every layer gets the same SDPA swap. Nothing in its MoE path needs
   CUDA at expert-parallel degree 1: the router is plain torch (`debug.moe_force_load_balance`
   replaces its choice by round-robin), `LocalTokenDispatcher` reorders tokens with argsort and
   scatter_add, and `GroupedExperts` calls `torch._grouped_mm` on bf16 copies of its inputs and
   weights, which torch 2.13 runs on the CPU. The triton kernels TorchTitan imports belong to its
   all-to-all dispatchers (EP > 1) and are never called here. Checked 2026-12-05 by a run to
   completion on the CPU (scripts/benchmark.py --preset moe_ttshape).

5. **Pre-split pipeline micro-batches.** With pipeline parallelism TorchTitan 0.3.0 cuts the batch
   into micro-batches itself and calls `schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...,
   losses=..., loss_kwargs=..., return_outputs=False)`, the API of the newer nightly it was cut
   against. torch 2.13.0's `step(*args, target=None, ..., **kwargs)` takes the whole batch and
   splits it, so those lists arrive as model keyword arguments and are cut again: every PP run
   fails at its first step with `ValueError: Expecting 4 arg_mbs but got 2` (m = 4). We wrap
   `PipelineScheduleSingle.step` and `PipelineScheduleMulti.step`: a call with those keywords runs
   what torch 2.13's own `step` runs after its split (the stages' `has_backward`, their
   `clear_runtime_states()`, `_step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses,
   return_outputs, loss_kwargs=...)`, the merged output); any other call goes to torch's `step`
   unchanged. The schedules themselves (GPipe, 1F1B, Interleaved1F1B, ZBVZeroBubble, ...) are torch's.

Everything else (config system, model build, SelectiveAC, loss, AdamW, LR schedule, data loader,
metrics, the train loop) is TorchTitan's own code. Usage (what scripts/bench/reference_torchtitan.py runs):

    .venv-peer/bin/python scripts/bench/peer/torchtitan_cpu_shim.py \
        --module scripts.bench.peer.torchtitan_cpu_shim --config llama3_debugmodel_sdpa|qwen3_moe_debug_sdpa \
        --hf-assets-path DIR --dataloader.dataset-path DIR [--section.key value ...]
"""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import torch


def _cpu_device_module() -> types.ModuleType:
    """torch.cpu plus the CUDA memory-statistics API TorchTitan's metrics call, answering zeros."""
    module = types.ModuleType("torchtitan_cpu_device")
    for name in dir(torch.cpu):
        if not name.startswith("__"):
            setattr(module, name, getattr(torch.cpu, name))
    zero = lambda *args, **kwargs: 0  # noqa: E731
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(module, name, zero)
    module.memory_stats = lambda *args, **kwargs: {}
    module.reset_peak_memory_stats = lambda *args, **kwargs: None
    module.empty_cache = lambda *args, **kwargs: None
    module.get_device_name = lambda *args, **kwargs: "cpu"
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    module.get_device_properties = lambda *args, **kwargs: types.SimpleNamespace(name="cpu", total_memory=ram)
    module.device_count = lambda: 1
    module.set_device = lambda *args, **kwargs: None
    # torch.cpu.current_device() is the string "cpu"; TorchTitan passes it to barrier(device_ids=[...]),
    # which takes integers (gloo ignores them).
    module.current_device = lambda: 0
    return module


def point_device_helpers_at_cpu() -> None:
    """Shim 1: without CUDA, make torchtitan.tools.utils report the CPU (before anything imports it)."""
    if torch.cuda.is_available():
        return
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = _cpu_device_module()


def alias_set_timeout() -> None:
    """Shim 3: TorchTitan 0.3.0 calls `torch.distributed.set_timeout` after step 1; torch 2.13.0 has that
    function only under its private name `distributed_c10d._set_pg_timeout` (same signature)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = distributed_c10d._set_pg_timeout


def llama3_debugmodel_sdpa():
    """Shim 2: TorchTitan's llama3_debugmodel() with its own SDPA module as every layer's inner attention."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def qwen3_moe_debug_sdpa():
    """Shim 2 for the MoE model: TorchTitan's qwen3_moe_debug() with its SDPA module in every layer."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return config


def accept_presplit_microbatches() -> None:
    """Shim 5: `schedule.step(arg_mbs=..., kwarg_mbs=..., target_mbs=...)` (TorchTitan 0.3.0's call) on
    torch 2.13.0, whose `step` takes the whole batch; see the module docstring."""
    from torch.distributed.pipelining import schedules

    def wrap(cls, stages_of):
        whole_batch_step = cls.step
        if getattr(whole_batch_step, "_presplit_shim", False):
            return

        def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None, **kwargs):
            if not ({"arg_mbs", "kwarg_mbs", "target_mbs"} & kwargs.keys()):
                return whole_batch_step(
                    self,
                    *args,
                    target=target,
                    losses=losses,
                    return_outputs=return_outputs,
                    loss_kwargs=loss_kwargs,
                    **kwargs,
                )
            arg_mbs, kwarg_mbs = kwargs.pop("arg_mbs", None), kwargs.pop("kwarg_mbs", None)
            target_mbs = kwargs.pop("target_mbs", None)
            if args or kwargs or target is not None:
                raise TypeError("pre-split micro-batches (arg_mbs/kwarg_mbs/target_mbs) with whole-batch inputs")
            for stage in stages_of(self):
                stage.has_backward = self._has_backward
                stage.clear_runtime_states()
            self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
            for stage in stages_of(self):
                if stage.is_last and return_outputs:
                    return self._merge_outputs(stage.output_chunks)
            return None

        step._presplit_shim = True
        cls.step = step

    wrap(schedules.PipelineScheduleSingle, lambda sched: [sched._stage])
    wrap(schedules.PipelineScheduleMulti, lambda sched: list(sched._stages))


def main() -> None:
    # `--module scripts.bench.peer.torchtitan_cpu_shim` must import this file by that name.
    repo = str(Path(__file__).resolve().parents[3])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    point_device_helpers_at_cpu()
    alias_set_timeout()
    accept_presplit_microbatches()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
