"""Where a CPU training run's cores go: CPU time per thread of each trainer process, per step.

    python scripts/bench/cpu_split.py [--from-step 10] [--to-step 40] -- COMMAND ...

Runs COMMAND (a `python -m trainer.train` or `torchrun ... -m trainer.train` line), reads the
step counter from its output, and between the two steps samples every thread of COMMAND's
process and its descendants, torchrun's launcher left out (utime + stime from /proc). It prints the
CPU milliseconds per step of each thread that used 5 or more (a process's main thread
computes; `pt_gloo_runloop` runs gloo's collectives, `gloo_tcp_loop` moves their bytes), the
idle milliseconds per step (wall x cores - all CPU time), and the machine's /proc/stat shares
over the window (steal: time the hypervisor gave to others).
Linux only. docs/benchmarks.md, "FSDP: 2 processes against 1", uses it. The readers take the
/proc root as an argument (`proc=`), so tests run them on fixture files.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time

from trainer.runtime import cli

TICK = os.sysconf("SC_CLK_TCK")
STEP = re.compile(r"step\s+(\d+)/")


def _stat_fields(path: str) -> tuple[str, list[str]] | None:
    """(name, the fields after it) of a /proc .../stat file; None if the process is gone."""
    try:
        stat = open(path).read()
    except FileNotFoundError:
        return None
    return stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2 :].split()


def trainer_pids(root: int, proc: str = "/proc") -> list[int]:
    """The training processes: `root` and its descendants, but for torchrun's launcher."""
    parent = {}
    for entry in os.listdir(proc):
        stat = _stat_fields(f"{proc}/{entry}/stat") if entry.isdigit() else None
        if stat is not None:
            parent[int(entry)] = int(stat[1][1])
    pids = []
    for pid in parent:
        node = pid
        while node > 1 and node != root:
            node = parent.get(node, 0)
        if node != root:
            continue
        try:
            argv = open(f"{proc}/{pid}/cmdline", "rb").read().split(b"\0")
        except FileNotFoundError:
            continue
        if not any(a.endswith(b"torchrun") or a == b"torch.distributed.run" for a in argv):
            pids.append(pid)
    return pids


def thread_cpu(root: int, proc: str = "/proc") -> dict[tuple[int, int], tuple[str, float]]:
    """(pid, tid) -> (thread name, CPU seconds so far) for every training process under `root`."""
    found = {}
    for pid in trainer_pids(root, proc):
        try:
            tids = os.listdir(f"{proc}/{pid}/task")
        except FileNotFoundError:
            continue
        for tid in tids:
            stat = _stat_fields(f"{proc}/{pid}/task/{tid}/stat")
            if stat is not None:
                name, fields = stat
                found[(pid, int(tid))] = (name, (int(fields[11]) + int(fields[12])) / TICK)  # utime + stime
    return found


def machine_ticks(proc: str = "/proc") -> list[int]:
    """The machine's CPU ticks so far: user, nice, system, idle, iowait, irq, softirq, steal."""
    with open(f"{proc}/stat") as f:
        return [int(x) for x in f.readline().split()[1:9]]


def last_step(path: str) -> int:
    steps = STEP.findall(open(path, errors="replace").read())
    return int(steps[-1]) if steps else 0


def main(argv: list[str] | None = None) -> int:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-step", type=int, default=10, help="window start (after compile and warm-up)")
    parser.add_argument("--to-step", type=int, default=40, help="window end (<= the run's steps)")
    parser.add_argument("--log", default="cpu_split.log", help="where COMMAND's output goes")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the training command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.to_step <= args.from_step:
        parser.error("give -- COMMAND, and --to-step > --from-step")
    with open(args.log, "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        while last_step(args.log) < args.from_step and proc.poll() is None:
            time.sleep(0.1)
        before, t0, k0, m0 = thread_cpu(proc.pid), time.perf_counter(), last_step(args.log), machine_ticks()
        while last_step(args.log) < args.to_step and proc.poll() is None:
            time.sleep(0.1)
        after, t1, k1, m1 = thread_cpu(proc.pid), time.perf_counter(), last_step(args.log), machine_ticks()
        rc = proc.wait()
    if rc != 0 or k1 <= k0:
        cli.error_line(
            f"the command exited with {rc} at step {k1} (window {args.from_step}..{args.to_step}); "
            f"its output is in {args.log}"
        )
        return 2
    steps, wall = k1 - k0, t1 - t0
    cores = os.cpu_count() or 1
    print(f"steps {k0}..{k1}: {1000 * wall / steps:.0f} ms wall per step, {cores} cores")
    print(f"{'pid':>8} {'thread':<18} {'CPU ms/step':>12}")
    used, pids = 0.0, {pid for pid, _ in after}
    for key in sorted(after):
        name, cpu = after[key]
        spent = cpu - before.get(key, (name, 0.0))[1]
        used += spent
        if spent * 1000 / steps >= 5:
            print(f"{key[0]:>8} {name:<18} {1000 * spent / steps:>12.0f}")
    idle = cores * wall - used
    print(
        f"all threads (those under 5 ms/step not listed): {1000 * used / steps:.0f} ms/step "
        f"({used / wall:.2f} cores) in {len(pids)} process(es); idle {1000 * idle / steps:.0f} ms/step "
        f"over the {cores} cores"
    )
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    print("/proc/stat, cores:", " ".join(f"{n} {(b - a) / TICK / wall:.2f}" for n, a, b in zip(names, m0, m1)))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
