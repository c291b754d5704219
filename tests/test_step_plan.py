"""`trainer.step.plan_step`: the one place that decodes `[compile] mode`.

The trainer reads what the mode decides (backend, where activation checkpointing goes, block
compile, scan, loss parallel) from the StepPlan only; these tests pin that decision table.
"""

import pytest

from models.errors import ConfigError
from models.qwen3 import FLAVORS as QWEN3
from trainer.step import plan_step, resolve_backend


def _plan(**kw):
    base = dict(mode="eager", backend="auto", scan_layers=False, ac_mode="none", loss_parallel=False,
                tp_enabled=False, device_type="cpu")
    return plan_step(**{**base, **kw})


def test_eager_compiles_nothing_and_checkpoints_blocks():
    plan = _plan(ac_mode="full")
    assert (plan.backend, plan.block_compile, plan.block_ac, plan.scan, plan.scan_ac) == (None, None, "full", False, "none")


def test_compile_mode_compiles_blocks_with_the_resolved_backend():
    plan = _plan(mode="compile", ac_mode="selective")
    assert plan.backend == plan.block_compile == "inductor" and plan.block_ac == "selective"
    assert _plan(mode="compile", device_type="tpu").backend == "tpu"


def test_graph_mode_checkpoints_in_the_same_place_unless_scanned():
    unrolled = _plan(mode="graph", ac_mode="full")
    assert unrolled.block_ac == "full" and unrolled.scan_ac == "none" and unrolled.block_compile is None
    scanned = _plan(mode="graph", scan_layers=True, ac_mode="full")
    assert scanned.block_ac == "none" and scanned.scan_ac == "full" and scanned.scan
    assert _plan(mode="graph", backend="eager").backend == "aot_eager"
    # MoE blocks scan too (their aux loss is a per-layer scan output).
    assert _plan(mode="graph", scan_layers=True, shape=QWEN3["debugmodel_moe"].shape()).scan


def test_loss_parallel_needs_tensor_parallelism():
    assert not _plan(loss_parallel=True).loss_parallel
    assert _plan(loss_parallel=True, tp_enabled=True).loss_parallel
    assert _plan(mode="graph", loss_parallel=True, tp_enabled=True).loss_parallel


@pytest.mark.parametrize("kw, pattern", [
    (dict(scan_layers=True), "compile.scan_layers: needs compile.mode"),
    (dict(mode="compile", scan_layers=True), "compile.scan_layers"),
    (dict(mode="jit"), "compile.mode"),
    (dict(mode="graph", backend="tpu"), "compile.backend: tpu needs a TPU"),
    (dict(mode="compile", backend="xla"), "compile.backend"),
])
def test_refused_combinations(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _plan(**kw)


def test_backend_resolution_is_one_rule():
    assert resolve_backend("auto", mode="compile", device_type="cuda") == "inductor"
    assert resolve_backend("eager", mode="compile", device_type="cpu") == "eager"
    assert resolve_backend("eager", mode="graph", device_type="cpu") == "aot_eager"


def test_global_batch_split_follows_the_mesh():
    from trainer.train import batch_split

    def split(global_batch, local, accum, dp):
        return batch_split(global_batch_size=global_batch, local_batch_size=local,
                           gradient_accumulation_steps=accum, dp_degree=dp)

    assert split(-1, 8, 2, 4) == (8, 2)  # unset: the configured values stand
    assert split(32, 8, 1, 1) == (8, 4)  # 1 device: accumulate up to the global batch
    assert split(32, 8, 1, 4) == (8, 1)
    assert split(32, 8, 1, 8) == (4, 1)  # more devices: smaller micro-batches, same global batch
    assert split(32, 8, 2, 4) == (4, 2)  # accumulation never below the configured count
    assert split(12, 8, 1, 1) == (6, 2)  # the smallest accumulation that fits local_batch_size
    for g, local, accum, dp in [(32, 8, 1, 1), (32, 8, 1, 4), (12, 8, 1, 1), (24, 2, 3, 2)]:
        micro, n = split(g, local, accum, dp)
        assert micro * n * dp == g and micro <= local and n >= accum
    with pytest.raises(ConfigError, match="training.global_batch_size: 30 is not divisible by the data-parallel degree 4"):
        split(30, 8, 1, 4)
    with pytest.raises(ConfigError, match="training.global_batch_size: 8 sequences over 1"):
        split(8, 8, 16, 1)  # accumulation 16 > 8 sequences: no split


def test_fused_loss_choice():
    assert not _plan(fused_loss="auto", model_has_hidden=True).fused_loss  # CPU: plain by default
    assert _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu").fused_loss
    assert _plan(fused_loss="on", model_has_hidden=True).fused_loss
    assert not _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu", tp_enabled=True).fused_loss
    assert not _plan(fused_loss="auto", model_has_hidden=False, device_type="tpu").fused_loss
    with pytest.raises(ConfigError, match="training.fused_loss: on needs the whole vocabulary"):
        _plan(fused_loss="on", model_has_hidden=True, tp_enabled=True)
    with pytest.raises(ConfigError, match="training.fused_loss: on needs a model with hidden"):
        _plan(fused_loss="on")
