"""DeepSeek-V4: hyper-connected blocks of shared-KV sink attention over a sliding window plus
compressed (CSA, sparse) or heavily compressed (HCA) KV entries, and a hash- or top-k-routed MoE.

Layout: `tok_embeddings` -> copies into `hc_mult` streams [B, S, n, D] -> `layers` (a
`BlockStack` of `DeepSeekV4Block`) -> `hc_head` (streams collapsed) -> `norm` -> `output`.
The blocks differ in their attention's parameters (a sliding block has no compressor, a CSA
block an indexer) and in their router's buffers (a hash table, or a selection bias): layer scan
runs the first blocks unrolled and scans the periodic rest (`BlockStack.scan_layout`; flash: the 3
hash-routed blocks, then CSA / HCA x 20; a schedule without a periodic tail is refused when the
step is built); activation checkpointing and per-block compile take the blocks as they are.

Attention with sinks: a sliding block ("s") calls the op `models.common.ops.sink_attention` (the
window alone: splash with sinks on TPU, SDPA with the sink as one more key elsewhere). A CSA or
HCA block's keys are the window's plus the compressed entries, under a mask no kernel takes:
`compressed_sink_attention` computes `softmax([q k^T / sqrt(d) masked | sink]) v` in torch,
blocked by the window (each block of queries scores its own and the previous block's keys and
the entries, not the whole row), the sink one more logit whose value is zero. A kernel (the sink
splash over the window merged with the entries' part) would keep no scores at all.

The indexer chooses entries by `topk`, which has no gradient: as in the reference, its
parameters get none from the LM loss. By default they are built frozen (`requires_grad = False`:
no optimizer state, nothing for weight decay to shrink); an imported checkpoint's indexer is used
as it is. With `indexer_loss_weight` > 0 they train on DeepSeek-V3.2's KL loss instead
(`indexer_kl`, sparse stage): each CSA block runs its indexer on detached inputs (so the loss
reaches the indexer alone and the main model's gradients are those of the LM loss), takes the main
attention's probabilities of the chosen entries as the target, and returns its KL with its aux
term (the block's aux is then [MoE balance loss, KL], every block's; the model splits the stack's
sum: `pop_indexer_loss`).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.common import ops
from models.common.feed_forward import FeedForward
from models.common.init import depth_scaled_std, trunc_normal_
from models.common.moe import GroupedExperts, MoE, random_experts
from models.common.norm import RMSNorm
from models.common.stack import BlockStack
from models.deepseek_v4.args import DeepSeekV4Args


@dataclass(frozen=True)
class RopeTables:
    """Interleaved-pair RoPE tables `(cos, sin)` [max_seq_len, rope_head_dim // 2] (float32), plain or
    YaRN (ramp bounds rounded, as transformers' default `truncate`; no table scale)."""

    rope_head_dim: int
    max_seq_len: int
    theta: float
    factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_seq_len: int = 65536

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        dim, base = self.rope_head_dim, self.theta
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim)
        if self.factor == 1.0:
            return 1.0 / pos_freqs

        def correction_dim(rotations: float) -> float:
            return dim * math.log(self.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(self.beta_fast)), 0)
        high = min(math.ceil(correction_dim(self.beta_slow)), dim - 1)
        if low == high:
            high += 0.001  # a zero-width ramp
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate (divide by factor)
        return 1.0 / (self.factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep

    def cos_sin(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(self.max_seq_len, dtype=torch.int64, device=device).float()
        freqs = positions[:, None] * self.inv_freq(device)[None, :]
        return freqs.cos(), freqs.sin()


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing `2 * cos.shape[-1]` channels of x in interleaved pairs (x0, x1) ->
    (x0 cos - x1 sin, x1 cos + x0 sin), in float32; the leading channels pass. cos/sin broadcast
    against x's pairs ([..., rope_head_dim // 2])."""
    rd = 2 * cos.shape[-1]
    rope = x[..., -rd:].float().unflatten(-1, (-1, 2))
    x0, x1 = rope[..., 0], rope[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-rd], rotated], dim=-1)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight over the last dim (the statistics in float32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def compressed_sink_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    entries: torch.Tensor,
    sinks: torch.Tensor,
    entry_visible: torch.Tensor,
    window: int,
    *,
    entry_probs: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """CSA / HCA attention: q [b, s, heads, d], the one shared KV head kv [b, s, d] (key and value
    alike), the compressed entries [b, n, d], sinks [heads], entry_visible [b, s, n] bool, the
    causal window -> `softmax([q k^T / sqrt(d) over the window's keys and the visible entries |
    sink]) v` [b, s, heads, d], the sink a key whose logit is the sink and whose value is zero.

    Blocked by the window: the sequence is cut into blocks of `window` queries (zero-padded to a
    multiple), and block j's queries score only the keys of blocks j - 1 and j (2 x window, the
    causal window masked inside them) and the n entries: scores [b, s, heads, 1 + 2 window + n]
    instead of a masked [s, 1 + s + n] per head (Flash at 4,096 tokens: 1,281 / 289 keys a row in
    a CSA / HCA block instead of 5,121 / 4,129). SDPA with a mask, the form before, is lowered in its
    math form on TPU, and those fp32 scores were the compiled program's largest buffers (issue 54;
    docs/models.md, "DeepSeek-V4"). The one KV head is never expanded: the heads fold into each
    matmul's rows. Scores and softmax in float32; the probabilities meet the values in q's dtype.

    `entry_probs`: also return the entries' probabilities summed over the heads [b, s, n] (float32,
    detached): the indexer loss's target (`indexer_kl`)."""
    b, s, h, d = q.shape
    n, w = entries.shape[1], window
    nb = -(-s // w)
    if nb * w != s:
        pad = nb * w - s
        q, kv = F.pad(q, (0, 0, 0, 0, 0, pad)), F.pad(kv, (0, 0, 0, pad))
        entry_visible = F.pad(entry_visible, (0, 0, 0, pad))
    scale = d**-0.5
    acc = torch.promote_types(q.dtype, torch.float32)  # the scores' dtype: fp32, or q's if wider
    blocks = kv.view(b, nb, w, d)
    keys = torch.cat([F.pad(blocks[:, :-1], (0, 0, 0, 0, 1, 0)), blocks], dim=2)  # [b, nb, 2w, d]: blocks j - 1, j
    # query r of block j is token jw + r, key c token (j - 1) w + c: visible when 0 <= w + r - c < w
    # and the key is a token (block -1 is padding)
    j = torch.arange(nb, device=q.device)[:, None, None]
    r = torch.arange(w, device=q.device)[None, :, None]
    c = torch.arange(2 * w, device=q.device)[None, None, :]
    local = ((c > r) & (c <= r + w) & ((j > 0) | (c >= w))).unsqueeze(2)  # [nb, w, 1, 2w]
    local_scores = torch.matmul(q.reshape(b, nb, w * h, d), keys.transpose(-1, -2)).to(acc) * scale
    local_scores = local_scores.view(b, nb, w, h, 2 * w).masked_fill(~local, float("-inf"))
    entry_scores = torch.matmul(q.reshape(b, nb * w * h, d), entries.transpose(-1, -2)).to(acc) * scale
    entry_scores = entry_scores.view(b, nb * w, h, n).masked_fill(~entry_visible.unsqueeze(2), float("-inf"))
    sink = sinks.to(acc).view(1, 1, h, 1).expand(b, nb * w, h, 1)
    scores = torch.cat([sink, local_scores.view(b, nb * w, h, 2 * w), entry_scores], dim=-1)
    probs32 = scores.softmax(dim=-1)
    probs = probs32.to(q.dtype)
    out = torch.matmul(probs[..., 1 : 1 + 2 * w].reshape(b, nb, w * h, 2 * w), keys).view(b, nb * w, h, d)
    out = out + torch.matmul(probs[..., 1 + 2 * w :].reshape(b, nb * w * h, n), entries).view(b, nb * w, h, d)
    if entry_probs:
        return out[:, :s], probs32[:, :s, :, 1 + 2 * w :].detach().sum(dim=2)
    return out[:, :s]


def indexer_kl(scores: torch.Tensor, target: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3.2's lightning-indexer loss, sparse stage, of one CSA block: scores [b, s, n] the
    indexer's I (float32, differentiable), target [b, s, n] the main attention's probabilities of the
    entries summed over its heads (detached), chosen [b, s, n] bool the entries S_t each query
    attends -> the mean over the queries with a non-empty S_t of KL(p_t || softmax(I_t over S_t)),
    p_t the target over S_t L1-normalised (0-dim float32; 0 when no query has an entry).

    The target is the main attention's distribution itself (its softmax over sink, window and
    entries), restricted to S_t and renormalised; Megatron-LM's reference
    (`compute_dsa_indexer_loss`, DeepSeek-V3.2's MLA without window or sink) recomputes each head's
    softmax over S_t instead, which weights every head alike where ours weights a head by the mass
    it puts on the entries. The mean runs over the queries that have entries (the first window of a
    row has none), not over every row."""
    rows = chosen.any(dim=-1, keepdim=True)  # [b, s, 1]
    # masked positions get -inf (no probability); a row without entries all zeros (finite, weight 0)
    logits = torch.where(rows, scores.float().masked_fill(~chosen, float("-inf")), 0.0)
    log_q = torch.where(chosen, logits.log_softmax(dim=-1), 0.0)
    p = torch.where(chosen, target.float(), 0.0)
    p = p / p.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    kl = (torch.xlogy(p, p) - p * log_q).sum(dim=-1)  # [b, s]; 0 where the row has no entries
    return kl.sum() / rows.sum().clamp_min(1)


class Compressor(nn.Module):
    """Pools every `ratio` tokens into one KV entry of width `head_dim`: a softmax (over the slots,
    per channel) of `wgate x + position_bias` weighting `wkv x`, RMS-normed, RoPE'd at the window's
    first position. `overlap` (CSA): the projections are twice as wide and entry w pools window
    w - 1's first half with window w's second half (2 x ratio slots; window 0's earlier half is
    empty). A trailing partial window makes no entry."""

    def __init__(self, *, dim: int, head_dim: int, ratio: int, overlap: bool, norm_eps: float):
        super().__init__()
        width = 2 * head_dim if overlap else head_dim
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(head_dim, eps=norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [b, s, dim], the compressed RoPE tables [s, rope // 2] -> entries [b, s // ratio, head_dim]."""
        b, s, _ = x.shape
        m, hd = self.ratio, self.head_dim
        n = s // m
        if n == 0:
            return x.new_zeros(b, 0, hd)
        kv = self.wkv(x[:, : n * m]).view(b, n, m, -1)
        gate = self.wgate(x[:, : n * m]).view(b, n, m, -1) + self.position_bias
        if self.overlap:
            earlier_kv = F.pad(kv[:, :-1, :, :hd], (0, 0, 0, 0, 1, 0))
            earlier_gate = F.pad(gate[:, :-1, :, :hd], (0, 0, 0, 0, 1, 0), value=float("-inf"))
            kv = torch.cat([earlier_kv, kv[..., hd:]], dim=2)
            gate = torch.cat([earlier_gate, gate[..., hd:]], dim=2)
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        return rope_tail(pooled, cos[: n * m : m], sin[: n * m : m])

    def init_weights(self) -> None:
        """Projections: truncated normal std 0.02; position bias zeros; norm ones."""
        trunc_normal_(self.wkv.weight, std=0.02)
        trunc_normal_(self.wgate.weight, std=0.02)
        nn.init.zeros_(self.position_bias)
        self.norm.init_weights()


class Indexer(Compressor):
    """CSA's lightning indexer: its own overlapping compressor (keys of width `head_dim`) and query
    heads from q's bottleneck; score(t, s) = sum_h w_{t,h} relu(q_{t,h} . k_s) / sqrt(d_I), w from
    `weights_proj x / sqrt(H_I)`; a query keeps its `topk` best closed entries. `trained`: its
    parameters take gradients (the KL loss, `indexer_kl`), else they are frozen."""

    def __init__(
        self,
        *,
        dim: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        ratio: int,
        topk: int,
        norm_eps,
        trained: bool = False,
    ):
        super().__init__(dim=dim, head_dim=head_dim, ratio=ratio, overlap=True, norm_eps=norm_eps)
        self.n_heads, self.topk, self.trained = n_heads, topk, trained
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.weights_proj = nn.Linear(dim, n_heads, bias=False)
        # Without its KL loss no gradient reaches them (the choice is a top-k): frozen, so the
        # optimizer holds no state for them and a checkpoint's optimizer entries match a fresh run's.
        for p in self.parameters():
            p.requires_grad_(trained)

    def forward(
        self, x: torch.Tensor, q_lora: torch.Tensor, closed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, dim], q_lora [b, s, q_lora_rank], closed [s, n] (entry closed before the query)
        -> the entries each query attends to [b, s, n] bool, and when `trained` also the scores I
        [b, s, n] (float32, before the closed mask) its loss reads. The selection is the module's
        forward (the keys its compressor's), so a TP style's hooks ("replicate") wrap it."""
        b, s, _ = x.shape
        keys = super().forward(x, cos, sin)  # [b, n, d_I]
        n = keys.shape[1]
        q = rope_tail(self.wq_b(q_lora).view(b, s, self.n_heads, -1), cos[:s, None], sin[:s, None])
        # the heads fold into the rows ([b, s h, d_I] x [b, d_I, n]): broadcasting the keys over the
        # s queries instead materialised them s times (an fp32 [b, s, d_I, n] in the TPU program)
        scores = torch.matmul(q.float().flatten(1, 2), keys.float().transpose(-1, -2)).view(b, s, self.n_heads, n)
        scores = F.relu(scores) * self.head_dim**-0.5
        weights = self.weights_proj(x).float() * self.n_heads**-0.5
        raw = (scores * weights.unsqueeze(-1)).sum(dim=2)  # [b, s, n]
        scores = raw.masked_fill(~closed, float("-inf"))
        top = scores.topk(min(self.topk, n), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True) & closed
        return (chosen, raw) if self.trained else chosen

    def init_weights(self) -> None:
        """As `Compressor`, and `wq_b`, `weights_proj`: truncated normal std 0.02."""
        super().init_weights()
        trunc_normal_(self.wq_b.weight, std=0.02)
        trunc_normal_(self.weights_proj.weight, std=0.02)


class GroupedLinear(nn.Module):
    """`groups` independent linears (weight [groups * out, in], group g's rows g*out .. (g+1)*out):
    x [..., groups, in] -> [..., groups, out]. Under tensor parallelism the plan's "grouped_colwise"
    splits it by group (the weight and x are then DTensors of the full shapes)."""

    def __init__(self, in_features: int, out_features: int, groups: int):
        super().__init__()
        self.groups, self.in_features = groups, in_features
        self.weight = nn.Parameter(torch.empty(groups * out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-2]
        w = self.weight.view(self.groups, -1, x.shape[-1]).transpose(1, 2)  # [g, in, out]
        y = torch.bmm(x.reshape(-1, self.groups, x.shape[-1]).transpose(0, 1), w)  # [g, N, out]
        return y.transpose(0, 1).reshape(*lead, self.groups, -1)


class Sinks(nn.Module):
    """The learned sink logit per head, `weight` [heads]; `forward()` returns it. A module of its
    own so that tensor parallelism splits it by head (the plan's "head_sharded": a rank gets its own
    heads' sinks)."""

    def __init__(self, n_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_heads))

    def forward(self) -> torch.Tensor:
        return self.weight


class HeadShared(nn.Module):
    """Identity on the keys / values (the one shared KV head and the compressed entries) that every
    query head reads. It exists for tensor parallelism: each rank computes its own heads only, so the
    gradient reaching the keys is the rank's part of the sum over heads; the plan's "head_shared"
    sums it over the TP ranks here (models/deepseek_v3/model.py's MLA RoPE key does the same)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class Attention(nn.Module):
    """Shared-KV MQA with sinks over a causal window plus the compressed entries of its kind
    ("s", "c" or "h"), partial interleaved RoPE (undone on the output), grouped output projection."""

    def __init__(self, args: DeepSeekV4Args, kind: str):
        super().__init__()
        d, h, hd = args.dim, args.n_heads, args.head_dim
        self.kind, self.n_heads, self.head_dim, self.eps = kind, h, hd, args.norm_eps
        self.window = args.sliding_window
        self.wq_a = nn.Linear(d, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, eps=args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, h * hd, bias=False)
        self.wkv = nn.Linear(d, hd, bias=False)
        self.kv_norm = RMSNorm(hd, eps=args.norm_eps)
        self.wo_a = GroupedLinear(h * hd // args.o_groups, args.o_lora_rank, args.o_groups)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, d, bias=False)
        self.sinks = Sinks(h)
        self.shared_kv = HeadShared()
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if kind == "h":
            self.ratio = args.hca_ratio
            self.compressor = Compressor(dim=d, head_dim=hd, ratio=self.ratio, overlap=False, norm_eps=args.norm_eps)
        elif kind == "c":
            self.ratio = args.csa_ratio
            self.compressor = Compressor(dim=d, head_dim=hd, ratio=self.ratio, overlap=True, norm_eps=args.norm_eps)
            self.indexer = Indexer(
                dim=d,
                q_lora_rank=args.q_lora_rank,
                n_heads=args.index_n_heads,
                head_dim=args.index_head_dim,
                ratio=self.ratio,
                topk=args.index_topk,
                norm_eps=args.norm_eps,
                trained=args.trains_indexer,
            )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x [b, s, dim], this block's RoPE tables (at least s rows) -> [b, s, dim]; a CSA block whose
        indexer trains: (that, its indexer's KL loss `indexer_kl`)."""
        b, s, _ = x.shape
        cos, sin = cos[:s], sin[:s]
        q_lora = self.q_norm(self.wq_a(x))
        q = rms(self.wq_b(q_lora).view(b, s, -1, self.head_dim), self.eps)  # -1: the rank's heads under TP
        q = rope_tail(q, cos[:, None], sin[:, None])
        kv = rope_tail(self.kv_norm(self.wkv(x)), cos, sin)  # [b, s, hd]
        kl = None
        if self.compressor is None:  # "s": the window alone, the op (splash with sinks on TPU)
            shared = self.shared_kv(kv).unsqueeze(1)  # the one KV head, key and value alike
            out = ops.sink_attention(q.transpose(1, 2), shared, shared, self.sinks(), self.window).transpose(1, 2)
        else:
            out, kl = self._compressed_attention(x, q, q_lora, kv, cos, sin)
        out = rope_tail(out, cos[:, None], -sin[:, None])  # values carry their keys' rotation: undo it
        grouped = self.wo_a(out.reshape(b, s, -1, self.wo_a.in_features)).flatten(2)
        out = self.wo_b(grouped)
        return out if kl is None else (out, kl)

    def _compressed_attention(self, x, q, q_lora, kv, cos, sin) -> tuple[torch.Tensor, torch.Tensor | None]:
        """CSA / HCA: sink attention over the window's keys plus the compressed entries visible to
        each query (`compressed_sink_attention`) -> ([b, s, h, hd], the indexer's KL loss when it
        trains, else None). The trained indexer reads detached inputs: its loss reaches it alone."""
        b, s, _ = x.shape
        i = torch.arange(s, device=x.device)
        entries = self.compressor(x, cos, sin)
        # Entry w holds tokens up to (w + 1) m - 1: closed for queries t >= that.
        w = torch.arange(entries.shape[1], device=x.device)
        closed = w[None, :] < ((i + 1) // self.ratio)[:, None]  # [s, n]
        trained = self.indexer is not None and self.indexer.trained
        if trained:
            chosen, index_scores = self.indexer(x.detach(), q_lora.detach(), closed, cos, sin)
        elif self.indexer is not None:
            chosen = self.indexer(x, q_lora, closed, cos, sin)
        else:
            chosen = closed.expand(b, -1, -1)
        kv = self.shared_kv(torch.cat([kv, entries], dim=1))
        out = compressed_sink_attention(q, kv[:, :s], kv[:, s:], self.sinks(), chosen, self.window, entry_probs=trained)
        if not trained:
            return out, None
        out, target = out
        return out, indexer_kl(index_scores, target, chosen)

    def init_weights(self, init_std: float) -> None:
        """wq_a, wq_b, wkv, wo_a: truncated normal std 0.02; wo_b (the residual-branch output): std
        `init_std`; norms ones; sinks zeros; compressor and indexer: their `init_weights`."""
        for w in (self.wq_a.weight, self.wq_b.weight, self.wkv.weight, self.wo_a.weight):
            trunc_normal_(w, std=0.02)
        trunc_normal_(self.wo_b.weight, std=init_std)
        self.q_norm.init_weights()
        self.kv_norm.init_weights()
        nn.init.zeros_(self.sinks.weight)
        for part in (self.compressor, self.indexer):
            if part is not None:
                part.init_weights()


class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection weights of one sub-layer from the `n` streams h [b, s, n, D]:
    from `fn` applied to the RMS-normed flattened streams (+ `base`, times the three `scale`s):
    pre = sigmoid + eps (collapses the streams into the sub-layer's input), post = 2 sigmoid (spreads
    its output over the streams), comb = softmax over rows + eps, then Sinkhorn-Knopp (columns, then
    rows and columns `iters - 1` times) towards a doubly-stochastic matrix (mixes the streams)."""

    def __init__(self, *, dim: int, n: int, iters: int, eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.eps, self.norm_eps = n, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dim))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (post [b, s, n], comb [b, s, n, n] (float32), collapsed input [b, s, D] in h's dtype)."""
        n = self.n
        mix = F.linear(rms(h.flatten(2).float(), self.norm_eps), self.fn.float())
        pre, post, comb = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post * post_s + post_b)
        comb = torch.softmax(comb.unflatten(-1, (n, n)) * comb_s + comb_b.view(n, n), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)
        return post, comb, collapsed

    def init_weights(self) -> None:
        """fn: normal std 0.02; base zeros; scales ones (transformers' initialisation)."""
        nn.init.normal_(self.fn, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


class HyperHead(nn.Module):
    """The final collapse of the streams: `sum_j (sigmoid(fn(rms(h)) * scale + base)_j + eps) h_j`."""

    def __init__(self, *, dim: int, n: int, eps: float, norm_eps: float):
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * dim))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        mix = F.linear(rms(h.flatten(2).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.eps
        return (pre.unsqueeze(-1) * h).sum(dim=2).to(h.dtype)

    def init_weights(self) -> None:
        """fn: normal std 0.02; base zeros; scale one."""
        nn.init.normal_(self.fn, std=0.02)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)


class ClampedExperts(GroupedExperts):
    """`GroupedExperts` (w1 gate, w3 up, w2 down; grouped matmuls, EP and `[quantize]` as they are)
    with DeepSeek-V4's activation `silu(clamp(gate, max=limit)) * clamp(up, -limit, limit)`."""

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, limit: float):
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts)
        self.limit = limit

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


class ClampedFeedForward(FeedForward):
    """The shared expert: `FeedForward` with the experts' clamped SwiGLU."""

    def __init__(self, *, dim: int, hidden_dim: int, limit: float):
        super().__init__(dim=dim, hidden_dim=hidden_dim)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.w1(x).clamp(max=self.limit)
        return self.w2(F.silu(gate) * self.w3(x).clamp(min=-self.limit, max=self.limit))


def hash_table(vocab_size: int, num_experts: int, top_k: int, device: torch.device | None = None) -> torch.Tensor:
    """The initial token -> experts table [vocab, k] int64: k distinct experts per token id, uniformly
    (a fixed seeded hash of the id, `models.common.moe.random_experts`); a checkpoint brings its own."""
    tokens = torch.arange(vocab_size, device=device)
    return random_experts(torch.zeros((), dtype=torch.int64, device=device), tokens, num_experts, top_k)


class TokenIds(nn.Module):
    """Identity on the token ids [b, s] a hash block routes by. It exists for tensor parallelism:
    the MoE layer then holds the rank's sequence shard of the tokens, and the plan's
    "sequence_shard" hands on the ids of those tokens. Without TP it does nothing."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return tokens


class DeepSeekV4Block(nn.Module):
    """Two hyper-connected sub-layers: attention (pre-norm), then the MoE (pre-norm); each is
    `h <- post (x) f(norm(sum_j pre_j h_j)) + comb^T h` over the streams."""

    def __init__(self, args: DeepSeekV4Args, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.kind = args.layer_kinds()[layer_id]
        self.trains_indexer = args.trains_indexer
        self.is_hash = args.is_hash_layer(layer_id)
        hc = dict(dim=args.dim, n=args.hc_mult, iters=args.hc_sinkhorn_iters, eps=args.hc_eps, norm_eps=args.norm_eps)
        self.attn_hc = HyperConnection(**hc)
        self.ffn_hc = HyperConnection(**hc)
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, self.kind)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            top_k=args.num_experts_per_tok,
            norm_topk_prob=True,
            score_func="sqrtsoftplus",
            route_scale=args.route_scale,
            expert_bias=not self.is_hash,
            aux_loss="none" if self.is_hash else "sequence",
            experts=ClampedExperts(
                dim=args.dim, hidden_dim=args.moe_hidden_dim, num_experts=args.num_experts, limit=args.swiglu_limit
            ),
        )
        self.moe.shared_experts = ClampedFeedForward(
            dim=args.dim, hidden_dim=args.moe_hidden_dim, limit=args.swiglu_limit
        )
        if self.is_hash:
            # Persistent: checkpoints (and HF's `mlp.gate.tid2eid`) hold it.
            table = hash_table(args.vocab_size, args.num_experts, args.num_experts_per_tok)
            self.moe.router.register_buffer("tid2eid", table)
            self.hash_tokens = TokenIds()
        self.is_moe = True

    def forward(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        compress_cos: torch.Tensor,
        compress_sin: torch.Tensor,
        tokens: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [b, s, n, D] streams; the sliding blocks' and the compressed blocks' RoPE tables; tokens
        [b, s] (hash routing) -> (h, aux_loss, load). With `indexer_loss_weight` > 0 every block's
        aux_loss is [2] float32: the MoE balance loss and its indexer's KL (0 without an indexer),
        so that the stack's sum (and a scan's per-layer outputs) carries both."""
        dtype = h.dtype
        post, comb, x = self.attn_hc(h)
        rope = (cos, sin) if self.kind == "s" else (compress_cos, compress_sin)
        out = self.attention(self.attention_norm(x), *rope)
        kl = None
        if isinstance(out, tuple):
            out, kl = out
        h = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)
        post, comb, x = self.ffn_hc(h)
        selected = self.moe.router.tid2eid[self.hash_tokens(tokens).reshape(-1)] if self.is_hash else None
        out, aux_loss, load = self.moe(self.ffn_norm(x), selected)
        h = post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2), h)
        if self.trains_indexer:
            aux_loss = aux_loss.float()
            aux_loss = torch.stack([aux_loss, kl.float() if kl is not None else torch.zeros_like(aux_loss)])
        return h, aux_loss, load

    def init_weights(self, vocab_size: int) -> None:
        init_std = depth_scaled_std(self.layer_id)
        self.attn_hc.init_weights()
        self.ffn_hc.init_weights()
        self.attention_norm.init_weights()
        self.ffn_norm.init_weights()
        self.attention.init_weights(init_std)
        self.moe.init_weights(init_std)
        if self.is_hash:
            table = self.moe.router.tid2eid
            with torch.no_grad():
                table.copy_(hash_table(vocab_size, self.moe.router.num_experts, table.shape[1], table.device))


