"""Start-up barrier and step watchdog (trainer/runtime/watchdog.py).

No test here sleeps or bounds a duration: the watchdog's decisions are driven by a fake clock
(`StepWatchdog(clock=...)`, the test calls `check()` as the thread would), the one real-thread
test only waits for an event the fake clock made due, and the barrier test orders its late
ranks after the others' timeout with store keys, not with a sleep.
"""

import subprocess
import sys
import textwrap
import time

import pytest

from tests.support.trainer_runs import ENV, REPO
from trainer.runtime.watchdog import StepWatchdog

IDLE = 3600.0  # poll_s of a watchdog whose thread must not act during the test: only check() does


class FakeClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def _steps(dog: StepWatchdog, clock: FakeClock, seconds: list[float], first: int = 1) -> None:
    for step, s in enumerate(seconds, start=first):
        dog.step_started(step)
        clock.advance(s)
        dog.step_finished()


def test_watchdog_dumps_stacks_of_a_step_far_slower_than_the_median(tmp_path):
    out = open(tmp_path / "stderr.txt", "w+")  # faulthandler writes to a real file descriptor
    clock = FakeClock()
    dog = StepWatchdog(folder=str(tmp_path), rank=3, factor=5.0, min_s=1.0, poll_s=IDLE, stream=out, clock=clock)
    try:
        assert dog.threshold() is None and not dog.check()  # no step finished yet: no median
        _steps(dog, clock, [0.01, 0.01, 0.01])  # three quick steps set the median
        assert dog.threshold() == pytest.approx(1.0)  # 5 x median = 0.05 < min_s
        dog.step_started(4)
        clock.advance(0.3)
        assert not dog.check() and dog.dumps == 0  # well under the threshold: nothing yet
        clock.advance(0.7)
        assert not dog.check()  # exactly at the threshold: not past it
        clock.advance(0.5)
        assert dog.check() and dog.dumps == 1  # 1.5 s > 1.0 s
        clock.advance(100.0)
        assert not dog.check() and dog.dumps == 1  # once per step, however long it hangs
        dog.step_finished()
        assert not dog.check()  # between steps: nothing runs
        _steps(dog, clock, [0.01], first=5)  # a normal step afterwards: no new dump
        assert not dog.check() and dog.dumps == 1
        dog.step_started(6)  # a later hang dumps again
        clock.advance(2.0)
        assert dog.check() and dog.dumps == 2
    finally:
        dog.close()
    text = (tmp_path / "hang_rank3.txt").read_text()
    assert "watchdog: rank 3 step 4 has run 2 s (> 1 s = 5 x the median recent step, at least 1 s)" in text
    assert "watchdog: rank 3 step 6 has run" in text
    assert "test_watchdog_dumps_stacks" in text  # this test's frame: the stacks are the process's
    out.seek(0)
    assert "watchdog: rank 3 step 4" in out.read()


def test_threshold_is_factor_times_the_median_of_the_recent_window():
    clock = FakeClock()
    dog = StepWatchdog(folder=None, rank=0, factor=10.0, min_s=1.0, window=3, poll_s=IDLE, clock=clock)
    try:
        _steps(dog, clock, [0.5, 2.0, 0.25])
        assert dog.threshold() == pytest.approx(10 * 0.5)  # the median, not the mean (0.92) or the max
        _steps(dog, clock, [4.0, 4.0], first=4)  # the window keeps the last 3: 0.25, 4, 4
        assert dog.threshold() == pytest.approx(10 * 4.0)
        dog.step_started(6)
        clock.advance(39.0)
        assert not dog.check()  # would have tripped against the first steps' median
    finally:
        dog.close()


def test_the_watchdog_thread_runs_the_check(tmp_path):
    """The real thread, on the fake clock: once the clock says the step is overdue, the thread's
    next poll dumps. Nothing bounds how soon: the wait ends on the dump (the 120 s cap only
    decides how long a watchdog that never dumps takes to fail)."""
    out = open(tmp_path / "stderr.txt", "w+")
    clock = FakeClock()
    dog = StepWatchdog(folder=str(tmp_path), rank=0, factor=5.0, min_s=1.0, poll_s=0.01, stream=out, clock=clock)
    try:
        _steps(dog, clock, [0.1])
        dog.step_started(2)
        clock.advance(10.0)
        cap = time.monotonic() + 120
        while dog.dumps == 0 and time.monotonic() < cap:
            time.sleep(0.01)
        assert dog.dumps == 1
    finally:
        dog.close()
    assert not dog._thread.is_alive()
    text = (tmp_path / "hang_rank0.txt").read_text()
    assert "watchdog: rank 0 step 2 has run 10 s" in text
    assert "test_the_watchdog_thread_runs_the_check" in text  # the main thread's stack, dumped by the watchdog's


# Ranks 1 and 3 are late: they reach the barrier only after ranks 0 and 2 gave up on it, an
# order that store keys enforce (no sleep). The late ranks then pass at once, since the others'
# arrival keys are still in the store. Every rank waits for all to finish before it exits.
BARRIER = textwrap.dedent("""
    import os, sys
    from datetime import timedelta
    import torch.distributed as dist
    from trainer.runtime.watchdog import arrival_barrier, StartupTimeout
    from trainer.runtime.device import cpu_backend
    dist.init_process_group(cpu_backend())
    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.distributed_c10d._get_default_store()
    wait = timedelta(seconds=120)
    arrival_barrier("ok", timeout_s=60)          # everyone arrives
    if rank in (1, 3):
        store.wait(["test/gave_up/0", "test/gave_up/2"], wait)
    try:
        arrival_barrier("before-compile", timeout_s=1)
        print(f"rank {rank}: passed")
    except StartupTimeout as e:
        print(f"rank {rank}: {e}")
    sys.stdout.flush()
    store.set(f"test/gave_up/{rank}", "1")
    store.wait([f"test/gave_up/{r}" for r in range(world)], wait)
    os._exit(0)
""")


@pytest.mark.multiprocess
def test_arrival_barrier_names_the_ranks_that_did_not_arrive(tmp_path):
    script = tmp_path / "barrier.py"
    script.write_text(BARRIER)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(script)],
        cwd=REPO,
        env={**ENV, "PYTHONPATH": REPO},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout
    for rank in (0, 2):
        assert f"rank {rank}: start-up barrier 'before-compile': ranks 1, 3 of 4 did not arrive within 1 s" in out, (
            out + proc.stderr[-2000:]
        )
    for rank in (1, 3):
        assert f"rank {rank}: passed" in out, out + proc.stderr[-2000:]
