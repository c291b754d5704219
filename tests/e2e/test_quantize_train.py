"""`[quantize]` through `trainer.train` as users run it: the recipe's keys reach the model, and a
recipe a device does not run is refused with one error line (docs/low_precision.md)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.trainer_runs import ENV, REPO, launch_command, read_metrics, run

SHORT = (
    "--config",
    "configs/llama3_debug.toml",
    "--training.seq_len=64",
    "--training.local_batch_size=4",
    "--model.n_layers=2",
    "--metrics.log_freq=1",
    "--validation.enable=false",
    "--metrics.enable_tensorboard=false",
    "--checkpoint.enable=false",
    "--training.steps=3",
)


def test_a_quantized_run_trains_close_to_bf16(tmp_path):
    """3 steps of the debug recipe (2 layers), bf16 and float8_rowwise on the same tokens: every
    block linear quantized (min_dim 0), so the first loss differs from bf16's, by less than the
    forward's quantization error can move it (the step-1 gap of the 200-step runs is 0.02 %)."""
    losses = {}
    for recipe in ("none", "float8_rowwise"):
        folder = tmp_path / recipe
        run(
            launch_command(
                1, [*SHORT, f"--job.dump_folder={folder}", f"--quantize.recipe={recipe}", "--quantize.min_dim=0"]
            )
        )
        losses[recipe] = [r["loss"] for _, r in sorted(read_metrics(folder).items())]
    bf16, fp8 = losses["none"], losses["float8_rowwise"]
    assert len(fp8) == 3 and all(v == v for v in fp8)
    assert bf16[0] != fp8[0], "the recipe did not reach the model"
    assert abs(fp8[0] - bf16[0]) < 1e-2 * bf16[0]
    assert fp8[-1] < fp8[0]


def test_an_unknown_recipe_is_one_error_line():
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.train", *SHORT, "--quantize.recipe=fp4", "--job.dump_folder=/nonexistent/x"],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: quantize.recipe") and "float8_rowwise" in lines[-1], proc.stderr[-2000:]


def test_a_recipe_that_quantizes_nothing_is_one_error_line(tmp_path):
    """float8_rowwise on the debug recipe at the default min_dim (1024, above every width) would
    quantize no linear: refused before anything is built, one line naming quantize.min_dim."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.train",
            *SHORT,
            "--quantize.recipe=float8_rowwise",
            f"--job.dump_folder={tmp_path}",
        ],
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: quantize.min_dim: 1024 leaves none"), proc.stderr[-2000:]
    assert "quantize.recipe = none" in lines[0] and "Traceback" not in proc.stderr
