"""`trainer.job`: the build every entry point shares (the batch split it computes, and the
engine's refusals coming from the same rule table as the trainer's)."""

import os

import pytest

from models.errors import ConfigError
from trainer.job import batch_split

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_global_batch_split_follows_the_mesh():
    def split(global_batch, local, accum, dp):
        return batch_split(
            global_batch_size=global_batch, local_batch_size=local, gradient_accumulation_steps=accum, dp_degree=dp
        )

    assert split(-1, 8, 2, 4) == (8, 2)  # unset: the configured values stand
    assert split(32, 8, 1, 1) == (8, 4)  # 1 device: accumulate up to the global batch
    assert split(32, 8, 1, 4) == (8, 1)
    assert split(32, 8, 1, 8) == (4, 1)  # more devices: smaller micro-batches, same global batch
    assert split(32, 8, 2, 4) == (4, 2)  # accumulation never below the configured count
    assert split(12, 8, 1, 1) == (6, 2)  # the smallest accumulation that fits local_batch_size
    for g, local, accum, dp in [(32, 8, 1, 1), (32, 8, 1, 4), (12, 8, 1, 1), (24, 2, 3, 2)]:
        micro, n = split(g, local, accum, dp)
        assert micro * n * dp == g and micro <= local and n >= accum
    with pytest.raises(
        ConfigError, match="training.global_batch_size: 30 is not divisible by the data-parallel degree 4"
    ):
        split(30, 8, 1, 4)
    with pytest.raises(ConfigError, match="training.global_batch_size: 8 sequences over 1"):
        split(8, 8, 16, 1)  # accumulation 16 > 8 sequences: no split


@pytest.mark.parametrize(
    "overrides, pattern",
    [
        ([("compile.mode", "graph")], 'compile.mode: "graph" captures the LM loss'),
        ([("training.fused_loss", "on")], "training.fused_loss: on never forms the log-probs"),
    ],
)
def test_engine_refusals_are_rules_checked_before_the_model_is_built(overrides, pattern, monkeypatch):
    import trainer.job as job_module
    from trainer.config import build_config
    from trainer.engine import Engine

    monkeypatch.setattr(job_module, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    cfg = build_config(os.path.join(ROOT, "configs", "llama3_debug.toml"), overrides)
    try:
        with pytest.raises(ConfigError, match=pattern):
            Engine(cfg)
    finally:
        from trainer.runtime import shutdown_distributed

        shutdown_distributed()
