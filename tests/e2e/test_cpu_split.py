"""scripts/bench/cpu_split.py: its /proc readers on fixture files, then once on a real fake trainer.

The readers take the /proc root as an argument, so the process-tree walk (torchrun's launcher
left out, other runs on the machine ignored, vanished processes skipped), the stat parsing
(thread names with spaces and parentheses) and the CPU-time arithmetic are checked on files
written here, with exact expected values. The real run checks the same code against the
kernel's /proc, with a bound on CPU *time* only (see its docstring): no wall-clock bound.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import linux_only

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("cpu_split", ROOT / "scripts" / "bench" / "cpu_split.py")
cpu_split = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cpu_split)

TORCHRUN = [
    b"/venv/bin/python",
    b"-m",
    b"torch.distributed.run",
    b"--standalone",
    b"--nproc_per_node=2",
    b"-m",
    b"trainer.train",
]
TRAINER = [b"/venv/bin/python", b"-m", b"trainer.train", b"--config", b"x.toml"]


def _stat(pid: int, name: str, ppid: int, utime: int = 0, stime: int = 0) -> str:
    """A /proc/<pid>/stat line (proc(5)): pid (comm) state ppid ..., utime and stime fields 14, 15."""
    return (
        f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1 4194304 99 0 0 0 {utime} {stime} 0 0 20 0 1 0 117611 3133440 406\n"
    )


def _process(proc: Path, pid: int, ppid: int, argv: list[bytes] | None, threads: dict[int, tuple[str, int, int]]):
    """/proc/<pid>/{stat,cmdline,task/<tid>/stat}; `argv` None: cmdline gone (the process exited)."""
    folder = proc / str(pid)
    name = next(iter(threads.values()))[0] if threads else "python"
    (folder / "task").mkdir(parents=True)
    (folder / "stat").write_text(_stat(pid, name, ppid))
    if argv is not None:
        (folder / "cmdline").write_bytes(b"\0".join(argv) + b"\0")
    for tid, (thread, utime, stime) in threads.items():
        (folder / "task" / str(tid)).mkdir()
        (folder / "task" / str(tid) / "stat").write_text(_stat(tid, thread, ppid, utime, stime))


def _fake_proc(tmp_path: Path) -> Path:
    """A machine with a torchrun job (launcher 100, workers 101 and 102, a compile worker 103
    under 101), another job's processes (200, 201), a process gone after its stat was listed
    (104), a pid folder without a stat file (300), and /proc/stat."""
    proc = tmp_path / "proc"
    _process(proc, 1, 0, [b"/sbin/init"], {1: ("systemd", 5, 5)})
    _process(proc, 50, 1, [b"bash"], {50: ("bash", 1, 1)})
    _process(proc, 100, 50, TORCHRUN, {100: ("python", 700, 30)})
    _process(
        proc,
        101,
        100,
        TRAINER,
        {101: ("python", 1234, 56), 105: ("pt_gloo_runloop", 300, 200), 106: ("gloo) (x", 7, 0), 107: ("gone", 1, 1)},
    )
    (proc / "101" / "task" / "107" / "stat").unlink()  # a thread that exited between listdir and read
    _process(proc, 102, 100, TRAINER, {102: ("python", 1000, 0)})
    _process(proc, 103, 101, [b"/venv/bin/python", b"-c", b"compile_worker()"], {103: ("python", 40, 2)})
    _process(proc, 104, 101, None, {104: ("python", 9, 9)})
    _process(proc, 200, 1, TRAINER, {200: ("python", 5000, 5000)})  # another test worker's run
    _process(proc, 201, 200, TRAINER, {201: ("python", 5000, 5000)})
    (proc / "300").mkdir()
    (proc / "self").mkdir()
    (proc / "stat").write_text(
        "cpu  92377 0 17243 122676 912 0 240 1184 0 0\ncpu0 38736 0 7564 69826 480 0 17 604 0 0\n"
    )
    return proc


def test_trainer_pids_is_the_job_without_its_launcher(tmp_path):
    proc = _fake_proc(tmp_path)
    assert sorted(cpu_split.trainer_pids(100, str(proc))) == [101, 102, 103]  # not 100, 104, 200, 201
    assert sorted(cpu_split.trainer_pids(101, str(proc))) == [101, 103]  # a single-process run: itself too
    assert cpu_split.trainer_pids(999, str(proc)) == []
    # the launcher as its console script (argv[1] = .../torchrun) is left out as well
    _process(
        proc, 400, 1, [b"/venv/bin/python", b"/venv/bin/torchrun", b"-m", b"trainer.train"], {400: ("pt_elastic", 1, 1)}
    )
    _process(proc, 401, 400, TRAINER, {401: ("python", 1, 1)})
    assert cpu_split.trainer_pids(400, str(proc)) == [401]


def test_thread_cpu_reads_utime_plus_stime_of_every_thread(tmp_path):
    proc = _fake_proc(tmp_path)
    tick = cpu_split.TICK
    assert cpu_split.thread_cpu(100, str(proc)) == {
        (101, 101): ("python", 1290 / tick),
        (101, 105): ("pt_gloo_runloop", 500 / tick),
        (101, 106): ("gloo) (x", 7 / tick),  # the name runs to the last ')'
        (102, 102): ("python", 1000 / tick),
        (103, 103): ("python", 42 / tick),
    }


def test_machine_ticks_and_last_step_on_fixture_text(tmp_path):
    proc = _fake_proc(tmp_path)
    assert cpu_split.machine_ticks(str(proc)) == [92377, 0, 17243, 122676, 912, 0, 240, 1184]  # steal last
    log = tmp_path / "run.log"
    log.write_text("")
    assert cpu_split.last_step(str(log)) == 0
    log.write_text("training: steps 1..40\nstep 3/40  loss 8.1\nwarning: x\nstep  12/40  loss 7.0\nstep 13")
    assert cpu_split.last_step(str(log)) == 12  # "steps 1..40" and a line cut mid-write do not count


# The fake trainer: one thread; every step spins for SPIN seconds of its own CPU time (not wall
# time, so a loaded machine slows it down without changing the CPU it uses), then prints.
FAKE = """
import sys, time
spin = float(sys.argv[2])
for step in range(1, 9):
    end = time.thread_time() + spin
    while time.thread_time() < end:
        pass
    print(f"step {step}/8  loss 1.0", flush=True)
