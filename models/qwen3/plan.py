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
    # --- EP entries (owned by parallelisms/expert_parallel.py; to be filled in) -------------
    # MoE blocks (`moe.router.gate`, `moe.experts.{w1,w2,w3}`) get no TP entry: with tp > 1
    # the MoE layer sees sequence-sharded tokens, so its parameters need gradients summed
    # over the TP ranks too, which the expert mesh (efsdp x ep, carved out of dp_shard x tp)
    # provides. Until expert parallelism lands, Qwen 3 MoE runs with tp = 1.
    ep_block={},
)