class DeepSeekV4(nn.Module):
    """DeepSeek-V4; `forward(tokens [B, T]) -> logits [B, T, vocab]`, `hidden(tokens)`,
    `init_weights()`, `pop_aux_loss()` (the learned-routing blocks' sequence-wise balance loss)."""

    attn_backends = ("auto", "sdpa")
    """The `[model] attn_backend` values its attention honours: its own torch formulation (sinks,
    window + compressed keys) serves every device; no kernel behind the other values takes it."""

    non_matrix_params = ("position_bias",)
    """Tensors of 2+ dims that are no linear map (the compressors' per-slot gate biases [ratio, w]):
    Muon leaves them to AdamW (trainer/optim/muon.py `split_muon_params`). The grouped output
    projection `wo_a` [groups x rank, in] is Muon's as one matrix (not per group)."""

    def __init__(self, args: DeepSeekV4Args):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = BlockStack(DeepSeekV4Block(args, i) for i in range(args.n_layers))
        self.hc_head = HyperHead(dim=args.dim, n=args.hc_mult, eps=args.hc_eps, norm_eps=args.norm_eps)
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        for name, (cos, sin) in self._rope_tables().items():
            self.register_buffer(f"{name}_cos", cos, persistent=False)
            self.register_buffer(f"{name}_sin", sin, persistent=False)

    def _rope_tables(self, device: torch.device | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        a = self.args
        main = RopeTables(a.rope_head_dim, a.max_seq_len, a.rope_theta)
        compress = RopeTables(
            a.rope_head_dim,
            a.max_seq_len,
            a.compress_rope_theta,
            a.rope_factor,
            a.rope_beta_fast,
            a.rope_beta_slow,
            a.rope_original_max_seq_len,
        )
        return {"rope": main.cos_sin(device), "compress_rope": compress.cos_sin(device)}

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.output(self.hidden(tokens))

    def hidden(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] -> the final-normed hidden states [batch, seq, dim] `output` projects."""
        seqlen = tokens.shape[1]
        assert seqlen <= self.rope_cos.shape[0], f"sequence length {seqlen} exceeds max_seq_len"
        x = self.tok_embeddings(tokens)
        h = x.unsqueeze(2).expand(-1, -1, self.args.hc_mult, -1).contiguous()
        h = self.layers(h, self.rope_cos, self.rope_sin, self.compress_rope_cos, self.compress_rope_sin, tokens)
        if self.args.trains_indexer:  # the blocks' aux is [MoE balance, indexer KL]: the stack keeps the first
            self.layers.split_aux_loss()
        return self.norm(self.hc_head(h))

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter in place and rebuild the RoPE buffers.

        - `tok_embeddings`: normal std 0.02; `output`: truncated normal std `dim ** -0.5` (kept
          as the embedding's when tied); norms ones.
        - per block i: attention (`Attention.init_weights`: in-projections std 0.02, `wo_b` std
          `0.02 / sqrt(2 (i + 1))`, sinks and position biases zeros), the MoE as
          `models.common.moe.MoE.init_weights` with that depth-scaled std (router, experts' w2/w3,
          shared w2; selection biases zeros), the hash table (hash blocks) re-drawn as
          `hash_table`, the hyper-connections as transformers does (fn normal std 0.02, base
          zeros, scale ones), `hc_head` too.
        All act in place, so parameters may be DTensors.
        """
        if self.args.tie_embeddings and self.output.weight is not self.tok_embeddings.weight:
            self.output.weight = self.tok_embeddings.weight
        device = buffer_device if buffer_device is not None else self.rope_cos.device
        for name, (cos, sin) in self._rope_tables(device).items():
            setattr(self, f"{name}_cos", cos)
            setattr(self, f"{name}_sin", sin)
        nn.init.normal_(self.tok_embeddings.weight, mean=0.0, std=0.02)
        for block in self.layers.values():
            block.init_weights(self.args.vocab_size)
        self.hc_head.init_weights()
        self.norm.init_weights()
        if not self.args.tie_embeddings:
            trunc_normal_(self.output.weight, std=self.args.dim**-0.5)

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Sum over blocks of the MoE balance loss of the last forward (hash blocks add zero)."""
        total = self.layers.pop_aux_loss()
        assert total is not None, "the aux loss is available once after each forward"
        return total

    def pop_indexer_loss(self) -> torch.Tensor:
        """The CSA blocks' indexer KL loss of the last forward, the mean over those blocks (0-dim
        float32; `indexer_loss_weight` > 0 only). The training loss adds `indexer_loss_weight` x the
        number of CSA blocks x this, i.e. the weight times each block's KL (trainer/tasks/lm.py
        `IndexerLoss`)."""
        assert self.args.trains_indexer, "pop_indexer_loss needs indexer_loss_weight > 0"
        extra = self.layers.pop_aux_extra()
        assert extra is not None, "the indexer loss is available once after each forward"
        return extra[0] / max(self.args.layer_kinds().count("c"), 1)
