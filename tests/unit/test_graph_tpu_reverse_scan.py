"""`tag_reverse_scans` (trainer/graph/passes.py): torch-tpu's flip-free backward scan.

The pass drops the `flip(x, [0])` inputs of torch 2.13's backward scans, tags the body with
`torch_tpu_scan_reverse` and un-flips the stacked outputs. Only torch-tpu (and the torchax
lowering in tools/xla_lowering.py) honour the tag, so here the rewritten graph runs under an
interpreter whose scan implements that semantics independently, as torch-tpu documents it
(`ScanDirection.kReverse`: step i reads row n-1-i of every xs and writes row n-1-i of every
stacked output). Against the flipped graph it must be bitwise equal: the same body runs on the
same rows in the same order. The control runs the tagged graph with the plain forward scan and
must differ, so the comparison can fail. That the tag reaches torch-tpu's lowering is checked
in tests/xla/test_torch_tpu_path.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from tests.support.graph_common import PLAN, batches, build_model, build_opt, run
from trainer.graph import build_graph_step
from trainer.graph.passes import SCAN_REVERSE_ANNOTATION, scan_is_reversed, tag_reverse_scans

SCAN = torch.ops.higher_order.scan
FLIP = torch.ops.aten.flip.default


def reverse_scan(body, init, xs, additional):
    """torch-tpu's reverse scan, written out: rows n-1 .. 0, output of row r stored at row r."""
    n, n_carry = xs[0].shape[0], len(init)
    carry, rows = list(init), [None] * n
    for r in reversed(range(n)):
        out = body(*carry, *[x[r] for x in xs], *additional)
        carry, rows[r] = list(out[:n_carry]), list(out[n_carry:])
    return [*carry, *[torch.stack([rows[r][k] for r in range(n)]) for k in range(len(rows[0]))]]


class TpuScanSemantics(fx.Interpreter):
    """Runs a graph with scans as torch-tpu lowers them: a tagged body runs in reverse."""

    def __init__(self, gm, honour_tag: bool = True):
        super().__init__(gm)
        self.honour_tag = honour_tag
        self.reversed_calls = 0

    def call_function(self, target, args, kwargs):
        if target is SCAN and self.honour_tag and scan_is_reversed(args[0]):
            self.reversed_calls += 1
            return reverse_scan(*args)
        return super().call_function(target, args, kwargs)


def _captured(ac_mode: str = "none"):
    model = build_model(2)
    opt = build_opt(model)
    step = build_graph_step(
        model=model, optimizer=opt, max_norm=1.0, backend="aot_eager", scan_layers=True, ac_mode=ac_mode, plan=PLAN
    )
    run(step, opt, batches(1))
    gm = step.graph_module
    inputs = [n.meta["val"] for n in gm.graph.find_nodes(op="placeholder")]
    g = torch.Generator().manual_seed(3)
    real = [
        torch.randint(0, 512, v.shape, generator=g)
        if not v.dtype.is_floating_point
        else torch.rand(v.shape, generator=g, dtype=v.dtype) * 0.05
        for v in inputs
    ]
    return gm, real


def _scans(gm):
    return list(gm.graph.find_nodes(op="call_function", target=SCAN))


@pytest.mark.parametrize("ac_mode", ["none", "full"])
def test_tagged_backward_scan_is_the_flipped_scan(ac_mode):
    gm, real = _captured(ac_mode)
    flips_before = len(gm.graph.find_nodes(op="call_function", target=FLIP))
    assert flips_before > 0
    ref = gm(*[t.clone() for t in real])
    assert tag_reverse_scans(gm) == 1
    gm.graph.lint()
    # No flip is left: the backward reads the forward's stacks and weights as they are.
    assert not gm.graph.find_nodes(op="call_function", target=FLIP)
    forward, backward = _scans(gm)
    assert not scan_is_reversed(getattr(gm, forward.args[0].target))
    body = getattr(gm, backward.args[0].target)
    assert scan_is_reversed(body)
    assert all(n.meta["custom"][SCAN_REVERSE_ANNOTATION] for n in body.graph.nodes)
    assert backward.meta["custom"][SCAN_REVERSE_ANNOTATION]
    assert SCAN_REVERSE_ANNOTATION not in forward.meta.get("custom", {})
    interp = TpuScanSemantics(gm)
    got = interp.run(*[t.clone() for t in real])
    assert interp.reversed_calls == 1
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    # Control: the same tagged graph under a scan that ignores the tag (CPU, CUDA) is wrong.
    wrong = TpuScanSemantics(gm, honour_tag=False).run(*[t.clone() for t in real])
    assert any(not torch.equal(a, b) for a, b in zip(ref, wrong))
    # Idempotent: a second run finds no flipped scan.
    assert tag_reverse_scans(gm) == 0


