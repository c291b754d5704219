"""Start-up barrier and step watchdog (trainer/watchdog.py)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.trainer_runs import ENV, REPO
from trainer.watchdog import StepWatchdog


def test_watchdog_dumps_stacks_of_a_step_far_slower_than_the_median(tmp_path):
    out = open(tmp_path / "stderr.txt", "w+")  # faulthandler writes to a real file descriptor
    dog = StepWatchdog(folder=str(tmp_path), rank=3, factor=5.0, min_s=1.0, poll_s=0.02, stream=out)
    try:
        for step in range(1, 4):  # three quick steps set the median (~0.01 s)
            dog.step_started(step)
            time.sleep(0.01)
            dog.step_finished()
        assert dog.threshold() == pytest.approx(1.0)  # 5 x median < min_s
        dog.step_started(4)
        time.sleep(0.3)
        assert dog.dumps == 0  # well under the threshold: nothing yet
        time.sleep(1.2)
        dog.step_finished()
        assert dog.dumps == 1
        dog.step_started(5)  # a normal step afterwards: no new dump
        dog.step_finished()
        time.sleep(0.1)
        assert dog.dumps == 1
    finally:
        dog.close()
    text = (tmp_path / "hang_rank3.txt").read_text()
    assert "watchdog: rank 3 step 4 has run" in text and "test_watchdog_dumps_stacks" in text  # this test's frame
    out.seek(0)
    assert "watchdog: rank 3 step 4" in out.read()


BARRIER = textwrap.dedent("""
    import os, sys, time
    import torch.distributed as dist
    from trainer.watchdog import arrival_barrier, StartupTimeout
    from trainer.device import cpu_backend
    dist.init_process_group(cpu_backend())
    rank = dist.get_rank()
    arrival_barrier("ok", timeout_s=60)          # everyone arrives
    if rank in (1, 3):
        time.sleep(8)                            # ranks 1 and 3 are late for the next one
    try:
        arrival_barrier("before-compile", timeout_s=2)
        print(f"rank {rank}: passed")
    except StartupTimeout as e:
        print(f"rank {rank}: {e}")
    sys.stdout.flush()
    os._exit(0)
""")


@pytest.mark.multiprocess
def test_arrival_barrier_names_the_ranks_that_did_not_arrive(tmp_path):
    script = tmp_path / "barrier.py"
    script.write_text(BARRIER)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
                           str(script)], cwd=REPO, env={**ENV, "PYTHONPATH": REPO}, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout
    for rank in (0, 2):
        assert (f"rank {rank}: start-up barrier 'before-compile': ranks 1, 3 of 4 did not arrive within 2 s"
                in out), out + proc.stderr[-2000:]
