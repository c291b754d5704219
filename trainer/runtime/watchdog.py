"""Start-up and hang diagnostics: a barrier that names the ranks that did not arrive, and a
step watchdog that dumps every thread's Python stack when a step takes far longer than usual.

- `arrival_barrier(tag, timeout_s)`: every rank writes its arrival (and host name) to the
  process group's store, then waits for all of them. A rank that never arrives (stuck loading
  data, compiling, or dead) turns the usual silent hang into one error naming those ranks and
  their hosts after `timeout_s`. The trainer calls it before the first compile, so a rank that
  compiles faster cannot run ahead into a collective that the others never reach.
- `StepWatchdog`: a daemon thread. `step_started()` / `step_finished()` bracket each step; when
  the current step has run longer than `factor` x the median of the recent steps (and at least
  `min_s`), it writes all threads' stacks with `faulthandler` to stderr and to
  `hang_rank{R}.txt` in the dump folder, once per step. Every rank runs one: in a collective
  hang all of them trip, so the stacks show where each rank waits. `SIGUSR1` dumps the stacks on
  demand (`kill -USR1 <pid>`). The thread calls `check()` every `poll_s`; `clock` (default
  `time.monotonic`) is the only time source, so a test drives both with a fake clock.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import socket
import statistics
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from models.common import distributed


class StartupTimeout(RuntimeError):
    pass


_barrier_calls: dict[str, int] = {}


def arrival_barrier(tag: str, timeout_s: float) -> None:
    """Wait until every rank reached `tag`; after `timeout_s` raise naming the missing ranks."""
    if not distributed.multi_rank() or dist.get_backend() == "fake":
        return  # one process, or a simulated world (the recipe check's fake group has no store)
    store = dist.distributed_c10d._get_default_store()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = _barrier_calls[tag] = _barrier_calls.get(tag, 0) + 1  # the same tag may be used again
    prefix = f"titan/arrival/{tag}/{n}"
    store.set(f"{prefix}/{rank}", socket.gethostname())
    keys = [f"{prefix}/{r}" for r in range(world)]
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            store.wait(keys, timedelta(seconds=min(5.0, max(deadline - time.monotonic(), 0.01))))
            return
        except (RuntimeError, dist.DistStoreError):
            if time.monotonic() >= deadline:
                break
    missing = [r for r, key in enumerate(keys) if not store.check([key])]
    if not missing:
        return
    from trainer.runtime.device import launcher_rank_of

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    nodes = sorted({launcher_rank_of(r) // max(local, 1) for r in missing})  # renumbered by the device order
    shown = ", ".join(map(str, missing[:16])) + (f" ... ({len(missing)} in all)" if len(missing) > 16 else "")
    raise StartupTimeout(
        f"start-up barrier '{tag}': ranks {shown} of {world} did not arrive within {timeout_s:.0f} s "
        f"(node ranks {', '.join(map(str, nodes[:16]))} with {local} processes per node); look at those "
        "hosts' logs (data, checkpoint or compile) or raise training.startup_timeout_s"
    )


class StepWatchdog:
    """Dumps all threads' stacks when a step runs `factor` x longer than the recent median."""

    def __init__(
        self,
        *,
        folder: str | None,
        rank: int,
        factor: float = 10.0,
        min_s: float = 60.0,
        window: int = 20,
        poll_s: float = 1.0,
        stream=None,
        clock=time.monotonic,
    ):
        self.folder, self.rank = folder, rank
        self._clock = clock
        self.factor, self.min_s, self.poll_s = factor, min_s, poll_s
        self.window = window
        self._times: list[float] = []
        self._started: float | None = None
        self._step = 0
        self._dumped_step = -1
        self._stream = stream or sys.stderr
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="titan-step-watchdog", daemon=True)
        self.dumps = 0
        try:  # on-demand dumps; only possible from the main thread
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (ValueError, AttributeError, RuntimeError):
            pass
        self._thread.start()

    def threshold(self) -> float | None:
        """Seconds after which the current step counts as hung (None before any step finished)."""
        with self._lock:
            if not self._times:
                return None
            return max(self.factor * statistics.median(self._times), self.min_s)

    def step_started(self, step: int) -> None:
        with self._lock:
            self._step, self._started = step, self._clock()

    def step_finished(self) -> None:
        with self._lock:
            if self._started is not None:
                self._times = (self._times + [self._clock() - self._started])[-self.window :]
            self._started = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def check(self) -> bool:
        """Dump the stacks if the current step has run past the threshold and was not dumped yet;
        True if it dumped. The watchdog thread calls this every `poll_s`."""
        limit = self.threshold()
        with self._lock:
            started, step = self._started, self._step
        if started is None or limit is None or step == self._dumped_step:
            return False
        elapsed = self._clock() - started
        if elapsed <= limit:
            return False
        self._dumped_step = step
        self._dump(step, elapsed, limit)
        return True

    def _dump(self, step: int, elapsed: float, limit: float) -> None:
        header = (
            f"watchdog: rank {self.rank} step {step} has run {elapsed:.0f} s (> {limit:.0f} s = "
            f"{self.factor:g} x the median recent step, at least {self.min_s:g} s); Python stacks:\n"
        )
        self._stream.write(header)
        self._stream.flush()
        faulthandler.dump_traceback(file=self._stream, all_threads=True)
        if self.folder:
            os.makedirs(self.folder, exist_ok=True)
            with open(os.path.join(self.folder, f"hang_rank{self.rank}.txt"), "a") as f:
                f.write(header)
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        self.dumps += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
