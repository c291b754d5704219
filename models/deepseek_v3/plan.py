"""Parallel plan of DeepSeek-V3: two block stacks, MLA's tensor-parallel layout, DeepSeek MoE.

MLA under TP (heads split over the TP ranks, like TorchTitan's DeepSeek-V3 plan): the attention
module all-gathers the sequence-sharded stream (`block_input`); the head projections `wq` /
`wq_b`, `wkv_b` are colwise and `wo` rowwise. The low-rank down projections `wq_a`, `wkv_a` and
their norms `q_norm`, `kv_norm` are small and act before any head split, so every rank runs them
in full (`replicate`): their outputs feed colwise projections, whose input gradients are summed
over the ranks, so each rank computes the same full gradient for them. The one exception is the
RoPE key that `wkv_a` also produces and all heads share: each rank's gradient for it covers its
own heads only, and `attention.k_rope` ("head_shared") sums it over the TP ranks.

MoE blocks: as Qwen 3 (`moe`, `router`, `experts`), plus the shared experts, per-token linears
on the rank's own tokens like the router (TP-replicated weights, gradients summed over TP).

Multi-token prediction (`mtp_depth` > 0): the MTP modules (`mtp.K`, each with its own one-block
stack `mtp.K.layers`) are deliberately not in `block`: the repeated-block patterns (activation
checkpointing, per-block compile, layer scan, the TP/EP block styles) act on the two main stacks
only, so no scan ever takes an MTP block for a main layer. SimpleFSDP shards the MTP parameters
like every other (EP > 1 included: the MTP block's experts are then FSDP-sharded rather than
expert-parallel; the loss matches one process); graph mode, TP and CP with MTP are refused by a
rule of trainer/step/plan.py.
"""

from models.common.plan import DECODER_TP, DECODER_TP_BLOCK, ModelPlan

PLAN = ModelPlan(
    block=("dense_layers", "moe_layers"),
    tp=dict(DECODER_TP),
    tp_block={
        **{k: v for k, v in DECODER_TP_BLOCK.items() if not k.startswith("attention.")},
        "attention.wq": "colwise",
        "attention.wq_a": "replicate",
        "attention.q_norm": "replicate",
        "attention.wq_b": "colwise",
        "attention.wkv_a": "replicate",
        "attention.kv_norm": "replicate",
        "attention.k_rope": "head_shared",
        "attention.wkv_b": "colwise",
        "attention.wo": "rowwise",
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
