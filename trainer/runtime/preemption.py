"""Preemption: on SIGTERM, finish the current step, write a checkpoint, exit with code 75.

Preemptible TPU VMs and spot instances get SIGTERM (from the OS shutdown, or from torchrun,
which forwards its own SIGTERM to the workers and kills them about 30 s later), so the window
to save is short. The handler only sets a flag; the training loop asks `requested()` after
every step, which takes the maximum of the flag over all ranks (one tiny all-reduce on a CPU
gloo group, so the accelerator is never synchronised), so every rank stops after the same step
even when the signal reaches them at different times. The loop then writes a checkpoint of that
step (whatever `checkpoint.interval` says) and exits with `PREEMPTED_EXIT_CODE` (75, EX_TEMPFAIL:
"try again"); the next launch resumes from it like from any checkpoint. Once a preemption is
requested the handler stays installed to the end of the process: a second SIGTERM (torchrun
stops the remaining workers as soon as the first one exits 75) cannot cut a save or an exit short.
How the code reaches an orchestrator through the launcher: trainer/runtime/exit_status.py.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from models.common import distributed
from trainer.runtime.device import cpu_backend
from trainer.runtime.exit_status import PREEMPTED_EXIT_CODE  # noqa: F401  (re-exported: trainer.runtime)


class Preempted(Exception):
    """Raised by the loop after the preemption checkpoint is written."""

    def __init__(self, step: int, folder: str):
        super().__init__(
            f"preempted (SIGTERM): checkpoint of step {step} written to {folder}; relaunch the same command to resume"
        )
        self.step = step


class PreemptionHandler:
    def __init__(self, signals=(signal.SIGTERM,)):
        self._flag = False
        self._previous = {}
        self._group = None
        for sig in signals:
            try:
                self._previous[sig] = signal.signal(sig, self._on_signal)
            except ValueError:  # not the main thread: leave the default handler
                pass
        if distributed.multi_rank():
            self._group = (
                dist.group.WORLD
                if dist.get_backend() in ("gloo", cpu_backend())
                else dist.new_group(backend=cpu_backend())
            )

    def _on_signal(self, signum, frame) -> None:
        self._flag = True

    def requested(self) -> bool:
        """True on every rank once any rank got the signal (a collective: call it on all ranks)."""
        if self._group is None:
            return self._flag
        flag = torch.tensor([int(self._flag)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        return bool(flag.item())

    def close(self) -> None:
        if self._flag:  # preempting: keep ignoring SIGTERM (it only sets the flag) until the exit
            return
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


# A peer that is gone: what gloo, NCCL and the c10d store raise when a rank of another host or
# slice died (its sockets closed, or nothing came within training.collective_timeout_s).
_LOST_PEER_TEXT = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "socket closed",
    "no route to host",
    "connection refused",
)


def lost_peer(error: BaseException) -> bool:
    """True when `error` (raised in a multi-rank job) says a collective lost its peer: the job
    cannot go on, and a relaunch on the hosts left resumes from the newest complete checkpoint
    tier, so the trainer exits 75 (as when preempted) instead of 1. Errors in the chain count
    (a checkpoint save wraps the collective's error)."""
    if not distributed.multi_rank():
        return False
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, dist.DistError):
            return True
        if isinstance(error, RuntimeError) and any(t in str(error).lower() for t in _LOST_PEER_TEXT):
            return True
        error = error.__cause__ or error.__context__
    return False
