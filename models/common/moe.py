"""Mixture-of-experts feed-forward: token-choice top-k router, grouped SwiGLU experts.

Routing (Qwen 3 MoE / Hugging Face numerics): router logits -> softmax in float32 -> top-k
experts per token; with `norm_topk_prob` the k weights are renormalised to sum to 1. By default
routing is **dropless**: every token reaches all of its k experts however unbalanced the routing
is (expert batches have variable size, including zero).

Capacity-bounded dispatch (`use_capacity(model, factor)`, `[moe] capacity_factor`;
docs/moe.md#capacity-factor): each expert takes at most `capacity = min(seq, ceil(factor * seq
* k / E))` token copies **per sequence**, the GShard-style group being one sequence, so which
copies are dropped depends on that sequence's routing only, never on how the batch is split over
ranks (the same copies drop on 1, EP 2 or EP 4 ranks). Within a (sequence, expert) group the
copies are kept in order of their choice rank (every token's first choice before any second
choice), then of position; the copies past the capacity contribute nothing (the token's other
experts and the residual still carry it, as in Switch / GShard). The kept copies are laid out in
an `[E, batch x capacity, dim]` buffer (zeros in unused slots), the experts run dense batched
matmuls over it (`GroupedExperts.forward_capacity`; under EP one equal-split all-to-all each way
of exactly that buffer), each output row is multiplied by its copy's router weight where the
expert computed it (`weighted_capacity`; under EP on the expert's rank, so full AC's recompute needs
no all-to-all back), and the combine gathers each kept copy's row back and sums over k: every pass
touches `E x batch x capacity ~ factor x tokens x k` rows, never the `ep x tokens x k` worst case of
the dropless static dispatch. The layer's load output then has one more entry, the copies it dropped.

The split of work matches what expert parallelism needs:
- `MoE` routes, sorts token copies by expert, calls the experts, and combines their outputs;
- `GroupedExperts.forward(x, num_tokens_per_expert)` is pure compute on tokens already sorted by
  expert, so an expert-parallel wrapper can all-to-all tokens in before it and back after it.

Options for DeepSeek-V3 (and Kimi K2), all off by default so Qwen 3 MoE computes exactly what it
did: `score_func="sigmoid"` (per-expert sigmoid scores; the k selected scores are renormalised
with `norm_topk_prob`), group-limited selection (`num_groups` groups of experts, each scored by
the sum of its two best experts; only experts of the `top_groups` best groups are eligible),
`route_scale` (the routed scaling factor, multiplying the k weights), shared experts
(`shared_hidden_dim > 0`: a dense SwiGLU every token goes through, added to the routed output),
auxiliary-loss-free load balancing (`expert_bias=True`) and the sequence-wise auxiliary loss
(`aux_loss="sequence"`).

Option for Qwen 3.5 MoE (off by default): `shared_gate=True`, the shared expert's output scaled per
token by `sigmoid(shared_gate(x))` (a linear dim -> 1) before it is added.

Options for DeepSeek-V4 (off by default): `score_func="sqrtsoftplus"` (per-expert `sqrt(softplus)`
scores, renormalised over the k with DeepSeek's epsilon), a given selection (`MoE.forward(x,
selected_experts)`: hash routing, where a frozen token -> experts table chooses and the router's
scores only weight) and experts with their own activation (`GroupedExperts.act`, overridden by
models/deepseek_v4/model.py for the clamped SwiGLU).

Options for gpt-oss (off by default): `gate_bias=True` (a learned bias in the router logits, so
in the selection and in the weights) and `experts=` a family's own experts module with the
experts' contract of `GroupedExperts` below (models/gpt_oss/model.py: per-expert biases, the clamped
SwiGLU, transformers' layout), which expert parallelism and layer scan take as they are.

Auxiliary-loss-free load balancing (DeepSeek-V3, section 2.1.2): the router holds a persistent
float32 buffer `expert_bias` [E] (zeros at start; in checkpoints, as DeepSeek's
`e_score_correction_bias`) that is added to the scores for the **selection** of the k experts
only; the weights that multiply the expert outputs are the unbiased scores. After each
optimizer step the trainer (trainer/optim/expert_balance.py) sums every layer's load over the ranks
and calls `update_expert_bias(global_load, rate)`, which moves each expert's bias by `rate`
towards balance (down for experts above the mean load, up for those below).

Expert load: `MoE.forward` returns `(out, aux_loss, load)`, `load` [E] float32 being the token
copies the layer routed to each expert (no gradient; under a capacity, [E + 1] with the copies
dropped last). Like the aux loss it is an output, not
state on the module, so it leaves a compiled step and a layer scan (a per-layer scan output)
the same way it leaves an eager forward; the `BlockStack` stacks it over layers
(`pop_expert_load()`). float32 holds the counts exactly up to 2^24 copies per expert and
step; above that the relative rounding (6e-8) only matters to an expert within one copy of
the mean, where the sign of the bias step is arbitrary anyway.

Benchmark routing (`TokenChoiceTopKRouter.use_routing`; docs/moe.md#benchmark-routing): "learned"
(the default, everything above), "random" (the router's scores replaced, for the **selection**
only, by a seeded hash of (key, token, expert): k distinct experts per token, uniformly) and
"balanced" (token t goes to experts `t*k ... t*k + k-1` modulo E: round-robin, every expert the
same count). The selection ignores groups and `expert_bias`. As in MaxText's random routing the
router still runs and the weights that multiply the expert outputs are the router's own scores
at the chosen experts (renormalised and scaled as learned routing does), so the router, the
combine and the backward cost what they cost under learned routing and the gate still gets a
gradient. The draw reads no global state: the trainer writes the router's `routing_key` buffer
([key of (seed, step, layer), index of this rank's first token in the step's global batch],
`set_routing_key`) before each step, so a token's experts depend on the seed, the step, the layer
and the token's place in the global batch, never on the mesh.

Auxiliary loss: `MoE.forward` returns `aux_loss`, the layer's load-balancing loss being
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

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from models.common import ops
from models.common.feed_forward import FeedForward
from models.common.init import trunc_normal_


def load_balance_loss(
    router_logits: torch.Tensor,
    num_tokens_per_expert: torch.Tensor,
    num_experts: int,
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


def sequence_balance_loss(
    scores: torch.Tensor,
    selected_experts: torch.Tensor,
    num_experts: int,
    reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """DeepSeek-V3's sequence-wise balance loss (eq. 17-20, without its factor alpha, which is
    `training.aux_loss_coef`), averaged over the sequences of the batch.

    scores [bs, seq, E] (the affinities, sigmoid or softmax), selected_experts [bs, seq, k].
    Per sequence: `sum_i f_i * P_i` with `f_i = E / (k * seq) * (copies routed to i)` and `P_i`
    the mean over the sequence of the scores normalised to sum to 1 per token. Perfect balance
    gives 1. Only `P_i` carries gradient.

    When each rank holds an equal shard of every sequence (context parallelism, or the MoE on
    TP's sequence shards), `reduce_counts` sums the per-sequence counts and lengths over the
    ranks sharing the sequences, so `f_i` is the whole sequence's; `P_i` stays the shard's mean,
    and the trainer's mean over those ranks (their gradients are averaged) makes it the
    sequence's mean: the same value and gradient as one process on whole sequences.
    """
    bs, seqlen, top_k = selected_experts.shape
    counts = torch.zeros(bs, num_experts, dtype=torch.float32, device=scores.device).scatter_add_(
        1, selected_experts.reshape(bs, -1), torch.ones(bs, seqlen * top_k, dtype=torch.float32, device=scores.device)
    )
    # From `counts` (not a Python number), as in load_balance_loss.
    length = counts.new_full((1,), float(seqlen))
    if reduce_counts is not None:
        # One all-reduce of bs x E + 1 numbers: the sequences' counts and their whole length.
        both = reduce_counts(torch.cat([counts.reshape(-1), length]))
        counts, length = both[:-1].view(bs, num_experts), both[-1:]
    frac = counts * (num_experts / top_k) / length
    scores = scores.float()
    probs = (scores / scores.sum(dim=-1, keepdim=True)).mean(dim=1)
    return (frac * probs).sum(dim=-1).mean()


ROUTINGS = ("learned", "random", "balanced")
"""`[moe] routing`: the router's own choice, a seeded random draw, or round-robin (benchmarks only)."""

_MASK31 = 0x7FFFFFFF


def _mix31(x):
    """A 31-bit integer hash (xorshift-multiply rounds), on Python ints or integer tensors alike.

    Inputs are reduced to their low 31 bits and outputs lie in [0, 2^31), so every value and
    constant fits a signed 32-bit integer: the same bits come out of int64 (CPU, CUDA) and of
    int32 (XLA, whose torchax runs without 64-bit types). A product of two values below 2^31 is
    exact in int64 and wraps mod 2^32 in int32; its low 31 bits, all the mask keeps, agree. Right
    shifts only ever see non-negative values. Each round is a bijection of [0, 2^31).
    """
    x = x & _MASK31
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK31
    x = x ^ (x >> 15)
    x = (x * 0x5BD1E995) & _MASK31
    return x ^ (x >> 16)


def routing_key(*, seed: int, step: int, layer: int) -> int:
    """The per-(seed, step, layer) key of the random routing draw (a Python int in [0, 2^31), so
    the int64 `routing_key` buffer holds it unchanged where a device runs it as int32)."""
    return _mix31(_mix31(_mix31(seed) ^ step) ^ (layer * 0x3C6EF372 & _MASK31))


def random_experts(key: torch.Tensor, tokens: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """k distinct experts per token, uniformly at random: the top k of a hash of (key, token,
    expert). `key`: 0-dim integer tensor in [0, 2^31); `tokens` [N] global token indices (int64,
    or int32 as on XLA; below 2^31) -> [N, k] int64.

    The expert index replaces the low `bits` of the 31-bit hash (`bits` = what E - 1 needs), so
    no two experts of a token tie, every sort key stays below 2^31 (int32-safe) and `topk` picks
    the same experts on every backend. The order comes from the hash's top 31 - bits bits (22 at
    E = 384): two experts of a token share them with probability 2^-(31 - bits), and only then
    does the index decide.
    """
    bits = max(1, (num_experts - 1).bit_length())
    assert bits <= 24, f"random routing: {num_experts} experts leave under 7 bits of the 31-bit hash"
    per_token = _mix31(_mix31(tokens) ^ key)
    experts = torch.arange(num_experts, device=tokens.device, dtype=tokens.dtype)
    draw = _mix31(per_token.unsqueeze(1) ^ ((experts * 0x61C88647) & _MASK31))
    return torch.topk((draw & (_MASK31 ^ ((1 << bits) - 1))) | experts, top_k, dim=-1).indices


def balanced_experts(tokens: torch.Tensor, num_experts: int, top_k: int) -> torch.Tensor:
    """Round-robin: token t -> experts (t*k + j) mod E, j < k (distinct when k <= E); over any run
    of consecutive tokens whose copies are a multiple of E, every expert gets the same count."""
    slots = tokens.unsqueeze(1) * top_k + torch.arange(top_k, device=tokens.device)
    return slots % num_experts


def expert_capacity(*, seq_len: int, top_k: int, num_experts: int, factor: float) -> int:
    """Token copies one expert takes from one sequence: `min(seq_len, ceil(factor * seq_len * k / E))`
    (a token reaches an expert at most once, so `seq_len` is a capacity nothing exceeds)."""
    assert factor > 0, f"capacity factor {factor} must be > 0"
    return min(seq_len, math.ceil(factor * seq_len * top_k / num_experts))


def capacity_slots(selected_experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """Where each token copy goes in the `[E, batch, capacity]` buffer; `E * batch * capacity` if dropped.

    `selected_experts` [batch, seq, k] -> [batch * seq * k] int64 in the copies' order (token-major,
    as `selected_experts.reshape(-1)`). Per (sequence, expert) group the copies are ranked by choice
    rank, then position (a stable sort on the key (sequence, expert, choice rank)); a copy ranked
    `pos < capacity` takes slot `pos` of its group. Static shapes, no host read.
    """
    bs, seqlen, top_k = selected_experts.shape
    device = selected_experts.device
    seq = torch.arange(bs, device=device).view(bs, 1, 1)
    choice = torch.arange(top_k, device=device).view(1, 1, top_k)
    group = (seq * num_experts + selected_experts).reshape(-1)  # (sequence, expert)
    key = (group * top_k + choice.expand(bs, seqlen, top_k).reshape(-1)) if top_k > 1 else group
    order = torch.argsort(key, stable=True)
    sizes = torch.zeros(bs * num_experts, dtype=torch.int64, device=device).scatter_add_(
        0, group, torch.ones_like(group)
    )
    starts = torch.cumsum(sizes, 0) - sizes
    rank_sorted = torch.arange(order.numel(), device=device) - starts[group[order]]
    pos = torch.empty_like(order).scatter_(0, order, rank_sorted)
    expert, b = group % num_experts, group // num_experts
    dump = num_experts * bs * capacity
    return torch.where(pos < capacity, (expert * bs + b) * capacity + pos, dump)


class TokenChoiceTopKRouter(nn.Module):
    """Scores each token against every expert with `gate` and keeps the top k experts.

    Defaults are Qwen 3 MoE's (softmax, one group, scale 1, no bias); the other options are
    DeepSeek-V3's (module docstring).
    """

    def __init__(
        self,
        *,
        dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        score_func: str = "softmax",
        num_groups: int = 1,
        top_groups: int = 1,
        route_scale: float = 1.0,
        expert_bias: bool = False,
        gate_bias: bool = False,
    ):
        super().__init__()
        assert 1 <= top_k <= num_experts, f"top_k {top_k} must be in [1, num_experts={num_experts}]"
        assert score_func in ("softmax", "sigmoid", "sqrtsoftplus"), f"score_func {score_func!r}"
        assert num_experts % num_groups == 0 and 1 <= top_groups <= num_groups, (num_experts, num_groups, top_groups)
        assert num_groups == 1 or num_experts // num_groups >= 2, "a group scores by its two best experts"
        # gpt-oss's router has a learned bias in its logits (`gate_bias`); the others have none.
        self.gate = nn.Linear(dim, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.top_k = top_k
        self.norm_topk_prob = norm_topk_prob
        self.score_func = score_func
        self.num_groups = num_groups
        self.top_groups = top_groups
        self.route_scale = route_scale
        if expert_bias:
            # Selection-only bias (persistent: checkpoints hold it).
            self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.expert_bias = None
        # Benchmark routing (module docstring); learned routing registers no `routing_key`, so
        # its module tree, state dict and captured graphs are what they were.
        self.routing = "learned"

    def use_routing(self, routing: str) -> None:
        """Route by `routing` (one of ROUTINGS) from now on. "random" and "balanced" register the
        non-persistent int64 buffer `routing_key` [2] (key, first global token index), which
        `set_routing_key` writes before each step. Call it on the model as built (before
        parallelisms, layer scan and materialization: the buffer then travels like any other)."""
        assert routing in ROUTINGS, f"routing {routing!r}; allowed: {', '.join(ROUTINGS)}"
        self.routing = routing
        if routing != "learned" and "routing_key" not in self._buffers:
            self.register_buffer(
                "routing_key", torch.zeros(2, dtype=torch.int64, device=self.gate.weight.device), persistent=False
            )

    def synthetic_experts(self, num_tokens: int, device: torch.device) -> torch.Tensor:
        """The experts [N, k] that "random" or "balanced" routing picks for this rank's N tokens."""
        tokens = self.routing_key[1] + torch.arange(num_tokens, device=device)
        if self.routing == "balanced":
            return balanced_experts(tokens, self.num_experts, self.top_k)
        return random_experts(self.routing_key[0], tokens, self.num_experts, self.top_k)

    def scores(self, router_logits: torch.Tensor) -> torch.Tensor:
        """Router logits -> float32 affinities (softmax over experts, or per-expert sigmoid or sqrt(softplus))."""
        if self.score_func == "sigmoid":
            return torch.sigmoid(router_logits.float())
        if self.score_func == "sqrtsoftplus":
            return F.softplus(router_logits.float()).sqrt()
        return torch.softmax(router_logits.float(), dim=-1)

    def forward(
        self, x: torch.Tensor, selected_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, dim] -> (top_scores [N, k] in x.dtype, selected_experts [N, k] int64, logits [N, E]).
        `selected_experts` [N, k] given (hash routing): the choice is that, the weights the scores at it."""
        router_logits = self.gate(x)
        probs = self.scores(router_logits)
        if selected_experts is not None:
            top_scores = probs.gather(1, selected_experts)
        elif self.routing != "learned":
            # Benchmark routing: the choice is synthetic, the weights the router's own (docstring).
            selected_experts = self.synthetic_experts(x.shape[0], x.device)
            top_scores = probs.gather(1, selected_experts)
        elif self.expert_bias is None and self.num_groups == 1:
            top_scores, selected_experts = torch.topk(probs, self.top_k, dim=-1)
        else:
            choice = probs if self.expert_bias is None else probs + self.expert_bias
            if self.num_groups > 1:
                # Group-limited routing: keep the experts of the `top_groups` groups whose two
                # best (biased) scores sum highest.
                grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
                group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
                top_group_idx = group_scores.topk(self.top_groups, dim=-1).indices
                keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_group_idx, True)
                choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, self.num_experts)
            selected_experts = torch.topk(choice, self.top_k, dim=-1).indices
            top_scores = probs.gather(1, selected_experts)
        if self.norm_topk_prob:
            denom = top_scores.sum(dim=-1, keepdim=True)
            # DeepSeek's epsilon guards sigmoid scores that underflow; softmax keeps Qwen's exact division.
            top_scores = top_scores / (denom if self.score_func == "softmax" else denom + 1e-20)
        if self.route_scale != 1.0:
            top_scores = top_scores * self.route_scale
        return top_scores.to(x.dtype), selected_experts, router_logits

    @torch.no_grad()
    def update_expert_bias(self, global_load: torch.Tensor, rate: float | torch.Tensor) -> None:
        """Auxiliary-loss-free balancing step (DeepSeek-V3): `expert_bias += rate * sign(mean -
        load)` per expert, so overloaded experts become less likely to be selected and
        underloaded ones more (a balanced expert keeps its bias).

        `global_load` [E]: the token copies each expert received in the step, summed over every
        rank that routes its own tokens (trainer/optim/expert_balance.py); `rate` is DeepSeek's gamma
        (0.001 in their training), a float or a 0-dim tensor (0 where a skipped step must not
        move the bias). The bias stays float32 (a bf16 bias could not hold 0.001 steps).
        """
        assert self.expert_bias is not None, "update_expert_bias: this router has no expert_bias"
        load = global_load.to(device=self.expert_bias.device, dtype=torch.float32)
        self.expert_bias.add_(torch.sign(load.mean() - load) * rate)


def use_routing(model: nn.Module, routing: str) -> int:
    """Set every router of `model` to `routing` (see `TokenChoiceTopKRouter.use_routing`), numbering
    them in module order (the layer index of the draw's key); returns how many there are."""
    routers = [m for m in model.modules() if isinstance(m, TokenChoiceTopKRouter)]
    for layer, router in enumerate(routers):
        router.use_routing(routing)
        router.routing_layer = layer
    return len(routers)


def use_capacity(model: nn.Module, factor: float, *, chunks: int = 1) -> int:
    """Give every MoE layer of `model` the capacity-bounded dispatch with `factor` (> 0), or the
    dropless one (0), its buffer sent over EP in `chunks` chunks (`GroupedExperts.dispatch_chunks`);
    returns how many layers there are. Call it on the model as built."""
    assert factor >= 0, f"capacity factor {factor} must be >= 0"
    assert chunks >= 1, f"dispatch chunks {chunks} must be >= 1"
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    for layer in layers:
        layer.capacity_factor = float(factor)
        layer.experts.dispatch_chunks = int(chunks)
    return len(layers)


@torch.no_grad()
def set_routing_key(model: nn.Module, *, seed: int, step: int, first_token: int) -> None:
    """Before a step: write each benchmark-routed router's `routing_key` = (the key of (seed, step,
    its layer), `first_token`: the global index of this rank's first token in the step's batch,
    i.e. its first window's index times seq_len). In place, so a scanned stack's rows and a
    captured graph's inputs see it."""
    for module in model.modules():
        if isinstance(module, TokenChoiceTopKRouter) and module.routing != "learned":
            key = routing_key(seed=seed, step=step, layer=module.routing_layer)
            module.routing_key.copy_(torch.tensor([key, first_token], dtype=torch.int64))


def weighted_capacity(experts: nn.Module, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The capacity buffer through `experts`, each output row times its copy's router weight:
    x [E, rows, dim], weights [E, rows] (zero in unused slots) -> [E, rows, dim].

    The weight is applied where the expert's output is, before the combine: under expert
    parallelism on the rank that owns the expert (`forward_capacity_weighted`,
    parallelisms/expert_parallel.py), so the combine only sums and the backward needs no expert
    output on the token's rank (full AC's recompute then sends nothing back: docs/moe.md#dispatch-chunks).
    One process: `forward_capacity` times the weights, the product the combine formed before."""
    fn = getattr(experts, "forward_capacity_weighted", None)
    if fn is not None:
        return fn(x, weights)
    return experts.forward_capacity(x) * weights.unsqueeze(-1)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU MLPs stored as stacked weights, applied as grouped GEMMs.

    w1 (gate) and w3 (up): [E, hidden_dim, dim]; w2 (down): [E, dim, hidden_dim] — each expert's
    slice has the layout of an `nn.Linear` weight.
    """

    recipe: str = "none"
    """A low-precision recipe (`[quantize]`, set by parallelisms/quantize.py): the expert matmuls
    go through the op `quantized_grouped_mm` (`quantized_batched_mm` in the capacity layout)."""

    dispatch_chunks: int = 1
    """`[moe] dispatch_chunks` (set by `use_capacity`): under expert parallelism the capacity
    buffer crosses the all-to-all in this many chunks (whole sequences each when they divide the
    batch, `capacity_chunks`; rows otherwise), each chunk's send, experts and return
    independent of the others', so the compiler can run one chunk's all-to-all beside another's
    expert matmuls (parallelisms/expert_parallel.py `capacity_all_to_all`)."""

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

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The gated activation between the in- and out-projections: SwiGLU `silu(gate) * up`."""
        return F.silu(gate) * up

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
        if self.recipe != "none":
            mm = ops.quantized_grouped_mm
            r, n = self.recipe, num_tokens_per_expert
            gate, up = mm(x, w1.transpose(-2, -1), n, r), mm(x, w3.transpose(-2, -1), n, r)
            return mm(self.act(gate, up), w2.transpose(-2, -1), n, r)
        gate = ops.grouped_mm(x, w1.transpose(-2, -1), num_tokens_per_expert)
        up = ops.grouped_mm(x, w3.transpose(-2, -1), num_tokens_per_expert)
        return ops.grouped_mm(self.act(gate, up), w2.transpose(-2, -1), num_tokens_per_expert)

    def capacity_chunks(self, batch: int) -> int:
        """How many sequence chunks `MoE._capacity_experts` lays the capacity buffer out in: 1 here
        (one process has no all-to-all to overlap); the expert-parallel class answers
        `dispatch_chunks` when it divides `batch` (parallelisms/expert_parallel.py)."""
        return 1

    def forward_capacity_chunks(self, parts: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """`weighted_capacity` of each chunk of the buffer ([E, rows / chunks, dim] each, its
        weights [E, rows / chunks])."""
        return [weighted_capacity(self, part, w) for part, w in zip(parts, weights)]

    def forward_capacity(self, x: torch.Tensor) -> torch.Tensor:
        """x [E, rows, dim], row block e for expert e (the capacity dispatch's buffer) -> [E, rows, dim].

        Dense batched matmuls over every row, unused (zero) rows included: their outputs are
        zeros and no combine reads them. E is the number of local experts.
        """
        w1, w2, w3 = self.w1, self.w2, self.w3
        if self.recipe != "none":
            bmm, r = ops.quantized_batched_mm, self.recipe
            h = self.act(bmm(x, w1.transpose(-2, -1), r), bmm(x, w3.transpose(-2, -1), r))
            return bmm(h, w2.transpose(-2, -1), r)
        h = self.act(torch.bmm(x, w1.transpose(-2, -1)), torch.bmm(x, w3.transpose(-2, -1)))
        return torch.bmm(h, w2.transpose(-2, -1))

    def init_weights(self, init_std: float) -> None:
        """w1: truncated normal std 0.02; w2, w3: std `init_std` (TorchTitan's expert init)."""
        trunc_normal_(self.w1, std=0.02)
        trunc_normal_(self.w2, std=init_std)
        trunc_normal_(self.w3, std=init_std)


class MoE(nn.Module):
    """Dropless token-choice top-k MoE layer; Qwen 3 MoE by default, DeepSeek-V3 with the options.

    `aux_loss`: "load_balance" (the global-batch Switch loss, `load_balance_loss`), "sequence"
    (DeepSeek-V3's sequence-wise loss, `sequence_balance_loss`) or "none" (a zero).
    `shared_hidden_dim > 0` adds the shared experts as one SwiGLU of that width (DeepSeek's
    `n_shared_experts * moe_intermediate_size`).
    """

    def __init__(
        self,
        *,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        top_k: int,
        norm_topk_prob: bool,
        score_func: str = "softmax",
        num_groups: int = 1,
        top_groups: int = 1,
        route_scale: float = 1.0,
        expert_bias: bool = False,
        shared_hidden_dim: int = 0,
        aux_loss: str = "load_balance",
        gate_bias: bool = False,
        experts: nn.Module | None = None,
        shared_gate: bool = False,
    ):
        super().__init__()
        assert aux_loss in ("load_balance", "sequence", "none"), f"aux_loss {aux_loss!r}"
        self.router = TokenChoiceTopKRouter(
            dim=dim,
            num_experts=num_experts,
            top_k=top_k,
            norm_topk_prob=norm_topk_prob,
            score_func=score_func,
            num_groups=num_groups,
            top_groups=top_groups,
            route_scale=route_scale,
            expert_bias=expert_bias,
            gate_bias=gate_bias,
        )
        # A family's own experts (the contract of `GroupedExperts`: gpt-oss's biased, clamped
        # SwiGLU experts) replace the default SwiGLU ones.
        if experts is None:
            experts = GroupedExperts(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        assert experts.num_experts == num_experts, (experts.num_experts, num_experts)
        self.experts = experts
        if shared_hidden_dim > 0:
            self.shared_experts = FeedForward(dim=dim, hidden_dim=shared_hidden_dim)
        else:
            self.shared_experts = None
        # Qwen 3.5 MoE: the shared expert's output scaled per token by sigmoid(shared_gate(x)).
        # Only registered when on, so the other families' module trees are what they were.
        if shared_gate:
            assert shared_hidden_dim > 0, "shared_gate gates the shared experts"
            self.shared_gate = nn.Linear(dim, 1, bias=False)
        else:
            self.shared_gate = None
        self.aux_loss = aux_loss
        # Sums expert counts over the ranks holding the rest of the global batch (parallelisms/).
        self.reduce_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        # Sums per-sequence counts over the ranks holding the rest of the same sequences (cp x tp).
        self.reduce_seq_counts: Callable[[torch.Tensor], torch.Tensor] | None = None
        # `use_capacity`: 0 = dropless; > 0 = the capacity-bounded dispatch (module docstring).
        self.capacity_factor = 0.0

    def forward(
        self, x: torch.Tensor, selected_experts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [bs, seq, dim] -> (out [bs, seq, dim], auxiliary loss: 0-dim float32, load: [E] float32
        token copies routed to each expert, no gradient). `selected_experts` [bs * seq, k] int64: the
        experts of each token, chosen outside (hash routing); None: the router chooses."""
        bs, seqlen, dim = x.shape
        x = x.reshape(-1, dim)
        top_scores, selected_experts, router_logits = self.router(x, selected_experts)
        top_k = self.router.top_k

        flat_experts = selected_experts.reshape(-1)  # [N * k] token copies ("slots")
        num_tokens_per_expert = self._expert_counts(flat_experts)
        aux_loss = self._aux_loss(router_logits, selected_experts, num_tokens_per_expert, bs, seqlen)

        load = num_tokens_per_expert.float()
        if self.capacity_factor > 0:
            # Each copy's output comes back already weighted (`weighted_capacity`): sum over k.
            routed_out, dropped = self._capacity_experts(x, selected_experts.view(bs, seqlen, top_k), top_scores)
            load = torch.cat([load, dropped.float().reshape(1)])
            out = routed_out.view(-1, top_k, dim).sum(dim=1).view(bs, seqlen, dim)
        else:
            # Sort slots by expert; stable keeps token order within each expert's batch.
            order = torch.argsort(flat_experts, stable=True)
            routed_out = self.experts(x[order // top_k], num_tokens_per_expert)
            # Undo the sort with a gather (deterministic, unlike a scatter-add).
            inverse = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=x.device))
            routed_out = routed_out[inverse]
            # Weight, sum over k.
            out = (routed_out.view(-1, top_k, dim) * top_scores.unsqueeze(-1)).sum(dim=1).view(bs, seqlen, dim)
        if self.shared_experts is not None:
            out = out + self._shared(x).view(bs, seqlen, dim)
        return out, aux_loss, load

    def _expert_counts(self, flat_experts: torch.Tensor) -> torch.Tensor:
        """Token copies routed to each expert, [E] int64, from the copies' experts [N * k]. A
        fixed-size count (not bincount) keeps shapes static for compile and XLA."""
        counts = torch.zeros(self.router.num_experts, dtype=torch.int64, device=flat_experts.device)
        return counts.scatter_add_(0, flat_experts, torch.ones_like(flat_experts))

    def _shared(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared experts' output on the flat tokens [N, dim] (a per-token layer under TP, like
        the router), gated when the model gates it."""
        shared = self.shared_experts(flat)
        if self.shared_gate is not None:
            shared = torch.sigmoid(self.shared_gate(flat)) * shared
        return shared

    def block_chunks(self, batch: int) -> int:
        """How many sequence chunks the block runs this layer in (`forward_chunks`): the capacity
        dispatch's `capacity_chunks` (`[moe] dispatch_chunks` under expert parallelism, when it
        divides the batch), else 1."""
        return self.experts.capacity_chunks(batch) if self.capacity_factor > 0 else 1

    def forward_chunks(
        self, xs: list[torch.Tensor], selected_experts: torch.Tensor | None = None
    ) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """`forward` over the batch's sequence chunks xs[c] [bs_c, seq, dim] (the capacity dispatch):
        each chunk routed, dispatched, run through the experts and combined on its own, so nothing
        of chunk c waits for another chunk and the compiler can run one chunk's all-to-alls beside
        another's compute (the block's attention included: models/common/decoder.py). The same
        numbers as `forward` on the concatenated batch: routing is per token, the capacity per
        sequence, the auxiliary loss and the load are the whole batch's (from every chunk's logits
        and counts). -> ([out_c], aux_loss, load)."""
        assert self.capacity_factor > 0, "forward_chunks is the capacity dispatch's"
        seqlen, dim = xs[0].shape[1:]
        sizes = [x.shape[0] for x in xs]
        bs = sum(sizes)
        top_k = self.router.top_k
        if selected_experts is None and self.router.routing != "learned":
            # Benchmark routing draws by the token's place in the step's batch: draw for all of them.
            selected_experts = self.router.synthetic_experts(bs * seqlen, xs[0].device)
        given = selected_experts.split([b * seqlen for b in sizes]) if selected_experts is not None else None
        outs, logits, chosen, dropped = [], [], [], []
        for i, x in enumerate(xs):
            flat = x.reshape(-1, dim)
            top_scores, selected, router_logits = self.router(flat, None if given is None else given[i])
            part, drop = self._capacity_experts(flat, selected.view(sizes[i], seqlen, top_k), top_scores, chunked=False)
            out = part.view(-1, top_k, dim).sum(dim=1)
            if self.shared_experts is not None:
                out = out + self._shared(flat)
            outs.append(out.view(sizes[i], seqlen, dim))
            logits.append(router_logits)
            chosen.append(selected)
            dropped.append(drop)
        router_logits, selected_experts = torch.cat(logits), torch.cat(chosen)
        num_tokens_per_expert = self._expert_counts(selected_experts.reshape(-1))
        aux_loss = self._aux_loss(router_logits, selected_experts, num_tokens_per_expert, bs, seqlen)
        load = torch.cat([num_tokens_per_expert.float(), torch.stack(dropped).sum().float().reshape(1)])
        return outs, aux_loss, load

    def _aux_loss(
        self,
        router_logits: torch.Tensor,
        selected_experts: torch.Tensor,
        num_tokens_per_expert: torch.Tensor,
        bs: int,
        seqlen: int,
    ) -> torch.Tensor:
        """The layer's auxiliary loss (`aux_loss`: the class docstring) from its router logits and counts."""
        num_experts = self.router.num_experts
        if self.aux_loss == "load_balance":
            return load_balance_loss(router_logits, num_tokens_per_expert, num_experts, self.reduce_counts)
        if self.aux_loss == "sequence":
            return sequence_balance_loss(
                self.router.scores(router_logits).view(bs, seqlen, -1),
                selected_experts.view(bs, seqlen, -1),
                num_experts,
                self.reduce_seq_counts,
            )
        return router_logits.new_zeros((), dtype=torch.float32)

    def _capacity_experts(
        self, x: torch.Tensor, selected_experts: torch.Tensor, top_scores: torch.Tensor, *, chunked: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The capacity-bounded dispatch (module docstring): x [N, dim] flat tokens, selected_experts
        [bs, seq, k], top_scores [N, k] the copies' router weights -> (each copy's expert output times
        its weight [N * k, dim] in the copies' order, zero for a dropped copy; the number of dropped
        copies, 0-dim int64). `chunked=False`: the buffer crosses the all-to-all whole (`forward_chunks`
        sends one sequence chunk per call)."""
        bs, seqlen, top_k = selected_experts.shape
        num_experts, dim = self.router.num_experts, x.shape[-1]
        capacity = expert_capacity(seq_len=seqlen, top_k=top_k, num_experts=num_experts, factor=self.capacity_factor)
        slots = capacity_slots(selected_experts, num_experts, capacity)
        dump = num_experts * bs * capacity
        chunks = self.experts.capacity_chunks(bs) if chunked else 1
        if chunks > 1:
            # Chunk-major (`[moe] dispatch_chunks` under EP): sequence b = c * bs/k + b' goes to
            # chunk c, so each chunk is one contiguous [E, bs/k x capacity, dim] block (no copy to
            # split it); the same copies kept, only their buffer positions move.
            per = bs // chunks
            expert, row = slots // (bs * capacity), slots % (bs * capacity)
            seq, pos = row // capacity, row % capacity
            moved = ((seq // per * num_experts + expert) * per + seq % per) * capacity + pos
            slots = torch.where(slots < dump, moved, slots)
        # Gathers both ways (deterministic): each buffer slot reads its copy's token (slot `dump`
        # collects the dropped copies and is discarded; unused slots read the zero row N).
        copy = torch.arange(slots.numel(), device=x.device)
        source = torch.full((dump + 1,), x.shape[0], dtype=torch.int64, device=x.device).scatter_(
            0, slots, copy // top_k
        )
        # Each slot's router weight, gathered like its row (zero in unused slots): applied to the
        # expert's output where it is computed (`weighted_capacity`).
        weight_source = torch.full((dump + 1,), slots.numel(), dtype=torch.int64, device=x.device).scatter_(
            0, slots, copy
        )
        zero_row = x.new_zeros(1, dim)
        rows = torch.cat([x, zero_row])
        weights = torch.cat([top_scores.reshape(-1), top_scores.new_zeros(1)])
        if chunks > 1:  # one gather per chunk in, one concatenate out: no copy splits or stacks the buffer
            parts = [rows[idx].view(num_experts, -1, dim) for idx in source[:dump].view(chunks, -1)]
            part_weights = [weights[idx].view(num_experts, -1) for idx in weight_source[:dump].view(chunks, -1)]
            outs = self.experts.forward_capacity_chunks(parts, part_weights)
            return torch.cat([o.reshape(-1, dim) for o in outs] + [zero_row])[slots], (slots == dump).sum()
        buffer = rows[source[:dump]].view(num_experts, bs * capacity, dim)
        buffer_weights = weights[weight_source[:dump]].view(num_experts, bs * capacity)
        if chunked:
            out = weighted_capacity(self.experts, buffer, buffer_weights)
        else:  # one piece over the all-to-all, whatever `dispatch_chunks` says
            (out,) = self.experts.forward_capacity_chunks([buffer], [buffer_weights])
        return torch.cat([out.reshape(dump, dim), zero_row])[slots], (slots == dump).sum()

    def init_weights(self, init_std: float) -> None:
        """Router gate: truncated normal std `init_std` (its bias, `gate_bias`: zeros); experts: see
        `GroupedExperts.init_weights` (or the family's experts'); shared experts:
        `FeedForward.init_weights`; `shared_gate` (Qwen 3.5): truncated normal std 0.02; `expert_bias`: zeros."""
        trunc_normal_(self.router.gate.weight, std=init_std)
        if self.router.gate.bias is not None:
            nn.init.zeros_(self.router.gate.bias)
        self.experts.init_weights(init_std)
        if self.shared_experts is not None:
            self.shared_experts.init_weights(init_std)
        if self.shared_gate is not None:
            trunc_normal_(self.shared_gate.weight, std=0.02)
        if self.router.expert_bias is not None:
            nn.init.zeros_(self.router.expert_bias)
