"""Thread ranks: run a function on N ranks that are threads of this process, over PyTorch's
in-process "threaded" process group (DTensor, TP, EP and SimpleFSDP run unchanged; fast, CPU
only). For tests (tests/support/parallel_harness.py) and scripts that count what a collective
moves (scripts/bench/moe_dispatch_cost.py). The global RNG is shared by the threads, so draw
random numbers in the main thread or seed per rank."""

from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.common_distributed import spawn_threads_and_init_comms


def run_threads(world_size: int, fn) -> list:
    """Run `fn()` on `world_size` thread ranks; return the per-rank results (rank order)."""
    results: dict[int, object] = {}

    def body(_self):
        results[dist.get_rank()] = fn()

    spawn_threads_and_init_comms(world_size=world_size)(body)(None)
    return [results[r] for r in range(world_size)]
