"""Parameter counts of a `Decoder` computed from its shape, without building it.

Conventions (used for FLOPs, 6·N per token):
- `total` counts every distinct parameter once (a tied embedding/output matrix once).
- `embedding` is the token-embedding lookup table, which costs no FLOPs. When the output
  projection is tied to it, the shared matrix is counted as the output projection (a matmul),
  so `embedding` is 0. Note that model cards' "non-embedding" figures (e.g. Qwen 3) drop the
  output projection too; ours keep it because it is a matmul.
- `active` counts, for MoE layers, only `top_k` of the `num_experts` experts (router included).
"""

from typing import NamedTuple


class ParamCounts(NamedTuple):
    total: int
    active: int
    embedding: int


def decoder_param_counts(
    *,
    vocab_size: int,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
    qk_norm: bool,
    ffn_hidden_dim: int,
    tie_embeddings: bool,
    num_experts: int = 0,
    top_k: int = 0,
    moe_hidden_dim: int = 0,
) -> ParamCounts:
    attention = dim * head_dim * (2 * n_heads + 2 * n_kv_heads) + (2 * head_dim if qk_norm else 0)
    norms = 2 * dim
    if num_experts > 0:
        per_expert = 3 * dim * moe_hidden_dim
        router = dim * num_experts
        mlp_total = num_experts * per_expert + router
        mlp_active = top_k * per_expert + router
    else:
        mlp_total = mlp_active = 3 * dim * ffn_hidden_dim
    table = vocab_size * dim
    outer = table + dim + (0 if tie_embeddings else table)  # embedding, final norm, output
    total = outer + n_layers * (attention + norms + mlp_total)
    active = outer + n_layers * (attention + norms + mlp_active)
    return ParamCounts(total=total, active=active, embedding=0 if tie_embeddings else table)
