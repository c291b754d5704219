"""Exit codes an orchestrator can act on, through `python -m trainer.launch` (docs/launch.md).

torchrun exits 1 whatever its workers did; the launcher reads the codes the workers record
(trainer/runtime/exit_status.py) and exits 75 only when every worker of its node was preempted.
- the mapping itself, case by case (`launcher_exit_code`), and the record/read round trip;
- SIGTERM to the launcher of a 2-process CPU job: passed to torchrun, then to both workers; they
  finish the step, save it, exit 75; the launcher exits 75 with no traceback;
- SIGTERM to one rank of a 2-process job: that rank's flag reaches the other at the next step
  (the preemption all-reduce), so both save the same step and exit 75; nobody hangs;
- bad input on every rank exits 2 through the launcher, a crash exits non-zero and never 75.
The trainings use the 1-layer debug model at seq_len 32; each test takes seconds on 2 cores.
"""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from tests.support.trainer_runs import ENV, REPO
from trainer.runtime.exit_status import launcher_exit_code, read_exit_statuses, record_exit_status


@pytest.mark.parametrize(
    "torchrun, workers, want",
    [
        (0, {0: 0, 1: 0}, 0),
        (1, {0: 75, 1: 75}, 75),  # preempted: every worker saved and exited 75
        (1, {0: 2, 1: 2}, 2),  # bad input on every rank
        (1, {1: 2}, 2),  # bad input; torchrun killed rank 0 before it said so
        (1, {0: 2, 1: 1}, 1),
        (1, {0: 75}, 1),  # one worker recorded nothing (killed): not a preemption
        (1, {0: 75, 1: 1}, 1),  # one crashed while the other was preempted
        (1, {0: 75, 1: 0}, 1),
        (1, {}, 1),  # torchrun failed before any worker ended
        (-15, {}, 143),  # torchrun killed by SIGTERM before its workers started
        (-9, {0: 75, 1: 75}, 75),  # torchrun killed after its workers saved
        (75, {}, 1),  # never 75 unless the workers said so
    ],
)
def test_launcher_exit_code(torchrun, workers, want):
    assert launcher_exit_code(torchrun, workers, 2) == want


def test_exit_status_round_trip(tmp_path):
    for rank, code in ((0, 75), (1, 2)):
        record_exit_status(code, env={"TITAN_EXIT_STATUS_DIR": str(tmp_path), "LOCAL_RANK": str(rank)})
    record_exit_status(1, env={"LOCAL_RANK": "3"})  # no folder (not under the launcher): nothing written
    (tmp_path / "local5.exit").write_text("garbage")
    assert read_exit_statuses(str(tmp_path)) == {0: 75, 1: 2}
    assert sorted(os.listdir(tmp_path)) == ["local0.exit", "local1.exit", "local5.exit"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(folder, *extra: str, steps: int = 10_000) -> subprocess.Popen:
    """A 2-process CPU job through the launcher; long enough that only a signal ends it."""
    args = [
        "--config",
        "configs/llama3_debug.toml",
        f"--training.steps={steps}",
        "--training.seq_len=32",
        "--model.n_layers=1",
        "--model.attn_backend=sdpa",
        "--metrics.log_freq=1",
        "--validation.enable=false",
        "--metrics.enable_tensorboard=false",
        "--training.local_batch_size=1",
        "--parallelism.data_parallel_shard_degree=2",
        "--checkpoint.enable=true",
        "--checkpoint.interval=100000",
        f"--job.dump_folder={folder}",
        *extra,
    ]
    env = {k: v for k, v in ENV.items() if not k.startswith(("TPU_", "SLURM_", "MASTER_", "RANK", "WORLD_SIZE"))}
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--platform",
        "manual",
        "--device",
        "cpu",
        "--nnodes",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "--nproc-per-node",
        "2",
        "--",
        *args,
    ]
    os.makedirs(folder.parent / "logs", exist_ok=True)
    log = open(folder.parent / "logs" / f"{folder.name}.txt", "w+")  # a file: a full pipe would stall the job
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    proc.log = log
    return proc


def _finish(proc, timeout: float = 120) -> str:
    """Wait for the launcher (killing it and its job on timeout); its output."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in [w for t in _children(proc.pid) for w in _children(t)] + _children(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()
    proc.log.seek(0)
    return proc.log.read()


def _wait_for_steps(proc, folder, n: int) -> None:
    path = os.path.join(folder, "metrics.jsonl")
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if os.path.exists(path) and sum(1 for _ in open(path)) >= n:
            return
        time.sleep(0.2)
    out = _finish(proc, timeout=0.1)
    raise AssertionError(f"no {n} steps logged (exit {proc.poll()}):\n{out[-3000:]}")


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _worker_pid(launcher: int, rank: int) -> int:
    """The pid of worker `rank`: launcher -> torchrun (its child) -> workers (torchrun's children)."""
    for torchrun in _children(launcher):
        for worker in _children(torchrun):
            with open(f"/proc/{worker}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return worker
    raise AssertionError(f"no worker of rank {rank} under launcher {launcher}")


def _saved_steps(folder) -> list[int]:
    ckpt = os.path.join(folder, "checkpoints")
    return (
        sorted(int(d.split("-")[1]) for d in os.listdir(ckpt) if d.startswith("step-")) if os.path.isdir(ckpt) else []
    )


def _assert_preempted(proc, folder, err: str) -> None:
    assert proc.returncode == 75, err[-3000:]
    assert err.count("preempted (SIGTERM): checkpoint of step") == 2, err[-3000:]  # both ranks
    assert "launch: preempted: all 2 workers of this node exited 75" in err
    assert "Traceback" not in err, err[-3000:]
    saved = _saved_steps(folder)
    assert len(saved) == 1 and saved[0] >= 2, saved


@pytest.mark.multiprocess
def test_sigterm_to_the_launcher_saves_and_exits_75(tmp_path):
    folder = tmp_path / "run"
    proc = _launch(folder)
    _wait_for_steps(proc, folder, 2)
    proc.send_signal(signal.SIGTERM)
    err = _finish(proc)
    _assert_preempted(proc, folder, err)
    assert "launch: torchrun got SIGTERM and stopped its workers" in err


@pytest.mark.multiprocess
def test_sigterm_to_one_rank_stops_both_at_the_same_step(tmp_path):
    """Rank 1 alone gets SIGTERM; rank 0 learns it at the end of that step (the flag's maximum
    over ranks), so both save the same step and exit 75: the other rank does not hang."""
    folder = tmp_path / "run"
    proc = _launch(folder)
    _wait_for_steps(proc, folder, 2)
    os.kill(_worker_pid(proc.pid, 1), signal.SIGTERM)
    err = _finish(proc)
    _assert_preempted(proc, folder, err)


@pytest.mark.multiprocess
def test_bad_input_exits_2_and_a_crash_never_75(tmp_path):
    bad = _launch(tmp_path / "bad", "--training.no_such_key=1")
    err = _finish(bad)
    assert bad.returncode == 2, err[-3000:]
    assert "error: unknown key training.no_such_key" in err
    # A crash: rank 1 killed outright (SIGKILL: no save, no recorded code) while rank 0 trains.
    folder = tmp_path / "crash"
    crash = _launch(folder)
    _wait_for_steps(crash, folder, 2)
    os.kill(_worker_pid(crash.pid, 1), signal.SIGKILL)
    err = _finish(crash)
    assert crash.returncode not in (0, 75), err[-3000:]
    assert "launch: failed: worker exit codes" in err
