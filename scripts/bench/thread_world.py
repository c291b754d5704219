"""Thread ranks: run a function on N ranks that are threads of this process, over PyTorch's
in-process "threaded" process group (DTensor, TP, EP and SimpleFSDP run unchanged; fast, CPU
only). For the benchmarks that count what a collective moves (moe_dispatch_cost.py, moe_parity.py)
and for the tests (tests/support/parallel_harness.py; pytest finds it on its pythonpath,
pyproject.toml). The global RNG is shared by the threads, so draw
random numbers in the main thread or seed per rank. Also the helpers parity checks share: load a
full state into a sharded model, gather a DTensor, and the relative difference they report."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms


def run_threads(world_size: int, fn) -> list:
    """Run `fn()` on `world_size` thread ranks; return the per-rank results (rank order)."""
    results: dict[int, object] = {}

    def body(_self):
        results[dist.get_rank()] = fn()

    spawn_threads_and_init_comms(world_size=world_size)(body)(None)
    return [results[r] for r in range(world_size)]


@torch.no_grad()
def load_full_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy full tensors into a (possibly sharded) model: each rank keeps its own shard."""
    for name, param in model.named_parameters():
        full = state[name]
        if isinstance(param, DTensor):
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(full)


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective), a plain tensor as is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, in float32."""
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()
