"""Parallel plans of Qwen 3 (dense and MoE).

Same TP layout as Llama 3 (sequence-parallel residual stream, colwise q/k/v and FFN
in-projections, rowwise out-projections), plus Qwen 3's per-head q_norm / k_norm, which
normalise head-sharded activations: their replicated weights get TP-summed gradients.
"""

from models.common.plan import ModelPlan

_ROOT_TP = {
    "tok_embeddings": "embedding",
    "norm": "sequence_parallel",
    "output": "output",
}

_ATTENTION_TP = {
    "attention_norm": "sequence_parallel",
    "attention": "block_input",
    "attention.wq": "colwise",
    "attention.wk": "colwise",
    "attention.wv": "colwise",
    "attention.q_norm": "head_norm",
    "attention.k_norm": "head_norm",
    "attention.wo": "rowwise",
    "ffn_norm": "sequence_parallel",
}

PLAN = ModelPlan(
    block="layers",
    tp=dict(_ROOT_TP),
    tp_block={
        **_ATTENTION_TP,
        "feed_forward": "block_input",
        "feed_forward.w1": "colwise",
        "feed_forward.w2": "rowwise",
        "feed_forward.w3": "colwise",
    },
)

MOE_PLAN = ModelPlan(
    block="layers",
    tp=dict(_ROOT_TP),
    tp_block=dict(_ATTENTION_TP),
    # --- EP entries (owned by parallelisms/expert_parallel.py; to be filled in) ---------
    # The MoE layer (`moe.router.gate`, `moe.experts.{w1,w2,w3}`) is not TP-sharded here:
    # with tp > 1 it sees sequence-sharded tokens, so its parameters need gradients summed
    # over the TP ranks as well, which the expert-parallel mesh (efsdp x ep carved out of
    # dp_shard x tp) provides. Until then, Qwen 3 MoE supports tp = 1 only.
    ep_block={},
)
