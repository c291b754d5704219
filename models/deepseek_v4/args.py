"""DeepSeek-V4 model arguments and the flavors.

Every block is manifold-constrained hyper-connections (mHC: `hc_mult` residual streams, mixed in
and out of each sub-layer by weights computed from the streams, the mixing matrix projected onto
the doubly-stochastic ones by Sinkhorn-Knopp) around pre-norm attention and a MoE.

Attention is shared-KV multi-query attention (one KV head that is both key and value, q through a
low-rank `q_lora_rank` bottleneck, RMS-normed per head), RoPE on the trailing `rope_head_dim`
channels of each head (interleaved pairs; undone on the output at the query's position), a
learned sink logit per head, a grouped low-rank output projection (`o_groups` groups of heads,
each projected to `o_lora_rank`, then mixed to `dim`), over a causal sliding window of
`sliding_window` keys plus, per block type (`attention_layers`, one letter per block):
- "s": nothing more (sliding-window attention, RoPE base `rope_theta`);
- "c": compressed sparse attention (CSA): every `csa_ratio` tokens pooled into one compressed KV
  entry (a softmax-gated sum over two overlapping windows), and a lightning indexer (its own
  compressed keys, `index_n_heads` ReLU-scored query heads) keeps the `index_topk` best entries
  per query;
- "h": heavily compressed attention (HCA): every `hca_ratio` tokens pooled into one entry, all
  of them visible to the later queries.
Compressed entries are visible to a query once their window has closed at or before it; "c" and
"h" blocks use the RoPE base `compress_rope_theta` (YaRN with `rope_factor` > 1, tables unscaled).

MoE: `num_experts` routed experts (SwiGLU with the gate clamped above and the up projection on
both sides at `swiglu_limit`) plus one shared expert of the same width (clamped too), scores
`sqrt(softplus(logits))` renormalised over the k and scaled by `route_scale`. The first
`num_hash_layers` blocks route by hash: a frozen table `tid2eid` [vocab, k] gives each token id's
experts; the others pick the top k of the scores plus the selection bias (DeepSeek-V3's
auxiliary-loss-free balancing).

FLOPs per token (trainer/runtime/flops.py, MFU): 6 x the active non-embedding parameters (the
routed top-k experts, the shared expert, the router, the compressors, the indexer and the mHC
projections; each projection once per token) + `mixing_flops_per_token`: the score and value
products against the keys a query really sees (window + visible compressed entries) and the
indexer's scores, less 4x the indexer's parameters (frozen: forward only, 2x, not 6x; with
`indexer_loss_weight` > 0 the indexer trains: its scores count 6x and its parameters 4x, the
inputs being detached);
"causal" counts the mean visible keys of a causal row, "palm" twice that (as for full
attention). Pooling, softmaxes, norms and the Sinkhorn iterations are not counted (elementwise).
The flavor `flash` is transformers' `DeepseekV4Config` defaults (its docstring names
DeepSeek-V4-Flash-Base), the only shape derivable offline: plain RoPE on the compressed blocks
and the default block schedule; a real checkpoint's `config.json` (YaRN, its own schedule) is read
by `hf_adapter.args_from_hf_config`.
"""

import math
from dataclasses import dataclass

from models.common.rope import YarnArgs
from models.contract import ModelShape, causal_keys

ATTENTION_KINDS = {"s": "sliding_attention", "c": "compressed_sparse_attention", "h": "heavily_compressed_attention"}
"""Letter of `attention_layers` -> transformers' layer type."""


def default_attention_layers(n_layers: int) -> str:
    """transformers' default schedule: two HCA blocks, then CSA and HCA alternating (CSA on odd counts)."""
    rest = "".join("c" if i % 2 else "h" for i in range(max(n_layers - 2, 0)))
    return ("h" * min(n_layers, 2) + rest)[:n_layers]


