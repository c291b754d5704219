"""`trainer.step.plan_step`: the one place that decodes `[compile] mode` and refuses combinations.

The trainer reads what the mode decides (backend, where activation checkpointing goes, block
compile, scan, loss parallel) from the StepPlan only; these tests pin that decision table and
the rule table (`RULES`) the trainer, the engine and the planner read.
"""

import pytest

from models.errors import ConfigError
from trainer.step import RULES, plan_step, refusals, resolve_backend, StepRequest


def _plan(**kw):
    base = dict(mode="eager", backend="auto", scan_layers=False, ac_mode="none", loss_parallel=False,
                tp_degree=1, device_type="cpu")
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
    # MoE blocks scan too (their aux loss is a per-layer scan output), also with experts sharded.
    assert _plan(mode="graph", scan_layers=True).scan


def test_loss_parallel_needs_tensor_parallelism():
    assert not _plan(loss_parallel=True).loss_parallel
    assert _plan(loss_parallel=True, tp_degree=2).loss_parallel
    assert _plan(mode="graph", loss_parallel=True, tp_degree=2).loss_parallel


@pytest.mark.parametrize("kw, pattern", [
    (dict(scan_layers=True), "compile.scan_layers: needs compile.mode"),
    (dict(mode="compile", scan_layers=True), "compile.scan_layers"),
    (dict(mode="jit"), "compile.mode"),
    (dict(mode="graph", backend="tpu"), "compile.backend: tpu needs a TPU"),
    (dict(mode="compile", backend="xla"), "compile.backend"),
    (dict(loss_parallel=True, task="flow"), "parallelism.enable_loss_parallel: shards an LM's vocabulary"),
    (dict(mode="graph", caller_loss=True), "compile.mode: \"graph\" captures the LM loss"),
    (dict(fused_loss="on", model_has_hidden=True, caller_loss=True), "training.fused_loss: on never forms"),
    (dict(task="flow", caller_loss=True), "model.name: the engine trains language models"),
    (dict(task="diffusion"), "model.name: the family declares task 'diffusion'"),
])
def test_refused_combinations(kw, pattern):
    with pytest.raises(ConfigError, match=pattern):
        _plan(**kw)


def test_scan_accepts_tensor_parallelism():
    # The scan body runs the decoder TP styles on local tensors (parallelisms/scan.py).
    plan = _plan(mode="graph", scan_layers=True, tp_degree=2, loss_parallel=True)
    assert plan.scan and plan.loss_parallel


def test_backend_resolution_is_one_rule():
    assert resolve_backend("auto", mode="compile", device_type="cuda") == "inductor"
    assert resolve_backend("eager", mode="compile", device_type="cpu") == "eager"
    assert resolve_backend("eager", mode="graph", device_type="cpu") == "aot_eager"


def test_fused_loss_choice():
    assert not _plan(fused_loss="auto", model_has_hidden=True).fused_loss  # CPU: plain by default
    assert _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu").fused_loss
    assert _plan(fused_loss="on", model_has_hidden=True).fused_loss
    assert not _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu", tp_degree=2).fused_loss
    assert not _plan(fused_loss="auto", model_has_hidden=False, device_type="tpu").fused_loss
    with pytest.raises(ConfigError, match="training.fused_loss: on needs the whole vocabulary"):
        _plan(fused_loss="on", model_has_hidden=True, tp_degree=2)
    with pytest.raises(ConfigError, match="training.fused_loss: on needs a model with hidden"):
        _plan(fused_loss="on")
    # The engine reads logits: auto never fuses for it, even on a TPU.
    assert not _plan(fused_loss="auto", model_has_hidden=True, device_type="tpu", caller_loss=True).fused_loss


def test_every_rule_refuses_something_and_names_a_config_key():
    """Each rule of the table is reachable: a request it refuses, and a message that names a
    `section.key` of the config (what the user changes)."""
    from dataclasses import fields

    from trainer.config import Config

    sections = {f.name: {g.name for g in fields(f.type if isinstance(f.type, type) else type(getattr(Config(), f.name)))}
                for f in fields(Config)}
    examples = [
        StepRequest(mode="jit"), StepRequest(backend="xla"), StepRequest(fused_loss="maybe"), StepRequest(task="x"),
        StepRequest(mode="graph", backend="tpu"), StepRequest(scan_layers=True),
        StepRequest(fused_loss="on", tp_degree=2, model_has_hidden=True),
        StepRequest(fused_loss="on"), StepRequest(loss_parallel=True, task="flow"),
        StepRequest(mode="graph", caller_loss=True), StepRequest(fused_loss="on", model_has_hidden=True, caller_loss=True),
        StepRequest(task="flow", caller_loss=True),
        StepRequest(document_positions="first"), StepRequest(document_positions="restart"),
        StepRequest(document_mask=True, task="flow"), StepRequest(document_mask=True),
        StepRequest(document_mask=True, model_document_mask=True, caller_loss=True),
        StepRequest(cp_degree=2, task="flow"), StepRequest(cp_degree=2),
        StepRequest(cp_degree=2, model_document_mask=True, caller_loss=True),
        StepRequest(qk_clip=True, mode="graph"),
        StepRequest(qk_clip=True, cp_degree=2),
        StepRequest(cp_degree=2, model_document_mask=True, device_type="tpu", seq_len=1000),
        StepRequest(moe_routing="top1"), StepRequest(moe_routing="random"),
        StepRequest(moe_routing="random", model_has_experts=False),
        StepRequest(moe_routing="random", routing_benchmark_only=True, grad_accum=2),
    ]
    hit = {id(rule) for request in examples for rule in RULES if rule.refuses(request)}
    assert hit == {id(rule) for rule in RULES}, [r.key for r in RULES if id(r) not in hit]
    for rule in RULES:
        section, key = rule.key.split(".")
        assert key in sections[section], rule.key
    assert refusals(StepRequest()) == []


def test_context_parallel_chunks_hold_whole_splash_tiles_on_tpu():
    """seq_len / (2 cp) tokens per chunk: on TPU a multiple of splash's 128-token tile, refused
    before anything is built (the kernel asserts it mid-trace); elsewhere any chunk runs (SDPA)."""
    cp = dict(model_document_mask=True, device_type="tpu")
    (message,) = refusals(StepRequest(cp_degree=4, seq_len=1000, **cp))
    assert message.startswith("training.seq_len: 1000 with parallelism.context_parallel_degree = 4 "), message
    assert "= 125 tokens" in message and "multiple of 2 * cp * 128 = 1024" in message, message
    assert "\n" not in message
    assert refusals(StepRequest(cp_degree=2, seq_len=8192 + 128, **cp))  # chunks of 2080: not whole tiles
    for seq, degree in ((8192, 2), (131072, 8), (3072, 4), (256, 1), (1000, 1)):
        assert refusals(StepRequest(cp_degree=degree, seq_len=seq, **cp)) == [], (seq, degree)
    assert refusals(StepRequest(cp_degree=4, seq_len=1000, model_document_mask=True, device_type="cpu")) == []
    with pytest.raises(ConfigError, match=r"^training\.seq_len: "):
        plan_step(StepRequest(cp_degree=4, seq_len=1000, **cp))


def test_the_cp_tile_is_splash_s():
    """The rule's tile is the one titan_kernels/tpu/splash.py asserts (read as text: no jax here)."""
    import re
    from pathlib import Path

    from trainer.step.plan import CP_TILE

    text = (Path(__file__).resolve().parents[2] / "titan_kernels" / "tpu" / "splash.py").read_text()
    assert re.search(r"^TILE = (\d+)$", text, re.M).group(1) == str(CP_TILE)
