"""Parallel plan of Llama 3: the layout TorchTitan uses (TP with sequence parallelism).

Residual stream sequence-sharded between blocks; norms sequence parallel; attention and
FFN gather the sequence, run column-parallel in-projections (local heads = n_heads / tp)
and a row-parallel out-projection that reduce-scatters back to the sequence shards.
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
        "attention.wo": "rowwise",
        "ffn_norm": "sequence_parallel",
        "feed_forward": "block_input",
        "feed_forward.w1": "colwise",
        "feed_forward.w2": "rowwise",
        "feed_forward.w3": "colwise",
    },
)
