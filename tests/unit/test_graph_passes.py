"""`prefetch_all_gathers_pass` on a hand-built graph of SimpleFSDP's traced pattern.

Per parameter i: `cast_i = convert(w_i)`, `ag_i = all_gather(cast_i)`, `wait_i = wait(ag_i)`,
`h = mm(h, wait_i)`, as tracing leaves it (each gather issued just before its use). The graph
is only built, never run: the pass reads node targets and order.
"""

from __future__ import annotations

import pytest
import torch
from torch import fx

from trainer.graph.passes import prefetch_all_gathers_pass

_ops = torch.ops._c10d_functional


def _fsdp_chain(n: int) -> tuple[fx.GraphModule, list[fx.Node], list[fx.Node], list[fx.Node]]:
    g = fx.Graph()
    h = g.placeholder("h")
    weights = [g.placeholder(f"w{i}") for i in range(n)]
    gathers, waits, mms = [], [], []
    for w in weights:
        cast = g.call_function(torch.ops.prims.convert_element_type.default, (w, torch.bfloat16))
        ag = g.call_function(_ops.all_gather_into_tensor.default, (cast, 2, "0"))
        wait = g.call_function(_ops.wait_tensor.default, (ag,))
        h = g.call_function(torch.ops.aten.mm.default, (h, wait))
        gathers.append(ag)
        waits.append(wait)
        mms.append(h)
    g.output(h)
    return fx.GraphModule(torch.nn.Module(), g), gathers, waits, mms


@pytest.mark.parametrize("n, lookahead", [(12, 3), (400, 8)])
def test_gathers_move_ahead_by_the_lookahead_and_waits_stay(n, lookahead):
    # (400, 8): the first lookahead chains all go into the gap before the first wait, which the
    # pass renumbers in place rather than renumbering the graph after every move.
    gm, gathers, waits, mms = _fsdp_chain(n)
    moved = prefetch_all_gathers_pass(gm, lookahead=lookahead)
    gm.graph.lint()  # still topologically valid: every input before its use
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    assert moved == n - 1  # all but the first
    for i in range(1, n):
        # issued before the wait `lookahead` gathers back (the first wait for the first ones),
        # and after the gather before it: issue order unchanged
        assert order[gathers[i]] < order[waits[max(0, i - lookahead)]]
        assert order[gathers[i - 1]] < order[gathers[i]]
        # its cast moved with it
        assert order[gathers[i].args[0]] < order[gathers[i]]
    for i in range(n):
        # waits and compute keep their order: wait i right before its matmul
        assert order[waits[i]] < order[mms[i]]
        assert i == 0 or order[mms[i - 1]] < order[waits[i]]
    # at each wait exactly `lookahead` + 1 gathers are issued and not yet waited (fewer at the end)
    for i in range(n):
        issued = sum(order[a] < order[waits[i]] for a in gathers)
        assert issued - i == min(lookahead + 1, n - i)


def test_nothing_moves_without_gathers_or_when_already_ahead():
    gm, *_ = _fsdp_chain(2)
    assert prefetch_all_gathers_pass(gm, lookahead=3) == 1  # both before the first wait
    assert prefetch_all_gathers_pass(gm, lookahead=3) == 0
    gm, *_ = _fsdp_chain(12)
    prefetch_all_gathers_pass(gm, lookahead=3)
    assert prefetch_all_gathers_pass(gm, lookahead=3) == 0  # a second run finds them in place


def test_each_reduce_scatter_shard_reaches_its_readers_through_one_barrier():
    """`fence_reduce_scatters_pass` (issue 54): a gradient's waited reduce-scatter, read by the
    gradient norm and the update, is read by both through one optimization barrier that holds the
    shard alone; a reduce-scatter whose wait nobody reads is left alone."""
    import operator

    from trainer.graph.passes import fence_reduce_scatters_pass
    from trainer.graph.remat import OPTIMIZATION_BARRIER

    g = fx.Graph()
    grads = [g.placeholder(f"g{i}") for i in range(3)]
    waits, readers = [], []
    for i, grad in enumerate(grads):
        up = g.call_function(torch.ops.prims.convert_element_type.default, (grad, torch.float32))
        rs = g.call_function(_ops.reduce_scatter_tensor.default, (up, "sum", 4, "0"))
        wait = g.call_function(_ops.wait_tensor.default, (rs,))
        waits.append(wait)
        if i < 2:  # the third one's shard is read by nobody
            norm = g.call_function(torch.ops.aten.mul.Tensor, (wait, wait))
            update = g.call_function(torch.ops.aten.add.Tensor, (wait, norm))
            readers.append((norm, update))
    g.output(tuple(r[1] for r in readers))
    gm = fx.GraphModule(torch.nn.Module(), g)
    assert fence_reduce_scatters_pass(gm) == 2
    gm.graph.lint()
    for wait, (norm, update) in zip(waits, readers):
        (item,) = set(norm.all_input_nodes) & set(update.all_input_nodes) - {norm}
        assert item.target is operator.getitem and item.args[1] == 0
        barrier = item.args[0]
        assert barrier.target is OPTIMIZATION_BARRIER and barrier.args == ([wait],)
        assert list(wait.users) == [barrier]  # nothing reads the shard but the barrier
    assert not waits[2].users
    assert sum(n.target is OPTIMIZATION_BARRIER for n in gm.graph.nodes) == 2
