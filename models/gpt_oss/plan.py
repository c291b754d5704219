"""Parallel plan of gpt-oss: the Llama/Qwen 3 decoder layout plus the sinks, and Qwen 3's MoE styles.

TP: sequence-parallel residual stream and norms, colwise q/k/v (their biases split with their
rows), rowwise wo (its bias added once, after the reduce-scatter). The sinks, one logit per query
head, are the weight [n_heads, 1] of the linear `attention.sinks` (models/gpt_oss/model.py): colwise
splits it by heads like wq's rows, so each rank holds and trains its own heads' sinks.
Sliding and full blocks have the same parameters (the window is a buffer), so the one block stack
is what activation checkpointing, per-block compile and layer scan act on.
EP: as Qwen 3 MoE (`moe`, `router`: the gate with its bias, `experts`: every parameter of the
experts, biases included, has the expert on dim 0 and is split over `ep` with the weights).
"""

from models.common.plan import DECODER_TP, DECODER_TP_BLOCK, ModelPlan

PLAN = ModelPlan(
    block="layers",
    tp=dict(DECODER_TP),
    tp_block={
        **{k: v for k, v in DECODER_TP_BLOCK.items() if not k.startswith("feed_forward")},
        "attention.sinks": "colwise",
    },
    ep_block={
        "moe": "moe",
        "moe.router.gate": "router",
        "moe.experts": "experts",
    },
)
