"""Parallel plan of DeepSeek-V4: FSDP, activation checkpointing and EP; no tensor parallelism.

The block stack is `layers` (what activation checkpointing and per-block compile act on; layer
scan refuses it: its blocks differ, models/deepseek_v4/model.py). No TP styles: the model class's
`tp_refusal` says why, and the rule table refuses TP > 1 with it.
EP: as Qwen 3 MoE / DeepSeek-V3 (`experts`: w1/w2/w3 with the expert on dim 0, split over `ep`).
Hash routing fits the dispatch as it is: the experts are chosen before it (a table lookup of
the token ids instead of a top-k), and dispatch only reads the choice.
"""

from models.common.plan import ModelPlan

PLAN = ModelPlan(
    block="layers",
    ep_block={
        "moe": "moe",
        "moe.router.gate": "router",
        "moe.experts": "experts",
    },
)
