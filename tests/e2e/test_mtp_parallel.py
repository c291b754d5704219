"""Multi-token prediction on several processes (DeepSeek-V3; Qwen 3.5 MoE): SimpleFSDP with expert parallelism
(the MTP block's experts FSDP-sharded, not expert-parallel) trains as one process does."""

import pytest

from tests.support.trainer_runs import train

STEPS = 4
COMMON = (
    "--config",
    "configs/deepseek_v3_debug.toml",
    "--model.mtp_depth=1",
    "--model.n_layers=3",
    "--model.attn_backend=sdpa",
    f"--training.steps={STEPS}",
    "--training.seq_len=64",
    "--training.mixed_precision_param=float32",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--validation.enable=false",
    "--checkpoint.enable=false",
)


def _curves(folder, nproc: int, degrees: dict) -> dict[str, list[float]]:
    records = train(folder, nproc, degrees, *COMMON)
    assert sorted(records) == list(range(1, STEPS + 1))
    return {key: [records[s][key] for s in range(1, STEPS + 1)] for key in ("loss", "mtp_loss_1")}


@pytest.mark.multiprocess
@pytest.mark.exhaustive  # scheduled tier (tests/support/tiers.py)
def test_mtp_fsdp_ep_matches_single_process(tmp_path):
    """dp_shard = 2 x ep = 2 vs one process: `loss` and `mtp_loss_1` of every step within 1e-5
    relative (measured: equal to 1e-6)."""
    want = _curves(tmp_path / "single", 1, {})
    got = _curves(tmp_path / "ep2", 2, dict(dp_shard=2, ep=2))
    for key in want:
        worst = max(abs(a - b) / abs(b) for a, b in zip(got[key], want[key]))
        assert worst < 1e-5, (key, got[key], want[key])


QWEN = (
    "--config",
    "configs/qwen3_5_moe_debug.toml",
    "--model.mtp_depth=1",
    f"--training.steps={STEPS}",
    "--training.seq_len=64",
    "--training.mixed_precision_param=float32",
    "--lr_scheduler.warmup_steps=2",
    "--metrics.log_freq=1",
    "--metrics.enable_tensorboard=false",
    "--validation.enable=false",
    "--checkpoint.enable=false",
)


@pytest.mark.multiprocess
@pytest.mark.exhaustive  # scheduled tier (tests/support/tiers.py)
def test_qwen3_5_mtp_fsdp_ep_matches_single_process(tmp_path):
    """Qwen 3.5 MoE debug (4 blocks and the MTP module's full-attention MoE block) on dp_shard = 2 x
    ep = 2 vs one process: `loss` and `mtp_loss_1` of every step within 1e-5 relative (fp32,
    gloo; the reductions' order is all that differs)."""
    records = {}
    for name, nproc, degrees in (("single", 1, {}), ("ep2", 2, dict(dp_shard=2, ep=2))):
        got = train(tmp_path / name, nproc, degrees, *QWEN)
        assert sorted(got) == list(range(1, STEPS + 1))
        records[name] = {k: [got[s][k] for s in range(1, STEPS + 1)] for k in ("loss", "mtp_loss_1")}
    for key, want in records["single"].items():
        worst = max(abs(a - b) / abs(b) for a, b in zip(records["ep2"][key], want))
        print(f"{key}: worst relative difference {worst:.2e}")
        assert worst < 1e-5, (key, records["ep2"][key], want)
