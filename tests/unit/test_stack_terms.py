"""What a `BlockStack` keeps between its forward and the pops (models/common/stack.py `_last`).

A graph step runs the stack once per accumulation micro-batch inside one traced program and pops
the aux loss and the expert loads after each forward. With layer scan, Dynamo lost the second
forward's assignment when they were module attributes reset to None by the pop: the second pop
read None (or the first forward's value), so graph mode + layer scan + MoE + gradient
accumulation failed to capture. Toy blocks returning `(h, aux, load)` keep this test small.
"""

from __future__ import annotations

import torch
from torch import nn

from models.common.stack import BlockStack


class _Toy(nn.Module):
    """A block with an aux term and a load [4], as an MoE block returns them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, h: torch.Tensor):
        h = torch.tanh(self.w(h))
        return h, h.square().mean(), h.abs().sum((0, 1))


def _stack(seed: int) -> BlockStack:
    torch.manual_seed(seed)
    return BlockStack(_Toy() for _ in range(3))


def _two_forwards(stack: BlockStack, inputs: list[torch.Tensor]):
    out = []
    for x in inputs:
        h = stack(x)
        out.append((h, stack.pop_aux_loss(), stack.pop_expert_load()))
    return out


def test_two_scanned_forwards_in_one_program_each_pop_their_own_terms():
    inputs = [torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    loop, scanned = _stack(0), _stack(0)
    want = _two_forwards(loop, inputs)
    scanned.enable_scan()
    torch._dynamo.reset()
    got = torch.compile(_two_forwards, fullgraph=True, backend="eager")(scanned, inputs)
    assert not torch.equal(want[0][1], want[1][1])  # the two forwards' terms differ
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            # fp32, the same ops per block; the scan sums the stacked aux terms after the loop
            # instead of as it goes: a few ulps.
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # Popped once: nothing is left for the next program to find.
    assert scanned.pop_aux_loss() is None and scanned.pop_expert_load() is None


def test_forget_drops_unpopped_terms():
    stack = _stack(0)
    stack(torch.randn(1, 2, 4))
    stack.forget()
    assert stack.pop_aux_loss() is None and stack.pop_expert_load() is None
