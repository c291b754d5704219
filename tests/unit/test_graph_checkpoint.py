"""Checkpoints are the same with and without layer scan, and with the graph or eager step.

Layer scan stores each block parameter `name` of all layers in one stacked tensor and makes
every layer's parameter (and AdamW state) a view of its row, so the model, the optimizer and
DCP see the usual per-layer tensors: `layers.0.attention.wq.weight` ... A checkpoint written
by a scanned graph step must load into an unscanned model (eager step) with equal keys and
values, and the reverse, and training must continue from it as if uninterrupted.
"""

from __future__ import annotations

import torch

from tests.support.graph_common import (
    PLAN,
    batches,
    build_model,
    build_opt,
    eager_step,
    max_param_diff,
    param_tolerance,
    run,
    snapshot,
)
from trainer.checkpoint import CheckpointManager, ModelState, OptimizerState
from trainer.graph import build_graph_step


def _manager(folder) -> CheckpointManager:
    return CheckpointManager(folder=folder, interval=1, keep_latest_k=0, async_mode="disabled", enable=True)


def _states(model, opt):
    return {"model": ModelState(model), "optimizer": OptimizerState(model, opt)}


def _flat(states) -> dict[str, torch.Tensor]:
    out = {}
    for prefix, state in states.items():
        for key, value in state.state_dict().items():
            if isinstance(value, torch.Tensor):
                out[f"{prefix}.{key}"] = value.detach().float().cpu().clone()
    return out


def _dir_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _graph(model, opt, scan: bool):
    return build_graph_step(model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=scan, plan=PLAN)


def test_scan_checkpoint_loads_without_scan_and_back(tmp_path):
    data = batches(6)
    # 1. Two scanned graph steps, save.
    model_a = build_model(2, seed=0)
    opt_a = build_opt(model_a)
    run(_graph(model_a, opt_a, scan=True), opt_a, data[:2])
    states_a = _states(model_a, opt_a)
    _manager(tmp_path / "scan").save(2, states_a)
    saved = _flat(states_a)
    assert any(k.startswith("model.layers.1.attention.wq.weight") for k in saved)
    assert any(".layers.1.feed_forward.w2.weight.exp_avg" in k for k in saved)

    # 2. Load into a differently initialized model without scan: identical keys and values.
    model_b = build_model(2, seed=7)
    opt_b = build_opt(model_b)
    states_b = _states(model_b, opt_b)
    assert _manager(tmp_path / "scan").load(states_b) == 2
    loaded = _flat(states_b)
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved)

    # 3. The unscanned copy continues eagerly, and saves; a fresh scanned graph step loads that
    # checkpoint (its per-layer tensors are swapped by the load, then re-stacked) and continues.
    run(eager_step(model_b, opt_b), opt_b, data[2:4])
    _manager(tmp_path / "plain").save(4, states_b)
    model_c = build_model(2, seed=9)
    opt_c = build_opt(model_c)
    step_c = _graph(model_c, opt_c, scan=True)
    assert _manager(tmp_path / "plain").load(_states(model_c, opt_c)) == 4
    assert max_param_diff(model_b, model_c) == 0.0
    # Continue both for two steps: the scanned graph step trains from the loaded state.
    before = snapshot(model_b)
    ref = run(eager_step(model_b, opt_b), opt_b, data[4:6])
    got = run(step_c, opt_c, data[4:6])
    assert all(abs(r[0] - g[0]) <= 1e-5 * abs(r[0]) for r, g in zip(ref, got)), (ref, got)
    assert max_param_diff(model_b, model_c) <= param_tolerance(before, model_b)
    # Per-layer step counters kept their identity as rows of the stacked step vector.
    assert {float(s["step"]) for s in opt_c.state.values()} == {6.0}

    # Views of stacked storage do not inflate the checkpoint (each row is written once).
    assert _dir_bytes(tmp_path / "scan") <= 1.05 * _dir_bytes(tmp_path / "plain")


def test_scan_resyncs_replaced_tensors():
    """Tensors replaced behind the step's back (load_state_dict(assign=True), a new state dict
    object) are copied back into the stacked storage before the next step."""
    data = batches(3)
    ref_model, model = build_model(2), build_model(2)
    ref_opt, opt = build_opt(ref_model), build_opt(model)
    step = _graph(model, opt, scan=True)
    run(eager_step(ref_model, ref_opt), ref_opt, data[:1])
    run(step, opt, data[:1])
    with torch.no_grad():
        for m, o in ((ref_model, ref_opt), (model, opt)):
            w = m.layers["1"].attention.wq._parameters["weight"]
            w.data = w.detach() * 0.5  # new storage, no longer a view of the stacked row
            state = o.state[m.layers["1"].feed_forward.w2._parameters["weight"]]
            state["exp_avg"] = state["exp_avg"].clone() + 1e-3  # a new tensor object
    assert step.block_stacks["layers"].resync_scan_storage() == 1  # and the graph step would do it itself
    # The edited exp_avg (+1e-3 against moments of ~1e-5) makes some updates far larger than the
    # lr; the parameter bound scales with the largest one (param_tolerance).
    before = snapshot(ref_model)
    ref = run(eager_step(ref_model, ref_opt), ref_opt, data[1:3])
    got = run(step, opt, data[1:3])
    assert all(abs(r[0] - g[0]) <= 1e-5 * abs(r[0]) for r, g in zip(ref, got)), (ref, got)
    assert max_param_diff(ref_model, model) <= param_tolerance(before, ref_model)
