"""Preemption: SIGTERM to a torchrun job mid-run -> a checkpoint of the current step and exit;
the relaunched job resumes from it and its losses equal an uninterrupted run's, bit for bit."""

import os
import signal
import subprocess
import time

import pytest

from tests.support.trainer_runs import ENV, REPO, launch_command, read_metrics

pytestmark = pytest.mark.multiprocess

STEPS = 12
OPTIONS = {
    "training.steps": STEPS,
    "training.seq_len": 64,
    "model.n_layers": 2,
    "metrics.log_freq": 1,
    "validation.enable": "false",
    "training.mixed_precision_param": "float32",
    "metrics.enable_tensorboard": "false",
    "training.local_batch_size": 2,
    "parallelism.data_parallel_shard_degree": 2,
    "checkpoint.enable": "true",
    "checkpoint.interval": 1000,  # only the preemption save in between
}


def _args(folder, *, drop: tuple[str, ...] = ()) -> list[str]:
    """The trainer options of a run in `folder`: OPTIONS but those in `drop` (the recipe's value then)."""
    options = {**OPTIONS, "job.dump_folder": folder}
    return ["--config", "configs/llama3_debug.toml", *(f"--{k}={v}" for k, v in options.items() if k not in drop)]


def _steps_logged(folder) -> int:
    path = os.path.join(folder, "metrics.jsonl")
    return sum(1 for _ in open(path)) if os.path.exists(path) else 0


def test_sigterm_checkpoints_and_the_relaunch_resumes_exactly(tmp_path):
    want = read_metrics(_run(tmp_path / "uninterrupted"))
    folder = tmp_path / "preempted"
    cmd = launch_command(2, _args(folder))
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while _steps_logged(folder) < 4 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be preempted"
    proc.send_signal(signal.SIGTERM)  # to torchrun, which forwards it to both workers
    log = proc.communicate(timeout=120)[0]
    assert "preempted (SIGTERM): checkpoint of step" in log, log[-3000:]
    saved = sorted(int(d.split("-")[1]) for d in os.listdir(folder / "checkpoints") if d.startswith("step-"))
    assert len(saved) == 1 and 4 <= saved[0] < STEPS, saved
    # The relaunch (the same command) resumes from the preemption checkpoint.
    _run(folder)
    got = read_metrics(folder)
    assert sorted(got) == list(range(1, STEPS + 1))
    assert [got[s]["loss"] for s in got] == [want[s]["loss"] for s in want]  # bit for bit


def test_preempted_single_process_exits_75(tmp_path):
    # one process, so the recipe's data-parallel degree (-1: all ranks, here 1)
    cmd = launch_command(1, _args(tmp_path, drop=("parallelism.data_parallel_shard_degree",)))
    proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while _steps_logged(tmp_path) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("preempted (SIGTERM): checkpoint of step")


def _run(folder):
    proc = subprocess.run(
        launch_command(2, _args(folder)), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return folder
