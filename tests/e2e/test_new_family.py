"""A model family that lives outside `models/` trains under every parallelism and in graph mode.

`tests/support/toy_family.py` defines it against `models/contract.py` only; the trainer is pointed at it
with `--model.name=tests.support.toy_family:TOY` and nothing in `trainer/` or `parallelisms/` knows it.
Each run is `trainer.train` as users launch it (torchrun for 2 ranks), fp32, 2 layers, seq 64,
the same global batch of 4 sequences, 6 steps. Bound on the losses against the 1-process eager
run: 1e-5 relative, as in test_parallel_e2e.py: every variant computes the same fp32 math in a
different summation order (sharded reductions, another op order in the captured graph), which
moves a loss by a few ulps (~1e-7 relative) per step; 1e-5 leaves two orders of margin and still
fails on any real difference (a wrong shard, a missing gradient reduction: >= 1e-3).
"""

import pytest

from tests.support.trainer_runs import assert_losses_close, train_losses

STEPS = 6
COMMON = [
    "--config",
    "configs/llama3_debug.toml",
    "--model.name=tests.support.toy_family:TOY",
    "--model.flavor=debugmodel",
    f"--training.steps={STEPS}",
    "--training.seq_len=64",
    "--metrics.log_freq=1",
    "--checkpoint.enable=false",
    "--validation.enable=false",
    "--training.mixed_precision_param=float32",
    "--metrics.enable_tensorboard=false",
    "--lr_scheduler.warmup_steps=2",
]


def _losses(folder, nproc: int, degrees: dict, *extra: str) -> list[float]:
    return train_losses(folder, nproc, degrees, STEPS, *COMMON, *extra)


@pytest.fixture(scope="module")
def eager_losses(tmp_path_factory):
    losses = _losses(tmp_path_factory.mktemp("eager"), 1, {})
    assert losses[-1] < losses[0]  # it learns
    return losses


@pytest.mark.multiprocess
@pytest.mark.parametrize("degrees", [dict(dp_shard=2), dict(tp=2)], ids=["fsdp2", "tp2"])
def test_new_family_parallel_matches_single_process(tmp_path, eager_losses, degrees):
    assert_losses_close(_losses(tmp_path, 2, degrees), eager_losses)


def test_new_family_graph_scan_matches_eager(tmp_path, eager_losses):
    assert_losses_close(
        _losses(tmp_path, 1, {}, "--compile.mode=graph", "--compile.backend=aot_eager", "--compile.scan_layers=true"),
        eager_losses,
    )
