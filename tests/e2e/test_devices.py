"""The debug Llama 3 recipe on an accelerator against the CPU: from the same weights, on the
same first batch, the device's step-1 loss equals the CPU fp32 run's within a tolerance argued
below, and a few steps train to finite losses. Skipped without the device (the `cuda` and `tpu`
markers, tests/conftest.py); the CPU test at the end runs the same pipeline on every machine.

Both runs start from one checkpoint (`checkpoint.initial_load_path`): a model is initialized on
its own device, and the CPU and the accelerators draw different random numbers, so fresh runs
would not start from the same weights. The checkpoint is a 20-step CPU run's, so the loss
(~7.5) depends on the weights and the batch, unlike an untrained model's ~ln(4096). The step-1
loss is computed before any update: one forward pass of the same weights on the same tokens,
so the runs differ by rounding alone.

Measured on the CPU at these weights (2-core Xeon, OMP_NUM_THREADS=1; relative differences of
the step-1 loss on the batch of `--training.seed=45`, the one used below):
  - another summation order, fp32: 0 (2 threads; the cpu_kernel attention) and 6.4e-8 (two
    accumulated micro-batches of 2; one fp32 ulp of the loss is 6.4e-8),
  - bfloat16 compute: 9.0e-5 (on the batches of seeds 42-44: 2.5e-6, 2.5e-5, 4.1e-5),
  - another batch (seeds 42-44): 1.7e-3 to 6.0e-2; the untrained weights: > 1.8e-1.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest

from tests.support.trainer_runs import ENV, REPO, read_metrics

RECIPE = [
    "--config",
    "configs/llama3_debug.toml",
    "--model.n_layers=2",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--validation.enable=false",
    "--model.attn_backend=sdpa",
]
FP32 = "--training.mixed_precision_param=float32"
CPU_ENV = {**ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}  # torch-tpu stays unloaded in CPU runs (docs/tpu.md)
CUDA_REL = 2e-6
TPU_REL = 5e-4


def _train(folder, args, *, env=CPU_ENV, launcher=(sys.executable, "-m", "trainer.train")) -> dict[int, dict]:
    proc = subprocess.run(
        [*launcher, *RECIPE, f"--job.dump_folder={folder}", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return read_metrics(folder)


@pytest.fixture(scope="module")
def weights(tmp_path_factory) -> str:
    """The model of a 20-step CPU run (DCP), the starting point of every run below."""
    folder = tmp_path_factory.mktemp("weights")
    _train(
        folder,
        [FP32, "--device.type=cpu", "--training.steps=20", "--checkpoint.enable=true", "--checkpoint.interval=20"],
    )
    return str(folder / "checkpoints" / "step-20")


def _from(weights: str, steps: int) -> list[str]:
    """Start from `weights`, train `steps` steps on the batches of seed 45, save nothing."""
    return [
        f"--checkpoint.initial_load_path={weights}",
        f"--training.steps={steps}",
        "--checkpoint.enable=false",
        "--training.seed=45",
    ]


@pytest.fixture(scope="module")
def cpu_step1(weights, tmp_path_factory) -> float:
    """The reference: the CPU's fp32 step-1 loss from `weights`."""
    return _train(tmp_path_factory.mktemp("cpu"), [*_from(weights, 1), FP32, "--device.type=cpu"])[1]["loss"]


def _check_run(metrics: dict[int, dict], steps: int) -> None:
    assert sorted(metrics) == list(range(1, steps + 1))
    assert all(math.isfinite(metrics[s]["loss"]) for s in metrics), metrics


@pytest.mark.cuda
def test_cuda_step1_loss_matches_the_cpu_fp32_run(weights, cpu_step1, tmp_path):
    """fp32 on both devices (torch keeps TF32 off for fp32 matmuls by default): the forward
    passes differ in summation order (cuBLAS blocking and split-K, the GPU's SDPA and
    reductions) and in the last bits of the GPU's exp and rsqrt. Rounding errors scale with the
    unit roundoff: bfloat16 compute (u = 2^-8) moves this loss by 9e-5, so fp32 (u = 2^-24,
    65536x finer) moves it by ~1e-9 whatever the order, a few times that for approximate exp;
    the CPU's reorderings measured <= 6.4e-8 (one ulp of the loss). Bound: 2e-6, 30x the
    largest reordering measured. It fails a run that computes in bfloat16 (9e-5, 45x the bound)
    and, by the same scaling, one with TF32 matmuls (u = 2^-11: ~1e-5), on another batch, or
    from other weights."""
    steps = 3
    got = _train(tmp_path, [*_from(weights, steps), FP32, "--device.type=cuda"], env=ENV)
    _check_run(got, steps)
    assert got[1]["loss"] == pytest.approx(cpu_step1, rel=CUDA_REL), (got[1]["loss"], cpu_step1)


def _tpu_launch_env() -> dict[str, str]:
    """torch-tpu's launch variables (`python -m torch.tpu.distributed`, docs/tpu.md): even one
    process goes through torchrun with them."""
    env = {**ENV, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "torch.tpu.distributed"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for line in out.stdout.splitlines():
        match = re.match(r"^(?:export\s+)?([A-Z_][A-Z0-9_]*)=(.*)$", line.strip())
        if match:
            env[match.group(1)] = match.group(2).strip("'\"")
    return env


@pytest.mark.tpu
def test_tpu_step1_loss_matches_the_cpu_fp32_run(weights, cpu_step1, tmp_path):
    """fp32 asked on both devices, but XLA:TPU may run an fp32 matmul as one bf16 pass (operands
    rounded to bf16, u = 2^-8 = 3.9e-3, products summed in fp32). That is less rounding than the
    CPU's bfloat16 run (bf16 parameters and activations, every op's output rounded), which moves
    this loss by 9.0e-5, and by at most that on the three other batches measured. Bound: 5e-4,
    5.5x that. It fails a run on another batch (>= 1.7e-3 measured, 3.4x the bound) or from
    other weights (> 1.8e-1), or any numerics further off than bf16 rounding."""
    steps = 3
    launcher = (
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=1",
        "-m",
        "trainer.train",
    )
    got = _train(
        tmp_path, [*_from(weights, steps), FP32, "--device.type=tpu"], env=_tpu_launch_env(), launcher=launcher
    )
    _check_run(got, steps)
    assert got[1]["loss"] == pytest.approx(cpu_step1, rel=TPU_REL), (got[1]["loss"], cpu_step1)


def test_cpu_pipeline_meets_the_cuda_bound_under_another_summation_order(weights, cpu_step1, tmp_path):
    """The device tests' pipeline on the CPU, so it keeps working where no accelerator runs:
    the reference starts from the trained weights (its loss is far below an untrained model's
    ln(4096) = 8.3; 8.9 measured at initialization), and two accumulated micro-batches of 2
    (another summation order of the same fp32 math) give its step-1 loss within the cuda bound."""
    assert cpu_step1 < math.log(4096) - 0.5, cpu_step1
    got = _train(
        tmp_path,
        [
            *_from(weights, 1),
            FP32,
            "--device.type=cpu",
            "--training.local_batch_size=2",
            "--training.gradient_accumulation_steps=2",
        ],
    )
    assert got[1]["loss"] == pytest.approx(cpu_step1, rel=CUDA_REL), (got[1]["loss"], cpu_step1)
