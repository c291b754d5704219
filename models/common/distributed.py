"""Is a process group up: the one answer every layer asks (the checkpoint state, the run lock,
the watchdog, the kernels' self-check, the planner, the mesh builder).

It sits in the bottom layer (`models`) because every layer above asks it; it imports nothing
but `torch.distributed`.
"""

from __future__ import annotations

import torch.distributed as dist


def is_up() -> bool:
    """A default process group exists (torch.distributed is built in and initialized)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Ranks of the default group; 1 when no group is up."""
    return dist.get_world_size() if is_up() else 1


def rank() -> int:
    """This process's rank in the default group; 0 when no group is up."""
    return dist.get_rank() if is_up() else 0


def multi_rank() -> bool:
    """A group of more than one rank is up (a collective would reach another process)."""
    return world_size() > 1
