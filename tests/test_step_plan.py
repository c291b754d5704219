"""`trainer.step.plan_step`: the one place that decodes `[compile] mode`.

The trainer reads what the mode decides (backend, where activation checkpointing goes, block
compile, scan, loss parallel) from the StepPlan only; these tests pin that decision table.
"""

import pytest

from models.errors import ConfigError
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
