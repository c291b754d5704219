"""SwiGLU feed-forward block: `w2(silu(w1 x) * w3 x)` (w1 gate, w3 up, w2 down)."""

import torch
import torch.nn.functional as F
from torch import nn

from models.common.init import trunc_normal_


class FeedForward(nn.Module):
    """Dense SwiGLU MLP without biases."""

    def __init__(self, *, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:
        """w1, w3: truncated normal std 0.02; w2 (the output projection): std `init_std`."""
        trunc_normal_(self.w1.weight, std=0.02)
        trunc_normal_(self.w3.weight, std=0.02)
        trunc_normal_(self.w2.weight, std=init_std)
