"""Parallel plan of FLUX: tensor parallelism inside both block stacks, no sequence parallelism.

The residual stream [txt; img] is replicated over the TP ranks between blocks (FLUX's
sequences are short next to its width, and the joint attention needs the whole sequence on
every rank anyway). Inside a block, q/k/v and the MLP in-projections are colwise (each rank
has num_heads / tp heads and mlp_hidden / tp MLP channels), the out-projections rowwise with
an all-reduce back to a replicated output (`rowwise_replicate`), the per-head QK RMSNorms
`head_norm`, and the adaLN modulation linears `replicate` (every rank needs all 6 x hidden
shifts/scales/gates, computed from the replicated conditioning vector). A single block's
out-projection is two linears (`attn.wo` and `mlp.w2`), each rowwise on its own half.
Everything outside the blocks (embedders, final layer) is `replicate` too: computed in full on
every rank, its parameters Replicate() DTensors on the TP mesh like the blocks' (a plain
parameter next to DTensors breaks the fused AdamW step and the gradient-norm groups).
"""

from models.common.plan import ModelPlan

_ATTN = {
    "wq": "colwise",
    "wk": "colwise",
    "wv": "colwise",
    "q_norm": "head_norm",
    "k_norm": "head_norm",
    "wo": "rowwise_replicate",
}
_MLP = {"w1": "colwise", "w2": "rowwise_replicate"}

TP_BLOCK: dict[str, str] = {
    # double blocks
    **{f"{stream}_attn.{name}": style for stream in ("img", "txt") for name, style in _ATTN.items()},
    **{f"{stream}_mlp.{name}": style for stream in ("img", "txt") for name, style in _MLP.items()},
    "img_mod.lin": "replicate",
    "txt_mod.lin": "replicate",
    # single blocks
    **{f"attn.{name}": style for name, style in _ATTN.items()},
    **{f"mlp.{name}": style for name, style in _MLP.items()},
    "modulation.lin": "replicate",
}

# Outside the blocks every linear runs in full on every TP rank ("replicate"), so that all
# parameters are TP DTensors (one optimizer and one gradient-norm over one kind of tensor).
# "[vg]*_in.*" covers vector_in and, when the flavor has it, guidance_in (a pattern that always
# matches something: an entry for a module a flavor lacks would warn).
TP_ROOT: dict[str, str] = {
    "img_in": "replicate",
    "txt_in": "replicate",
    "time_in.*": "replicate",
    "[vg]*_in.*": "replicate",
    "final_layer.modulation.lin": "replicate",
    "final_layer.linear": "replicate",
}

PLAN = ModelPlan(block=("double_blocks", "single_blocks"), tp=TP_ROOT, tp_block=TP_BLOCK)