sys.exit(int(sys.argv[1]))
"""


def _split(tmp_path, rc: int, spin: float, *window: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "bench" / "cpu_split.py"),
            *window,
            "--log",
            str(tmp_path / "run.log"),
            "--",
            sys.executable,
            "-c",
            FAKE,
            str(rc),
            str(spin),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@linux_only
def test_a_busy_main_thread_shows_as_its_cpu_per_step(tmp_path):
    """The real /proc, the fake trainer spinning S = 100 ms of CPU per step, window 2..5.

    The bound holds on any load, from the order of events alone. The script reads the threads'
    CPU at A, then the step counter k0; later it sees step >= to (5), reads CPU at B, then k1.
    Step j's spin runs between the prints of steps j-1 and j. Every spin from step k0 + 2 to
    step 5 lies inside [A, B] (print k0 + 1 came after the k0 read, print 5 before B), and no
    spin other than those of steps 3 .. k1 + 1 can overlap it (print 2 came before A, print k1
    before the k1 read). /proc counts CPU in ticks (1/TICK s, truncated), so a difference of two
    readings is off by less than one tick. Per step of the n = k1 - k0 reported:
        (max(0, 5 - k0 - 1) S - tick) / n  <=  CPU ms/step  <=  ((k1 - 1) (S + e) + tick) / n
    with e = 5 ms for each step's print and loop overhead (microseconds in fact), and 0.5 ms
    for the printed rounding.
    """
    spin, first, last = 0.1, 2, 5
    r = _split(tmp_path, 0, spin, "--from-step", str(first), "--to-step", str(last))
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    k0, k1 = map(int, re.match(r"steps (\d+)\.\.(\d+): ", lines[0]).groups())
    assert first <= k0 < k1 and last <= k1 <= 8, lines[0]
    threads = [line.split() for line in lines[2:] if line.split()[0].isdigit()]
    assert len(threads) == 1, r.stdout  # one process, one thread that used CPU
    cpu_ms = float(threads[0][-1])
    n, tick_ms, s_ms = k1 - k0, 1000 / cpu_split.TICK, 1000 * spin
    low = (max(0, last - k0 - 1) * s_ms - tick_ms) / n - 0.5
    high = ((k1 + 1 - first) * (s_ms + 5) + tick_ms) / n + 0.5
    assert low <= cpu_ms <= high, (low, cpu_ms, high, r.stdout)
    assert lines[-1].startswith("/proc/stat, cores: user") and "steal" in lines[-1]


@linux_only
def test_a_failed_run_is_one_error_line(tmp_path):
    r = _split(tmp_path, 3, 0.0, "--from-step", "2", "--to-step", "20")  # the fake stops at step 8
    assert r.returncode == 2
    assert r.stderr.startswith("error: the command exited with 3 at step 8"), r.stderr
    assert "Traceback" not in r.stderr
