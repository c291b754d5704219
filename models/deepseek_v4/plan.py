"""Parallel plan of DeepSeek-V4: FSDP, activation checkpointing, EP and tensor parallelism.

The block stack is `layers` (what activation checkpointing, per-block compile and layer scan act
on; layer scan runs the hash-routed blocks unrolled, then the periodic rest: models/common/stack.py
`scan_layout`).

TP (TorchTitan's decoder layout, with sequence parallelism): between blocks the `hc_mult` streams
[b, s, n, D] are sequence-sharded (dim 1), as the other decoders' residual stream. The
hyper-connections (`attn_hc`, `ffn_hc`, `hc_head`) are per-token maps of the rank's own tokens
("sequence_local": replicated weights, gradients summed over TP, plain tensors in and out, their
outputs being tuples); the norms are "sequence_parallel".
Attention gathers the sequence (`block_input`) and splits the query heads: `wq_b` colwise (by
head; the per-head q RMS norm has no weight), the sinks by head (`head_sharded`), the grouped
output projection `wo_a` by group (`grouped_colwise`: groups are consecutive heads, so tp must
divide both the heads and the groups) and `wo_b` rowwise (its input is the groups' concatenation).
Every rank runs in full what acts before the head split or on the one shared KV head
(`replicate`): the q bottleneck `wq_a` / `q_norm` (its output feeds a colwise projection, whose
input gradient is summed over TP, so every rank gets the same full gradient), the KV projection
`wkv` / `kv_norm`, the CSA / HCA compressor and the lightning indexer (frozen: no gradient; its
training loss, `indexer_loss_weight` > 0, is refused with TP). The
keys every head reads (the shared KV head with the compressed entries) pass `shared_kv`
("head_shared"), which sums their gradient over TP: each rank's covers its own heads only.
MoE (EP-without-ETP, as Qwen 3 / DeepSeek-V3): the layer takes the rank's sequence shard of tokens
(`moe`), the router gate and the shared expert are per-token linears with TP-replicated weights
(`router`: gradients summed over TP), the routed experts stay whole and are FSDP-sharded over
dp_shard x tp (or split over `ep`); a hash block reads the ids of its own tokens (`hash_tokens`,
"sequence_shard": a local slice of the replicated ids), its table `tid2eid` is a replicated buffer.
Embedding, final norm and LM head as the other decoders (loss parallel supported).

EP: as Qwen 3 MoE / DeepSeek-V3 (`experts`: w1/w2/w3 with the expert on dim 0, split over `ep`).
Hash routing fits the dispatch as it is: the experts are chosen before it (a table lookup of
the token ids instead of a top-k), and dispatch only reads the choice.
"""

from models.common.plan import DECODER_TP, ModelPlan

PLAN = ModelPlan(
    block="layers",
    tp={**DECODER_TP, "hc_head": "sequence_local"},
    tp_block={
        "attn_hc": "sequence_local",
        "ffn_hc": "sequence_local",
        "attention_norm": "sequence_parallel",
        "attention": "block_input",
        "attention.wq_a": "replicate",
        "attention.q_norm": "replicate",
        "attention.wq_b": "colwise",
        "attention.wkv": "replicate",
        "attention.kv_norm": "replicate",
        "attention.compressor": "replicate",
        "attention.indexer": "replicate",
        "attention.shared_kv": "head_shared",
        "attention.sinks": "head_sharded",
        "attention.wo_a": "grouped_colwise",
        "attention.wo_b": "rowwise",
        "ffn_norm": "sequence_parallel",
        "hash_tokens": "sequence_shard",
    },
    ep_block={
        "moe": "moe",
        "moe.router.gate": "router",
        "moe.shared_experts.w1": "router",
        "moe.shared_experts.w2": "router",
        "moe.shared_experts.w3": "router",
        "moe.experts": "experts",
    },
)
