"""Layer scan over a hybrid stack (models/common/stack.py `scan_period`, `PeriodGroup`): Qwen 3.5's
three Gated DeltaNet blocks and one full-attention block scanned one period per step.

Tolerances (fp32, backend aot_eager, 3 steps at lr up to 1e-3), as tests/unit/test_models_moe.py's
scanned MoE step: losses, aux losses and gradient norms within 1e-5 relative of the eager step,
parameters within 2e-6 absolute (a few ulps of AdamW over 3 steps in its linear regime). The
scanned step runs the same ops per block in the same order; what differs is the aux terms' sum
(stacked, then summed) and the compiled backward's accumulation order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from models.common.stack import BlockStack, PeriodGroup
from models.qwen3_5 import FLAVORS, Qwen3_5Transformer
from models.qwen3_5.plan import PLAN


def _model(n_layers: int, moe: bool = True, seed: int = 0):
    from parallelisms.simple_fsdp import data_parallel

    base = FLAVORS["debugmodel_moe" if moe else "debugmodel"]
    args = dataclasses.replace(
        base,
        n_layers=n_layers,
        dim=64,
        n_heads=2,
        n_kv_heads=1,
        head_dim=32,
        vocab_size=512,
        max_seq_len=32,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        **(dict(moe_hidden_dim=32, shared_expert_hidden_dim=32) if moe else dict(hidden_dim=96)),
    )
    with torch.device("meta"):
        model = Qwen3_5Transformer(args)
    data_parallel(model, mesh=None, param_dtype=torch.float32, reduce_dtype=torch.float32)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights()
    return model


def test_the_period_is_the_layer_schedules():
    """8 blocks of schedule [D D D A] x 2 repeat with period 4; one period alone (4 blocks) and a
    uniform stack have none to scan by (1), and a stack of 1 block is its own period. With period
    4 the stacked rows are blocks j, j + 4: `2.*` stacks blocks 2 and 6, `3.*` the attention
    blocks 3 and 7, each row a view of its block's parameter (the module tree and the state-dict
    keys unchanged)."""
    model = _model(8)
    assert model.layers.scan_period() == 4
    assert _model(4).layers.scan_period() == 1
    assert BlockStack([torch.nn.Linear(2, 2) for _ in range(3)]).scan_period() == 1
    keys = list(model.state_dict())
    model.layers.enable_scan()
    assert isinstance(model.layers.scan_template(), PeriodGroup) and list(model.state_dict()) == keys
    stacked = model.layers.stacked_parameters()
    assert all(stack.shape[0] == 2 for stack, _ in stacked.values())
    attn = [n for n in stacked if n.startswith("3.") and "attention.wq" in n]
    assert attn, sorted(stacked)[:8]
    stack, members = stacked[attn[0]]
    assert members[0] is model.layers["3"].get_parameter(attn[0][2:])
    assert members[1] is model.layers["7"].get_parameter(attn[0][2:])
    assert members[1].data_ptr() == stack[1].data_ptr()


def test_one_period_alone_is_refused_with_its_reason():
    """A stack that does not repeat (one period of 4 blocks) keeps the old error: block 3 is
    another class than block 0."""
    model = _model(4)
    with pytest.raises(ValueError, match=r"^layer scan: block 3 .*allowed: compile.scan_layers = false"):
        model.layers.enable_scan()


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_hybrid_graph_step_with_scan_matches_eager(moe):
    """The graph trainer's step with layer scan over 8 hybrid blocks (2 periods; the MoE flavor at
    aux_loss_coef 0.01) for 3 steps: losses, aux losses, gradient norms and the parameters after
    AdamW equal the eager step's (tolerances in the module docstring); one forward and one
    backward scan, no unrolled block. The expert loads come out in layer order: equal to eager's."""
    from parallelisms.simple_fsdp import clip_grad_norm_
    from tests.support.graph_common import batches, build_opt, lr_at, max_param_diff
    from trainer.graph import build_graph_step
    from trainer.step import EagerStep

    models = [_model(8, moe) for _ in range(2)]
    opts = [build_opt(m) for m in models]
    torch._dynamo.reset()
    coef = 0.01 if moe else 0.0
    eager = EagerStep(
        model=models[0], optimizer=opts[0], max_norm=1.0, aux_loss_coef=coef, clip_grad_norm=clip_grad_norm_
    )
    graph = build_graph_step(
        model=models[1],
        optimizer=opts[1],
        max_norm=1.0,
        backend="aot_eager",
        aux_loss_coef=coef,
        plan=PLAN,
        scan_layers=True,
    )
    curves = []
    for step, opt in zip((eager, graph), opts):
        curve = []
        for i, mbs in enumerate(batches(3)):
            for group in opt.param_groups:
                group["lr"] = lr_at(i)
            out = step(mbs, lr_at(i))
            curve.append((float(out.loss), float(out.aux_loss or 0.0), float(out.grad_norm)))
        curves.append(curve)
    assert graph.stats.scans == 2
    for got, want in zip(curves[1], curves[0]):
        assert got == pytest.approx(want, rel=1e-5), curves
    assert max_param_diff(models[0], models[1]) <= 2e-6
    if not moe:
        return
    assert curves[0][0][1] > 0  # the aux term is there to compare
    # The loads [8 layers, E] of one compiled forward: the scan's [2, 4, E] flattened in layer order
    # (each layer routes differently, so rows in another order differ). Token counts: exact.
    tokens = batches(1)[0][0][0]

    def loads(model):
        model(tokens)
        return model.layers.pop_expert_load()

    want = loads(models[0])
    got = torch.compile(loads, fullgraph=True, backend="aot_eager")(models[1])
    assert got.shape == want.shape == (8, 8) and torch.equal(got, want), (got, want)
    assert not torch.equal(want[0], want[1])


def test_the_template_is_fixed_when_the_scan_is_enabled(monkeypatch):
    """The scanned step never re-derives the period: reading the blocks' parameters while a step is
    traced failed the capture of expert-parallel stacks (their DTensor shards; test_expert_parallel's
    layer-scan test at fsdp2-ep2). enable_scan fixes the template, uniform or periodic."""
    for n_layers, kind in ((8, PeriodGroup), (4, None)):
        model = _model(n_layers, moe=False)
        stack = model.layers
        if kind is None:  # a uniform stack: only the Gated DeltaNet blocks of one period
            stack = BlockStack([model.layers[str(i)] for i in range(3)])
        stack.enable_scan()
        monkeypatch.setattr(BlockStack, "scan_period", lambda self: pytest.fail("scan_period after enable_scan"))
        template = stack.scan_template()
        assert isinstance(template, kind) if kind else template is stack["0"]
        monkeypatch.undo()
