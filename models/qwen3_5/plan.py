"""Parallel plan of Qwen 3.5 (dense and MoE): FSDP, activation checkpointing, EP and CP; no TP.

- The repeated block is `layers` (one `BlockStack` of Gated DeltaNet and full-attention blocks):
  SimpleFSDP shards every parameter, activation checkpointing and per-block compile act on each
  block. Layer scan runs one period of the stack per step (three Gated DeltaNet blocks and one
  full-attention block: models/common/stack.py `scan_period`); a stack of one period alone has
  nothing to scan by and is refused (`compile.scan_layers = false`).
- No tensor-parallel entries: the Gated DeltaNet's fused `in_proj_qkv` rows are [q | k | v] of all
  heads (HF layout) and its conv, gated norm and delta rule would need head-sharded counterparts;
  TP > 1 is refused by the rule on the step request's `tp_refusal` (trainer/step/plan.py), which
  is the model class's `tp_refusal`.
- CP wraps no module (as for every family): the full-attention blocks call the op
  `causal_attention`, which the cp all-gather attention serves, and the Gated DeltaNet blocks the
  ops that read earlier tokens (`causal_conv1d`, `segment_starts`, `gated_delta_rule`), which
  parallelisms/context_parallel_linear.py serves with the preceding chunk's tokens and the delta
  rule's state passed in sequence order (`ModelFamily.document_mask` is set, which the CP rule
  reads). With MTP, CP stays refused (the MTP rule).
- EP (MoE flavors): as Qwen 3 MoE (`moe`, `router`, `experts`), plus the shared expert and its
  gate, per-token linears on the rank's own tokens like the router (DeepSeek-V3's shared experts).
"""

from models.common.plan import ModelPlan

PLAN = ModelPlan(
    block="layers",
    ep_block={
        "moe": "moe",
        "moe.router.gate": "router",
        "moe.shared_experts.w1": "router",
        "moe.shared_experts.w2": "router",
        "moe.shared_experts.w3": "router",
        "moe.shared_gate": "router",
        "moe.experts": "experts",
    },
)
