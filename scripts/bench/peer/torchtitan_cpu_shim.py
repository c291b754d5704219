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


def main() -> None:
    # `--module scripts.bench.peer.torchtitan_cpu_shim` must import this file by that name.
    repo = str(Path(__file__).resolve().parents[3])
    if repo not in sys.path:
        sys.path.insert(0, repo)
    point_device_helpers_at_cpu()
    alias_set_timeout()
    from torchtitan.train import main as torchtitan_main

    torchtitan_main()


if __name__ == "__main__":
    main()