def _flipped_scan_graph():
    """A hand-traced graph: the second scan reads flipped inputs (as a backward scan does), and
    its stacked output is read both flipped back and as is (`y2[0]`: row 0 of the reversed
    order, i.e. the output for the last row of `xs`)."""
    from torch._higher_order_ops.scan import scan
    from torch.fx.experimental.proxy_tensor import make_fx

    def body(c, x):
        h = torch.tanh(c * 0.5 + x)
        return h, h * 2.0 + c

    def f(c, xs):
        c1, y1 = scan(body, c, xs)
        c2, y2 = scan(body, c1, xs.flip(0))
        return c2, y1, y2.flip(0), y2[0] * 3.0

    args = (torch.randn(2, 4), torch.randn(5, 2, 4))
    return make_fx(f, tracing_mode="fake")(*args), args


def test_shared_body_and_other_readers_of_the_stack():
    gm, args = _flipped_scan_graph()
    first, second = _scans(gm)
    # The two scans share one body module, as a graph may: tagging must not reverse the first.
    second.replace_input_with(second.args[0], first.args[0])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    ref = gm(*args)
    assert tag_reverse_scans(gm) == 1
    gm.graph.lint()
    first, second = _scans(gm)
    assert first.args[0].target != second.args[0].target  # the tagged scan got its own copy
    assert not scan_is_reversed(getattr(gm, first.args[0].target))
    assert scan_is_reversed(getattr(gm, second.args[0].target))
    # `y2.flip(0)` is y2 itself now; `y2[0]` reads the one flip left, inserted for it.
    (stack,) = [u for u in second.users if u.args[1] == 1]
    flips = [u for u in stack.users if u.target is FLIP]
    assert len(flips) == 1 and len(gm.graph.find_nodes(op="call_function", target=FLIP)) == 1
    assert any(u.op == "output" for u in stack.users)
    got = TpuScanSemantics(gm).run(*args)
    assert len(ref) == len(got)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    wrong = TpuScanSemantics(gm, honour_tag=False).run(*args)
    assert any(not torch.equal(a, b) for a, b in zip(ref, wrong))


def test_scans_with_an_unflipped_input_are_left_alone():
    gm, _ = _flipped_scan_graph()
    second = _scans(gm)[1]
    (flip,) = second.args[2]
    second.args = (second.args[0], second.args[1], [flip.args[0]], second.args[3])
    gm.recompile()
    assert tag_reverse_scans(gm) == 0
    assert not any(scan_is_reversed(getattr(gm, n.args[0].target)) for n in _scans(gm))


def test_tpu_capture_tags_instead_of_looping():
    """CaptureBackend(backend="tpu") runs the tag pass in its pipeline (no torch-tpu needed for
    the passes); Inductor's loop rewrite is not used there (torch-tpu has no while_loop)."""
    from trainer.graph.capture import CaptureBackend

    gm, _ = _captured()
    capture = CaptureBackend(backend="tpu")
    assert capture.reverse_scans
    capture._on_graph(gm)
    assert capture.stats.ops["flip"] == 0 and capture.stats.ops["while_loop"] == 0
    assert capture.stats.ops["scan"] == 2
    assert [scan_is_reversed(getattr(gm, n.args[0].target)) for n in _scans(gm)] == [False, True]
