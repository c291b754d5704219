"""The sink splash's price with a sliding window (titan_kernels/tpu/capture.py `visited_blocks`,
`sink_cost`; tools/tpu_compile_capture.py `kernel_model`, the FLOPs the projection adds to the
compiler's counts; issue 54).

gpt-oss's sliding blocks run splash with a `LocalMask` (query i sees keys i - W < j <= i), whose
mask info skips every block without a visible key; before, every sink call was priced at the causal
grid, (n + 1) / 2 blocks per query block row instead of about W / block + 1.

- `visited_blocks` equals a brute-force count of the blocks holding a visible key (mask built
  element by element) over grids, blocks and windows around the block size (below, at, between
  two blocks, past the sequence).
- A captured step with gpt-oss's window (a tensor: the sliding or the causal kernel per call,
  priced at their mean) and DeepSeek-V4's (an int: always the sliding kernel) carries those
  prices; the old causal price fails it.

Shapes only (fake tensors, `make_fx`): no jax, no compile.
"""

from __future__ import annotations

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from models.common import ops
from titan_kernels.tpu import capture

B, HQ, HKV, D = 1, 4, 2, 64


@pytest.fixture
def installed():
    capture.install()
    yield
    for op in (*ops.OPS, *ops.LOW_PRECISION_OPS):  # what capture.install() serves
        ops.register(op, None)


def _brute(n: int, block: int, window: int) -> int:
    s = n * block
    i = torch.arange(s)[:, None]
    j = torch.arange(s)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    return int(visible.reshape(n, block, n, block).any(dim=(1, 3)).sum())


@pytest.mark.parametrize("n, block", [(1, 8), (5, 8), (8, 4)])
@pytest.mark.parametrize("window", [0, 1, 3, 4, 5, 8, 9, 17, 100])
def test_visited_blocks_are_the_blocks_with_a_visible_key(n, block, window):
    assert capture.visited_blocks(n, block, window) == _brute(n, block, window)


def test_a_gpt_oss_sliding_layer_costs_its_window_not_the_causal_grid():
    """gpt-oss's window 128 at 8,192 tokens, blocks of 512 (16 per row): a query block row reaches
    back 127 keys, into the block before: 1 + 2 x 15 = 31 blocks of the causal grid's 136."""
    q = (B, HQ, 8192, D)
    assert capture.visited_blocks(16, 512, 128) == 31
    for backward in (False, True):
        causal = capture.splash_cost(q, HKV, 2, backward, forward_again=False)
        sliding = capture.sink_cost(q, HKV, 2, backward, D, 128, static=True)
        assert sliding[0] == pytest.approx(causal[0] * 31 / 136, rel=1e-12)
        mean = capture.sink_cost(q, HKV, 2, backward, D, 128)
        assert mean[0] == pytest.approx((31 + 136) / 2 / 136 * causal[0], rel=1e-12)
        assert capture.sink_cost(q, HKV, 2, backward, D, 0) == causal  # no window: the causal kernel


def test_the_captured_sink_calls_carry_the_window_price(installed):
    """One sink call with gpt-oss's window tensor (the kernel picked on the device: the mean of
    the sliding and the causal price) and one with an int window (made in the graph by `full`:
    the sliding price), 2,048 tokens, blocks of 512 (n = 4), window 128: causal 10 blocks,
    sliding 1 + 2 + 2 + 2 = 7."""
    from tools.tpu_compile_capture import kernel_model

    s, w = 2048, 128

    def step(q, k, v, sinks, window):  # the window an input of the program, as gpt-oss's buffer
        gpt_oss = ops.sink_attention(q, k, v, sinks, window, sliding_window=w)
        v4 = ops.sink_attention(q, k, v, sinks, w)
        return torch.autograd.grad(gpt_oss.float().sum() + v4.float().sum(), [q, k, v, sinks])

    args = [torch.randn(B, HQ, s, D), torch.randn(B, HKV, s, D), torch.randn(B, HKV, s, D), torch.randn(HQ)]
    graph = make_fx(step, tracing_mode="fake")(*[a.requires_grad_(True) for a in args], torch.tensor(w))
    cost = kernel_model(graph, "v6e")
    assert cost["sink_fwd"]["calls"] == 2 and cost["sink_bwd"]["calls"] == 2
    per_block = 2.0 * B * HQ * 512 * 512  # one block's FLOPs per unit of width
    blocks = (7 + 10) / 2 + 7
    assert cost["sink_fwd"]["flops"] == per_block * blocks * (D + D)
    assert cost["sink_bwd"]["flops"] == per_block * blocks * (3 * D + 2 * D)
    assert cost["sink_fwd"]["flops"] < per_block * 2 * 10 * (D + D)  # the causal price, before
