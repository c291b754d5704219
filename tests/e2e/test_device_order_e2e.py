"""A run laid out in torch-tpu's device order is the same run, end to end through `trainer.train`.

The debug Llama 3 recipe (2 layers, seq 64, fp32) on 4 gloo processes, FSDP 4, under
`--parallelism.device_order=v6e-4` (torch-tpu's tray ring of a v6e-4: launcher ranks 2 and 3 take
places 3 and 2) against the identity order:
- the losses are equal bit for bit: the renumbered process group computes exactly what the identity
  one does, place by place (same data per place, same reduction order);
- the step-3 checkpoint converts to Hugging Face safetensors (`scripts/convert.py to-hf`, one
  process, the DCP metadata) byte for byte as the identity run's: nothing is stored permuted;
- that checkpoint resumes on dp_shard 2 x tp 2 under another (random) order and follows the
  identity run's steps 4-5 within 1e-5 (another mesh: fp32 summation order only);
- the HF export loads as `initial_load_path` under a random order and the first loss equals the
  one-process start from it within 1e-5 (a permuted load would change the loss at the first digit).
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

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
    "--checkpoint.interval=3",
]


def _train(folder, nproc: int, *args: str, tp: int = 1) -> dict[int, float]:
    dp = nproc // tp
    run(
        launch_command(
            nproc,
            [
                *COMMON,
                f"--job.dump_folder={folder}",
                f"--training.local_batch_size={GLOBAL_BATCH // dp}",
                f"--parallelism.data_parallel_shard_degree={dp}",
                f"--parallelism.tensor_parallel_degree={tp}",
                *args,
            ],
        )
    )
    return {step: record["loss"] for step, record in read_metrics(folder).items()}


def _to_hf(checkpoint, out) -> bytes:
    proc = subprocess.run(
        [
            sys.executable,
            "scripts/convert.py",
            "to-hf",
            "--checkpoint",
            str(checkpoint),
            "--model.name",
            "llama3",
            "--model.flavor",
            "debugmodel",
            "--model.n_layers=2",
            str(out),
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return (out / "model.safetensors").read_bytes()


def test_a_run_in_torch_tpus_order_is_the_identity_run(tmp_path):
    ident = _train(tmp_path / "identity", 4, "--training.steps=3", "--parallelism.device_order=identity")
    tray = _train(tmp_path / "v6e4", 4, "--training.steps=3", "--parallelism.device_order=v6e-4")
    assert [tray[s] for s in (1, 2, 3)] == [ident[s] for s in (1, 2, 3)], (tray, ident)
    hf = _to_hf(tmp_path / "v6e4" / "checkpoints" / "step-3", tmp_path / "hf_v6e4")
    assert hf == _to_hf(tmp_path / "identity" / "checkpoints" / "step-3", tmp_path / "hf_identity")


def test_a_checkpoint_and_an_hf_start_in_one_order_resume_in_another(tmp_path):
    ident = _train(tmp_path / "identity", 4, "--training.steps=5", "--parallelism.device_order=identity")
    tray = tmp_path / "v6e4"
    _train(tray, 4, "--training.steps=3", "--parallelism.device_order=v6e-4")
    resumed = tmp_path / "resumed"
    shutil.copytree(tray / "checkpoints" / "step-3", resumed / "checkpoints" / "step-3")
    got = _train(resumed, 4, "--training.steps=5", tp=2)  # a random order (launch_command)
    assert sorted(got) == [4, 5]
    worst = max(abs(got[s] - ident[s]) / ident[s] for s in (4, 5))
    print(f"resumed on dp 2 x tp 2 in another order: max relative loss difference {worst:.2e}")
    assert worst < 1e-5

    _to_hf(tray / "checkpoints" / "step-3", tmp_path / "hf")
    start = ["--training.steps=1", "--checkpoint.enable=false", f"--checkpoint.initial_load_path={tmp_path / 'hf'}"]
    start += ["--checkpoint.initial_load_format=hf"]
    one = _train(tmp_path / "hf_one", 1, *start)
    four = _train(tmp_path / "hf_four", 4, *start)
    print(f"HF start: 1 process {one[1]:.6f}, 4 in a random order {four[1]:.6f}")
    assert abs(four[1] - one[1]) / one[1] < 1e-5
