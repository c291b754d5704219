"""Parallel plan of Qwen 3 (dense and MoE blocks).

Same TP layout as Llama 3 (sequence-parallel residual stream, colwise q/k/v and FFN
in-projections, rowwise out-projections), plus Qwen 3's per-head q_norm / k_norm, which
normalise head-sharded activations: their replicated weights get TP-summed gradients.
Entries for modules a block lacks are skipped, so one plan covers dense and MoE blocks.
"""

from models.common.plan import ModelPlan

PLAN = ModelPlan(
    block="layers",
    tp={
        "tok_embeddings": "embedding",
        "norm": "sequence_parallel",
        "output": "output",
    },
    tp_block={
        "attention_norm": "sequence_parallel",
        "attention": "block_input",
        "attention.wq": "colwise",
        "attention.wk": "colwise",
        "attention.wv": "colwise",
        "attention.q_norm": "head_norm",
        "attention.k_norm": "head_norm",
        "attention.wo": "rowwise",
        "ffn_norm": "sequence_parallel",
        # dense blocks
        "feed_forward": "block_input",
        "feed_forward.w1": "colwise",
        "feed_forward.w2": "rowwise",
        "feed_forward.w3": "colwise",
    },
    # --- EP entries (owned by parallelisms/expert_parallel.py) -----------------------------
    # MoE blocks (`moe.router.gate`, `moe.experts.{w1,w2,w3}`) get no TP entry. The experts
    # are split over the `ep` axis and FSDP-sharded over the expert mesh (efsdp x ep, carved
    # out of dp_shard x tp); with tp > 1 the MoE layer takes the rank's sequence shard of
    # tokens as a plain tensor and the router weight is replicated over TP with its gradient
    # summed over the TP ranks. Styles: parallelisms/expert_parallel.py.
    ep_block={
        "moe": "moe",
        "moe.router.gate": "router",
        "moe.experts": "experts",
    },
)
