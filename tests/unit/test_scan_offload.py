"""`[activation_checkpoint] offload = "block_inputs"`: trainer/graph/passes.py
`offload_block_inputs_pass` keeps the block inputs a forward scan saves for its backward in host
memory (`ao.offload` on the row the forward body emits, `ao.reload` on the row the backward body
reads). On the CPU both ops are copies, so the numbers must not change.

The default-tier test runs the pass on a hand-built graph of the shape torch 2.13's scan autograd
gives a captured step (a forward scan emitting `clone(carry)` per step, a backward scan over the
`flip`ped stacks; no Dynamo, so it stays cheap); the scheduled one runs the reduced Llama 3 debug
flavor through the graph step with and without the offload.
"""

from __future__ import annotations

import operator

import torch
import torch._dynamo  # noqa: F401  (imported by a custom op's first call: kept out of the test's time)
from torch import fx

from trainer.graph.passes import graph_stats, offload_block_inputs_pass


def _ao_nodes(gm: fx.GraphModule) -> dict[str, int]:
    counts = {"offload": 0, "reload": 0}
    for module in gm.modules():
        for node in getattr(module, "graph", fx.Graph()).nodes:
            target = getattr(node.target, "_overloadpacket", None)
            for name in counts:
                if target is not None and target == getattr(getattr(torch.ops, "ao", None), name, None):
                    counts[name] += 1
    return counts


def _fwd_body(h, w):
    h2 = torch.tanh(h @ w)
    return h2, torch.ops.aten.clone.default(h)  # the block input, saved for the backward


def _bwd_body(gh, w, h):  # full checkpointing: the block recomputed from its saved input
    h2 = torch.tanh(h @ w)
    dpre = gh * (1 - h2 * h2)
    return dpre @ w.t(), h.t() @ dpre


def _two_layer_step(*, also_return_saved: bool = False) -> fx.GraphModule:
    """h = two tanh layers scanned over `ws`; their backward scan over the flipped weights and
    saved inputs: outputs (h, dL/dh0, dL/dws) for the output gradient `gout`."""
    root = torch.nn.Module()
    root.fwd, root.bwd = fx.symbolic_trace(_fwd_body), fx.symbolic_trace(_bwd_body)
    g = fx.Graph()
    h0, ws, gout = g.placeholder("h0"), g.placeholder("ws"), g.placeholder("gout")
    fwd = g.call_function(torch.ops.higher_order.scan, (g.get_attr("fwd"), [h0], [ws], ()))
    h, saved = (g.call_function(operator.getitem, (fwd, i)) for i in (0, 1))

    def flip(x):
        return g.call_function(torch.ops.aten.flip.default, (x, [0]))

    bwd = g.call_function(torch.ops.higher_order.scan, (g.get_attr("bwd"), [gout], [flip(ws), flip(saved)], ()))
    gh0, gws = (g.call_function(operator.getitem, (bwd, i)) for i in (0, 1))
    g.output((h, gh0, flip(gws), saved) if also_return_saved else (h, gh0, flip(gws)))
    return fx.GraphModule(root, g)


def test_offload_moves_the_saved_block_inputs_and_keeps_the_numbers():
    gen = torch.Generator().manual_seed(0)
    h0, ws, gout = (
        torch.randn(3, 8, generator=gen),
        torch.randn(2, 8, 8, generator=gen) / 3,
        torch.randn(3, 8, generator=gen),
    )
    want = _two_layer_step()(h0, ws, gout)
    # The hand-built graph is the step: autograd's gradients to fp32 rounding (2 layers of 8).
    w, x = ws.clone().requires_grad_(), h0.clone().requires_grad_()
    h = x
    for i in range(2):
        h = torch.tanh(h @ w[i])
    for got, ref in zip(want[1:], torch.autograd.grad(h, (x, w), gout)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)

    gm = _two_layer_step()
    assert offload_block_inputs_pass(gm) == 1
    # One offload in the forward body on the emitted row, one reload in the backward body before
    # the row's uses; the stacked block inputs ([2 layers, 3, 8] fp32) count as on the host.
    assert _ao_nodes(gm) == {"offload": 1, "reload": 1}
    (offload,) = [n for n in gm.fwd.graph.nodes if "offload" in str(n.target)]
    assert offload.args[0].target is torch.ops.aten.clone.default and offload in gm.fwd.graph.output_node().args[0]
    (reload,) = [n for n in gm.bwd.graph.nodes if "reload" in str(n.target)]
    row = [n for n in gm.bwd.graph.nodes if n.op == "placeholder"][2]
    assert reload.args[0] is row and list(row.users) == [reload]
    for node in gm.graph.nodes:  # graph_stats reads the scans' outputs from their meta
        if node.target is torch.ops.higher_order.scan:
            node.meta["val"] = [torch.empty(3, 8), torch.empty(2, 3, 8)] if node.args[0].target == "fwd" else []
    assert graph_stats(gm).scan_offloaded_bytes == 2 * 3 * 8 * 4
    # ... and nothing else: on the CPU the host copies are exact, the same ops run in the same
    # order, so the outputs are bitwise equal.
    for got, ref in zip(gm(h0, ws, gout), want):
        assert torch.equal(got, ref)


def test_offload_leaves_saved_inputs_that_something_else_reads():
    """A stack the step also reads whole (here: returns it) stays on the device."""
    gm = _two_layer_step(also_return_saved=True)
    assert offload_block_inputs_pass(gm) == 0
    assert _ao_nodes(gm) == {"offload": 0, "reload": 0}


def test_graph_step_offload_matches_the_step_without():
    """The reduced Llama 3 debug flavor (2 layers, layer scan, full checkpointing, aot_eager), 2
    steps of 2 accumulation micro-batches (two forward scans and two backward scans in the
    program): with the offload the losses, gradient norms, weights and AdamW moments equal the
    step's without it bitwise, and the eager step's within tests/unit/test_graph_step.py's
    tolerances."""
    from tests.support.graph_common import (
        PLAN,
        batches,
        build_model,
        build_opt,
        eager_step,
        max_param_diff,
        max_state_diff,
        run,
    )
    from tests.unit.test_graph_step import PARAM_TOL, _compare
    from trainer.graph import build_graph_step

    data = batches(2, accum=2)
    got = {}
    for offload in ("none", "block_inputs"):
        model = build_model(2)
        opt = build_opt(model)
        step = build_graph_step(
            model=model,
            optimizer=opt,
            max_norm=1.0,
            backend="aot_eager",
            scan_layers=True,
            ac_mode="full",
            grad_accum_steps=2,
            plan=PLAN,
        )
        step.capture.offload = offload
        got[offload] = (run(step, opt, data), model, opt, _ao_nodes(step.capture.graph_module), step.stats)
    (ref, ref_model, ref_opt, ref_ao, _), (out, model, opt, ao, stats) = got["none"], got["block_inputs"]
    assert ref_ao == {"offload": 0, "reload": 0}
    assert ao == {"offload": 2, "reload": 2}, ao  # one per forward / backward scan
    # [2 layers, batch 2, seq 32, dim 64] fp32 per micro-batch
    assert stats.scan_offloaded_bytes == 2 * (2 * 2 * 32 * 64 * 4)
    assert out == ref
    assert max_param_diff(ref_model, model) == 0 and max_state_diff(ref_opt, opt) == 0
    eager_model = build_model(2)
    eager_opt = build_opt(eager_model)
    _compare(run(eager_step(eager_model, eager_opt), eager_opt, data), out)
    assert max_param_diff(eager_model, model) <= PARAM_TOL
