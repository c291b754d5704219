"""scripts/cpu_split.py on a fake trainer: a process that burns one core and prints step lines.

The script samples the command's process tree only, so a training run in another test worker
does not show up here. A real run is in docs/benchmarks.md.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

FAKE = """
import sys, time
for step in range(1, 9):
    end = time.perf_counter() + 0.15
    while time.perf_counter() < end:
        pass
    print(f"step {step}/8  loss 1.0", flush=True)
sys.exit(int(sys.argv[1]))
"""


def _split(tmp_path, rc: int, *window: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "cpu_split.py"), *window, "--log", str(tmp_path / "run.log"),
         "--", sys.executable, "-c", FAKE, str(rc)],
        capture_output=True, text=True, timeout=120)


def test_a_busy_main_thread_shows_as_its_cpu_per_step(tmp_path):
    r = _split(tmp_path, 0, "--from-step", "2", "--to-step", "6")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    wall = float(lines[0].split(": ")[1].split(" ms")[0])
    assert 100 < wall < 2000, lines[0]  # 150 ms of spinning per step, plus scheduling
    threads = [line.split() for line in lines[2:] if line.split()[0].isdigit()]
    assert len(threads) == 1, r.stdout  # one process, one thread that used CPU
    cpu = float(threads[0][-1])
    # the spinning thread is the only work: its CPU per step is the wall time, less what the
    # other test worker (xdist) took from it on a 2-core machine (at most half: 0.3 leaves room
    # for the scheduler); over it by at most /proc's 10 ms tick at each of the two readings of a
    # window of >= 3 steps of >= 150 ms, i.e. 20 / 450 < 5 %
    assert 0.3 * wall <= cpu <= 1.05 * wall, r.stdout
    assert "steal" in lines[-1]


def test_a_failed_run_is_one_error_line(tmp_path):
    r = _split(tmp_path, 3, "--from-step", "2", "--to-step", "20")  # the fake stops at step 8
    assert r.returncode == 2
    assert r.stderr.startswith("error: the command exited with 3 at step 8"), r.stderr
    assert "Traceback" not in r.stderr
