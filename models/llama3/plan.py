"""Parallel plan of Llama 3: the layout TorchTitan uses (TP with sequence parallelism).

Residual stream sequence-sharded between blocks; norms sequence parallel; attention and
FFN gather the sequence, run column-parallel in-projections (local heads = n_heads / tp)
and a row-parallel out-projection that reduce-scatters back to the sequence shards.
"""

from models.common.plan import DECODER_TP, DECODER_TP_BLOCK, ModelPlan

PLAN = ModelPlan(block="layers", tp=dict(DECODER_TP), tp_block=dict(DECODER_TP_BLOCK))