@dataclass
class DeepSeekV4Args(YarnArgs):
    dim: int = 4096
    """Residual-stream width (HF hidden_size); each of the `hc_mult` streams has it."""
    n_layers: int = 43
    """Number of blocks."""
    n_heads: int = 64
    """Query heads (one shared key/value head)."""
    head_dim: int = 512
    """Per-head width of q and of the shared KV head."""
    rope_head_dim: int = 64
    """Trailing channels of each head that RoPE rotates (HF head_dim x partial_rotary_factor)."""
    q_lora_rank: int = 1024
    """Width of q's low-rank bottleneck (also the indexer's query input)."""
    o_groups: int = 8
    """Head groups of the grouped output projection."""
    o_lora_rank: int = 1024
    """Per-group width of the grouped output projection."""
    vocab_size: int = 129280
    """Vocabulary size of the embedding and output projection."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon (every norm, the mHC input norms included)."""
    sliding_window: int = 128
    """Keys of the local branch: the query's own and the `sliding_window - 1` before it."""
    attention_layers: str = ""
    """One letter per block: s (sliding only), c (CSA), h (HCA); "" = transformers' default schedule
    (h, h, then h and c alternating)."""
    csa_ratio: int = 4
    """Tokens pooled into one compressed entry by a CSA block (its two windows overlap: 2x that wide)."""
    hca_ratio: int = 128
    """Tokens pooled into one compressed entry by an HCA block."""
    index_n_heads: int = 64
    """Lightning indexer query heads (CSA)."""
    index_head_dim: int = 128
    """Lightning indexer head width (CSA)."""
    index_topk: int = 512
    """Compressed entries each query keeps (CSA)."""
    rope_theta: float = 10000.0
    """RoPE base of the sliding-only blocks."""
    compress_rope_theta: float = 160000.0
    """RoPE base of the CSA/HCA blocks (their queries, keys and compressed entries)."""
    rope_original_max_seq_len: int = 65536  # YarnArgs (of the CSA/HCA blocks; factor 1: plain RoPE)
    max_seq_len: int = 1048576
    """Length of the RoPE tables, i.e. the longest sequence the model accepts; the trainer sets it to the training seq_len."""
    tie_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection."""
    hc_mult: int = 4
    """Residual streams of the hyper-connections."""
    hc_sinkhorn_iters: int = 20
    """Sinkhorn-Knopp iterations projecting the stream-mixing matrix onto the doubly-stochastic ones."""
    hc_eps: float = 1e-6
    """Floor added to the mHC weights and to the Sinkhorn normalisers."""
    num_experts: int = 256
    """Routed experts per block."""
    num_experts_per_tok: int = 6
    """Experts each token is routed to (top-k, or the hash table's k)."""
    moe_hidden_dim: int = 2048
    """Width of each routed expert's SwiGLU and of the shared expert's."""
    route_scale: float = 1.5
    """Factor on the renormalised top-k weights (HF routed_scaling_factor)."""
    num_hash_layers: int = 3
    """The first this-many blocks route by the token-id hash table; the rest by learned top-k."""
    swiglu_limit: float = 10.0
    """Clamp of the experts' (routed and shared) gate (above) and up projection (both sides)."""
    indexer_loss_weight: float = 0.0
    """The lightning indexers' training loss (DeepSeek-V3.2's KL objective, sparse stage; model.py
    `indexer_kl`): > 0 trains each CSA block's indexer on KL(p || softmax(I)) over its chosen
    entries, p the main attention's probabilities of those entries summed over the heads and
    L1-normalised, the indexer's inputs detached (the main model gets no gradient from it); the
    step adds this weight times the sum over the CSA blocks of their mean KL per query, and
    metrics.jsonl logs `indexer_loss` (the mean over the CSA blocks). 0: the indexers are frozen
    (no gradient reaches them: the choice is a top-k)."""

    def __post_init__(self) -> None:
        for name in (
            "dim",
            "n_layers",
            "n_heads",
            "head_dim",
            "rope_head_dim",
            "q_lora_rank",
            "o_groups",
            "o_lora_rank",
            "vocab_size",
            "sliding_window",
            "csa_ratio",
            "hca_ratio",
            "index_n_heads",
            "index_head_dim",
            "index_topk",
            "max_seq_len",
            "hc_mult",
            "hc_sinkhorn_iters",
            "num_experts",
            "moe_hidden_dim",
            "rope_original_max_seq_len",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)}; allowed: >= 1")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim or self.index_head_dim < self.rope_head_dim:
            raise ValueError(
                f"rope_head_dim: must be even and at most head_dim ({self.head_dim}) and index_head_dim "
                f"({self.index_head_dim}), got {self.rope_head_dim}; allowed: an even width within both"
            )
        if (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(
                f"o_groups: must divide n_heads x head_dim = {self.n_heads * self.head_dim}, got {self.o_groups}; "
                "allowed: a divisor of it"
            )
        layers = self.layer_kinds()
        if len(layers) != self.n_layers or set(layers) - set(ATTENTION_KINDS):
            raise ValueError(
                f"attention_layers: {self.attention_layers!r} must have one letter per block ({self.n_layers}); "
                "allowed: letters s (sliding), c (CSA), h (HCA), or an empty string (the default schedule)"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok: must be in [1, num_experts={self.num_experts}], got "
                f"{self.num_experts_per_tok}; allowed: 1 .. {self.num_experts}"
            )
        if not 0 <= self.num_hash_layers <= self.n_layers:
            raise ValueError(
                f"num_hash_layers: must be in [0, n_layers={self.n_layers}], got {self.num_hash_layers}; "
                f"allowed: 0 .. {self.n_layers}"
            )
        self.check_yarn()
        if self.swiglu_limit <= 0:
            raise ValueError(f"swiglu_limit: must be > 0, got {self.swiglu_limit}; allowed: > 0")
        if not (math.isfinite(self.indexer_loss_weight) and self.indexer_loss_weight >= 0):
            raise ValueError(
                f"indexer_loss_weight: must be a finite number >= 0, got {self.indexer_loss_weight}; "
                "allowed: 0 (frozen indexers) or > 0 (train them on the KL loss)"
            )

    @property
    def trains_indexer(self) -> bool:
        """The CSA blocks' indexers train on their KL loss (`indexer_loss_weight` > 0)."""
        return self.indexer_loss_weight > 0

    def layer_kinds(self) -> str:
        """One letter per block (s, c, h): `attention_layers`, or the default schedule when it is empty."""
        return self.attention_layers or default_attention_layers(self.n_layers)

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hash_layers

    def mixing_flops_per_token(self, seq_len: int) -> dict[str, float]:
        """Training FLOPs per token of the attention products (trainer/runtime/flops.py
        `model_flops_per_token`), "causal": the mean keys a query of a causal row of `seq_len` sees:
        - every block: 12 x H x head_dim x (window keys, `causal_keys(T, sliding_window)`);
        - HCA: + 12 x H x head_dim x T / (2 m') (the closed windows before the query);
        - CSA: + 12 x H x head_dim x min(visible, index_topk) on average (`causal_keys(T / m, topk)`),
          + the indexer's scores against the T / (2 m) closed entries: 2 x H_I x d_I each, forward
          only when frozen (its top-k has no gradient), 6 x when it trains (`trains_indexer`: its
          KL loss differentiates both the queries and the keys).
        "palm" is twice the causal count, as for full attention (the unmasked convention). Both
        also take back part of the 6x that 6N counted for the indexers' parameters: 4x when frozen
        (forward only, 2x), 2x when they train (forward and weight gradient, 4x: their inputs are
        detached, so no input gradient is computed). The KL itself (softmaxes, logs) is elementwise."""
        h, d, t = self.n_heads, self.head_dim, seq_len
        causal = 0.0
        score_factor = 6.0 if self.trains_indexer else 2.0
        for kind in self.layer_kinds():
            keys = causal_keys(t, self.sliding_window)
            if kind == "h":
                keys += causal_keys(t / self.hca_ratio)
            elif kind == "c":
                keys += causal_keys(t / self.csa_ratio, self.index_topk)
                causal += score_factor * self.index_n_heads * self.index_head_dim * causal_keys(t / self.csa_ratio)
            causal += 12.0 * h * d * keys
        # The indexer's projections: frozen, forward only (2x their parameters per token); trained,
        # forward and weight gradient (4x). 6N counted them 6x.
        untrained = -(2.0 if self.trains_indexer else 4.0) * self.layer_kinds().count("c") * self._indexer_params()
        return {"palm": 2 * causal + untrained, "causal": causal + untrained}

    def _indexer_params(self) -> int:
        """Parameters of one CSA block's lightning indexer (its compressor, query and weight projections)."""
        idx, hi = self.index_head_dim, self.index_n_heads
        return 2 * self.dim * 2 * idx + self.csa_ratio * 2 * idx + idx + self.q_lora_rank * hi * idx + self.dim * hi

    def shape(self) -> ModelShape:
        return ModelShape(
            n_layers=self.n_layers,
            dim=self.dim,
            n_heads=self.n_heads,
            n_kv_heads=1,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            num_experts=self.num_experts,
            top_k=self.num_experts_per_tok,
            moe_hidden=self.moe_hidden_dim,
            # TP splits the query heads and the output groups; the one KV head is replicated and the
            # experts stay whole (models/deepseek_v4/plan.py).
            tp_splits=(("n_heads", self.n_heads), ("o_groups", self.o_groups)),
        )

    def _counts(self) -> tuple[int, int, int]:
        """(total, active, embedding) parameters, conventions of models/common/param_count.py
        (buffers, the hash tables and the selection biases, are not parameters)."""
        d, hd, h, n = self.dim, self.head_dim, self.n_heads, self.hc_mult
        attention = (
            d * self.q_lora_rank
            + self.q_lora_rank  # q norm
            + self.q_lora_rank * h * hd
            + d * hd
            + hd  # kv and its norm
            + h * hd * self.o_lora_rank
            + self.o_groups * self.o_lora_rank * d
            + h  # sinks
        )

        def pool(width: int, ratio: int, overlap: bool) -> int:  # kv and gate projections, position bias, norm
            w = 2 * width if overlap else width
            return 2 * d * w + ratio * w + width

        hc = (2 + n) * n * (n * d + 1) + 3
        per_expert = 3 * d * self.moe_hidden_dim
        shared_and_router = per_expert + d * self.num_experts
        block = attention + 2 * d + 2 * hc + shared_and_router
        total = active = 0
        for kind in self.layer_kinds():
            extra = 0
            if kind == "h":
                extra = pool(hd, self.hca_ratio, False)
            elif kind == "c":
                extra = pool(hd, self.csa_ratio, True) + self._indexer_params()
            total += block + extra + self.num_experts * per_expert
            active += block + extra + self.num_experts_per_tok * per_expert
        table = self.vocab_size * d
        outer = table + n * (n * d + 1) + 1 + d + (0 if self.tie_embeddings else table)  # embed, hc head, norm, out
        return total + outer, active + outer, 0 if self.tie_embeddings else table

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters; `exclude_embedding` drops the token-embedding table."""
        total, _, embedding = self._counts()
        return total - (embedding if exclude_embedding else 0)

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token: top-k of the routed experts, everything else."""
        _, active, embedding = self._counts()
        return active - (embedding if exclude_embedding else 0)


FLAVORS: dict[str, DeepSeekV4Args] = {
    # Tiny model for CPU runs and tests; every component at once: block 0 HCA + hash MoE, 1 CSA +
    # hash MoE, 2 sliding + learned MoE, 3 CSA + learned MoE. Windows of 16 keys, CSA pooling 4
    # tokens with 4 kept per query, HCA 16 tokens, so the debug recipe's 128-token rows take every
    # path (sparse selection, closed HCA windows, keys past the window); vocab 4096 matches the
    # bundled tokenizer.
    "debugmodel": DeepSeekV4Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        head_dim=32,
        rope_head_dim=8,
        q_lora_rank=64,
        o_groups=2,
        o_lora_rank=32,
        vocab_size=4096,
        sliding_window=16,
        attention_layers="hcsc",
        csa_ratio=4,
        hca_ratio=16,
        index_n_heads=4,
        index_head_dim=16,
        index_topk=4,
        max_seq_len=2048,
        hc_mult=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_hidden_dim=64,
        num_hash_layers=2,
    ),
    # transformers' DeepseekV4Config defaults (DeepSeek-V4-Flash-Base's shape, module docstring).
    "flash": DeepSeekV4Args(),
}
