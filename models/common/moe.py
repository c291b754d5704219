"""Mixture-of-experts feed-forward: token-choice top-k router, grouped SwiGLU experts.

Routing (Qwen 3 MoE / Hugging Face numerics): router logits -> softmax in float32 -> top-k
experts per token; with `norm_topk_prob` the k weights are renormalised to sum to 1. Routing is
**dropless**: there is no capacity factor, every token reaches all of its k experts however
unbalanced the routing is (expert batches have variable size, including zero).

The split of work matches what expert parallelism needs:
- `MoE` routes, sorts token copies by expert, calls the experts, and combines their outputs;
- `GroupedExperts.forward(x, num_tokens_per_expert)` is pure compute on tokens already sorted by
  expert, so an expert-parallel wrapper can all-to-all tokens in before it and back after it.

Auxiliary loss: `MoE.forward` returns `(out, aux_loss)`, the layer's load-balancing loss being
a 0-dim float32 tensor in the autograd graph. It is an output, not state left on the module, so
the layer runs unchanged inside a layer scan (the scan body returns it as a per-layer output;
models/common/stack.py). The block passes it up, the `BlockStack` sums it over layers and the
model hands the sum out once (`Decoder.pop_aux_loss()`); the trainer scales it by
`training.aux_loss_coef` and adds it.
It is the **global-batch** load-balancing loss (Qwen's "global-batch LBL", as in Qwen 3): the
expert frequencies `f_i` count the routed tokens of the whole global micro-batch, summed over
every rank by `reduce_counts` (set by parallelisms/ when several ranks see different tokens;
None in one process), while the router probabilities `P_i` stay per rank. The data-parallel
mean of the rank losses is then `E * sum_i f_i * P_i` over the global micro-batch, the same
value and gradient as one process on that batch, whatever the mesh.
"""

from collections.abc import Callable


import torch
import torch.nn.functional as F
from torch import nn
from models.common import ops
from models.common.init import trunc_normal_


def load_balance_loss(
    router_logits: torch.Tensor, num_tokens_per_expert: torch.Tensor, num_experts: int,
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss for one layer, as Hugging Face computes it.

    `num_experts * sum_i f_i * P_i` where `f_i` = (token copies routed to expert i) / (tokens),
    so the `f_i` sum to top_k, and `P_i` = mean router probability of expert i. Only `P_i`
    carries gradient. Perfectly balanced routing gives `top_k`. With `reduce_counts` (a sum over
    the ranks holding the other tokens of the global batch) `f_i` is the global frequency.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    counts = num_tokens_per_expert.float()
    # From `counts` (not torch.tensor(...)): under torch.compile on meta tensors (the recipe check)
    # a tensor built from a Python number is a real meta tensor, not a traced one.
    num_tokens = counts.new_full((), float(router_logits.shape[0]))
    if reduce_counts is not None:
        # One all-reduce of E + 1 numbers: the global counts and the global token count.
        both = reduce_counts(torch.cat([counts, num_tokens.reshape(1)]))
        counts, num_tokens = both[:-1], both[-1]
    frac_tokens = counts / num_tokens
    mean_probs = probs.mean(dim=0)
    return num_experts * torch.sum(frac_tokens * mean_probs)


class TokenChoiceTopKRouter(nn.Module):
    """Scores each token against every expert with `gate` and keeps the top k experts."""

    def __init__(self, *, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in [1, num_experts={num_experts}]"
        self.gate = nn.Linear(dim, num_experts, bias=False)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (top_scores [N, k] in x.dtype, selected_experts [N, k] int64, logits [N, E])."""
        router_logits = self.gate(x)
        probs = torch.softmax(router_logits.float(), dim=-1)
        top_scores, selected_experts = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_scores = top_scores / top_scores.sum(dim=-1, keepdim=True)
        return top_scores.to(x.dtype), selected_experts, router_logits


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked weights, applied as grouped GEMMs.

    w1 (gate) and w3 (up): [E, hidden_dim, dim]; w2 (down): [E, dim, hidden_dim] — each expert's
    slice has the layout of an `nn.Linear` weight.
    """

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int):
        super().__init__()
        self.num_experts = num_experts
        self.w1 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        # Like nn.Linear, never hold uninitialised memory when built on a real device; the real
        # scheme is init_weights(). (normal_, unlike trunc_normal_'s rejection loop, also runs
        # under FakeTensorMode.)
        for w in (self.w1, self.w2, self.w3):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """x [N, dim], rows sorted by expert; num_tokens_per_expert [E] (sums to <= N) -> [N, dim].

        E is the number of local experts (`w1.shape[0]`), so an expert-parallel shard works as is.
        Rows past the counts' sum are padding (the static EP dispatch's worst-case buffer): no
        expert computes them and their outputs are unspecified (the caller masks them).
        """
        # Three grouped matmuls through the op seam (models/common/ops.py): torch._grouped_mm or
        # an exact masked fallback by default, megablox gmm on TPU. The counts stay on the device,
        # so the layer traces into one program whatever the routing.
        w1, w2, w3 = self.w1, self.w2, self.w3
        gate = ops.grouped_mm(x, w1.transpose(-2, -1), num_tokens_per_expert)
        up = ops.grouped_mm(x, w3.transpose(-2, -1), num_tokens_per_expert)
        return ops.grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), num_tokens_per_expert)

    def init_weights(self, init_std: float) -> None:
        """w1: truncated normal std 0.02; w2, w3: std `init_std` (TorchTitan's expert init)."""
        trunc_normal_(self.w1, std=0.02)
        trunc_normal_(self.w2, std=init_std)
        trunc_normal_(self.w3, std=init_std)


class MoE(nn.Module):
    """Dropless token-choice top-k MoE layer (no shared experts), as in Qwen 3 MoE."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.router = TokenChoiceTopKRouter(
            dim=dim, num_experts=num_experts, top_k=top_k, norm_topk_prob=norm_topk_prob
        )
        self.experts = GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        # Sums expert counts over the ranks holding the rest of the global batch (parallelisms/).
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [bs, seq, dim] -> (out [bs, seq, dim], load-balancing loss: 0-dim float32)."""
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)
        top_scores, selected_experts, router_logits = self.router(x)
        num_experts, top_k = self.router.num_experts, self.router.top_k

        flat_experts = selected_experts.reshape(-1)  # [N * k] token copies ("slots")
        # A fixed-size count (not bincount) keeps shapes static for compile and XLA.
        num_tokens_per_expert = torch.zeros(
            num_experts, dtype=torch.int64, device=x.device
        ).scatter_add_(0, flat_experts, torch.ones_like(flat_experts))
        aux_loss = load_balance_loss(router_logits, num_tokens_per_expert, num_experts, self.reduce_counts)

        # Sort slots by expert; stable keeps token order within each expert's batch.
        order = torch.argsort(flat_experts, stable=True)
        routed_out = self.experts(x[order // top_k], num_tokens_per_expert)
        # Undo the sort with a gather (deterministic, unlike a scatter-add), weight, sum over k.
        inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
        routed_out = routed_out[inverse].view(-1, top_k, dim)
        out = (routed_out * top_scores.unsqueeze(-1)).sum(dim=1)
        return out.view(bs, seqlen, dim), aux_loss

    def init_weights(self, init_std: float) -> None:
        """Router gate: truncated normal std `init_std`; experts: see `GroupedExperts.init_weights`."""
        trunc_normal_(self.router.gate.weight, std=init_std)
        self.experts.init_weights(init_std)
