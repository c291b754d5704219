"""Parallel plan of Qwen 3 (dense and MoE blocks).

Same TP layout as Llama 3 (sequence-parallel residual stream, colwise q/k/v and FFN
in-projections, rowwise out-projections), plus Qwen 3's per-head q_norm / k_norm, which
normalise head-sharded activations: their replicated weights get TP-summed gradients.
Entries for modules a block lacks are skipped, so one plan covers dense and MoE blocks.
"""

from models.common.plan import DECODER_TP, DECODER_TP_BLOCK, ModelPlan

PLAN = ModelPlan(
    block="layers",
    tp=dict(DECODER_TP),
    # Qwen 3's per-head q_norm / k_norm see head-sharded activations; entries for modules a
    # block lacks (feed_forward in MoE blocks) are skipped.
    tp_block={**DECODER_TP_BLOCK, "attention.q_norm": "head_norm", "attention.k_norm": "head_norm"},
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
