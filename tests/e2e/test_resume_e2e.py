"""Checkpoints across meshes and torchrun fault tolerance, end to end through `trainer.train`.

- A checkpoint written by 4 ranks (dp_shard=4) resumes on dp_shard=2 x tp=2 and on 1 process,
  and steps 4..6 follow the uninterrupted run (fp32; summation order only: asserted < 1e-5).
- `torchrun --max-restarts=1`: SIGKILL one worker mid-run; the job restarts from the newest
  checkpoint and ends with the uninterrupted run's final loss. Linux only: the worker is found
  through /proc.
"""

import os
import re
import shutil
import signal
import subprocess
import time

import pytest

from tests.conftest import linux_only
from tests.support.trainer_runs import ENV, GLOBAL_BATCH, REPO, launch_command, read_metrics, run

pytestmark = pytest.mark.multiprocess

COMMON = [
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=64",
    "--model.n_layers=2",
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=true",
    "--checkpoint.keep_latest_k=0",
]


def command(folder, nproc, *, dp_shard=None, tp=1, steps, interval, extra_launcher=()):
    dp = nproc // tp
    args = [
        *COMMON,
        f"--job.dump_folder={folder}",
        f"--training.steps={steps}",
        f"--checkpoint.interval={interval}",
        f"--training.local_batch_size={GLOBAL_BATCH // dp}",
        f"--parallelism.data_parallel_shard_degree={dp_shard or dp}",
        f"--parallelism.tensor_parallel_degree={tp}",
    ]
    return launch_command(nproc, args, extra_launcher)


def losses(folder):
    """Loss by step, the last record of a step winning (a restarted run redoes some)."""
    return {step: record["loss"] for step, record in read_metrics(folder).items()}


def test_checkpoint_from_one_mesh_resumes_on_others(tmp_path):
    full = tmp_path / "dp4"
    run(command(full, 4, steps=6, interval=3))
    want = losses(full)
    for name, nproc, tp in [("dp2_tp2", 4, 2), ("single", 1, 1)]:
        folder = tmp_path / name
        shutil.copytree(full / "checkpoints" / "step-3", folder / "checkpoints" / "step-3")
        run(command(folder, nproc, tp=tp, steps=6, interval=3))
        got = losses(folder)
        assert sorted(got) == [4, 5, 6], name
        worst = max(abs(got[s] - want[s]) / want[s] for s in (4, 5, 6))
        print(f"{name}: max relative loss difference vs dp_shard=4 {worst:.2e}")
        assert worst < 1e-5, name


def _worker_pids(parent: int) -> list[int]:
    """The trainer processes whose parent is `parent` (torchrun's agent), from /proc."""
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == parent and b"trainer.train" in cmdline:
            pids.append(int(pid))
    return pids


@linux_only
def test_torchrun_restarts_from_newest_checkpoint_after_a_killed_worker(tmp_path):
    steps = 40
    ref = tmp_path / "ref"
    run(command(ref, 2, steps=steps, interval=4))
    folder = tmp_path / "killed"
    log = open(tmp_path / "torchrun.log", "w+")
    proc = subprocess.Popen(
        command(folder, 2, steps=steps, interval=4, extra_launcher=("--max-restarts=1",)),
        cwd=REPO,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )
    killed = None
    deadline = time.time() + 300
    while killed is None and proc.poll() is None and time.time() < deadline:
        if (folder / "checkpoints" / "step-8").is_dir():
            workers = _worker_pids(proc.pid)
            if workers:
                killed = workers[-1]
                os.kill(killed, signal.SIGKILL)
                break
        time.sleep(0.05)
    proc.wait(timeout=600)
    log.seek(0)
    out = log.read()
    assert killed is not None, "the run ended before a worker could be killed:\n" + out[-2000:]
    assert proc.returncode == 0, out[-3000:]
    got, want = losses(folder), losses(ref)
    assert max(got) == steps
    assert got[steps] == pytest.approx(want[steps], rel=1e-6)
    # The restart really resumed from a checkpoint: each start-up banner (trainer/train.py,
    # "...; steps FIRST..LAST") names the first step it runs.
    starts = [int(m) for m in re.findall(rf"; steps (\d+)\.\.{steps}\b", out)]
    assert starts[0] == 1 and len(starts) == 2 and starts[1] > 1, starts
