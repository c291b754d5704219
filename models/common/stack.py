"""`BlockStack`: the repeated decoder blocks of a model, run in order.

It is an `nn.ModuleDict` keyed "0".."n-1", so parameter names (`layers.3.attention.wq.weight`)
match TorchTitan checkpoints and parallel plans. Blocks take a fixed tuple of tensors
`(h, *args)` and return the new `h`; they never know how the stack runs them, so a scan over
stacked weights can later replace the Python loop here without touching any block.
"""

from collections.abc import Iterable

import torch
from torch import nn


class BlockStack(nn.ModuleDict):
    """Decoder blocks keyed "0".."n-1"; `forward(h, *args)` applies them in order."""

    def __init__(self, blocks: Iterable[nn.Module]):
        super().__init__({str(i): block for i, block in enumerate(blocks)})

    def forward(self, h: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
        for block in self.values():
            h = block(h, *args)
        return h
