"""Declarative parallel plans: which module is the repeated block, and how to shard what.

A plan is data (strings), so models stay free of torch.distributed: `parallelisms/` reads
it and turns each style into a `torch.distributed.tensor.parallel` style. Paths may use
`*` wildcards for one path component (as `parallelize_module` does).

Tensor-parallel styles (the decoders use sequence parallelism on the residual stream, as in
TorchTitan: between blocks activations are split along the sequence, dim 1; FLUX keeps the
residual stream replicated and uses the `rowwise_replicate` / `replicate` styles):

- "embedding": vocab-sharded embedding; replicated token ids in, sequence-sharded out.
- "colwise": output features sharded; replicated input, feature-sharded local output.
- "rowwise": input features sharded; the partial sums are reduce-scattered along the
  sequence, so the output is sequence-sharded (it goes back into the residual stream).
- "sequence_parallel": a norm applied to the sequence-sharded residual stream; its weight
  is replicated and its gradient is summed over the TP ranks.
- "block_input": all-gathers the first positional input (sequence-sharded residual) of a
  module such as `attention` or `feed_forward` before its colwise projections; other
  inputs (RoPE tables, masks) pass through unchanged.
- "head_norm": a norm over the last dim of a head-sharded activation `(batch, seq, heads,
  head_dim)` (Qwen 3's q_norm / k_norm); weight replicated, gradient summed over TP ranks.
- "rowwise_replicate": input features sharded; the partial sums are all-reduced, so the
  output is replicated (for a model whose residual stream is replicated over TP between
  blocks, i.e. without sequence parallelism: FLUX).
- "replicate": a module every TP rank runs in full on a replicated input (FLUX's adaLN
  modulation linears); its parameters become Replicate DTensors on the TP mesh, its
  gradient is computed identically on every rank and is not summed.
- "head_shared": a parameter-free pass-through (identity) module on a tensor that every TP rank
  holds in full and uses for its own heads only (MLA's RoPE key, shared by all heads): the
  forward is the identity, the backward sums the gradient over the TP ranks.
- "sequence_local": a per-token module on the sequence-sharded residual stream that takes and
  returns plain local tensors, tuples included (DeepSeek-V4's hyper-connections): weights
  replicated, gradients summed over the TP ranks (as "sequence_parallel").
- "grouped_colwise": a grouped linear (weight [groups x out, in], input [..., groups, in]) split
  by group (DeepSeek-V4's `wo_a`: groups of consecutive heads, so a rank's heads make its groups).
- "head_sharded": a module returning per-head parameters (heads on dim 0; DeepSeek-V4's sinks),
  split by head like a colwise projection's rows; the output is the rank's heads.
- "sequence_shard": a parameter-free pass-through on a tensor every rank holds in full (token
  ids) that hands on this rank's sequence shard (dim 1), a local slice (DeepSeek-V4's hash
  routing reads the ids of the tokens its MoE layer holds).
- "output": the LM head; sequence-sharded input is all-gathered, logits are gathered to
  full vocab (or left vocab-sharded for loss parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

TP_STYLES = (
    "embedding",
    "colwise",
    "rowwise",
    "rowwise_replicate",
    "replicate",
    "sequence_parallel",
    "block_input",
    "head_norm",
    "head_shared",
    "sequence_local",
    "grouped_colwise",
    "head_sharded",
    "sequence_shard",
    "output",
)


@dataclass(frozen=True)
class ModelPlan:
    """How `parallelisms/` shards one model family."""

    block: str | tuple[str, ...] = "layers"
    """Attribute(s) of the model holding the repeated blocks (each a ModuleDict keyed "0".."n-1",
    usually a `BlockStack`); activation checkpointing, per-block compile and layer scan act on
    their children. A tuple names several stacks run in that order (FLUX: double-stream blocks,
    then single-stream blocks); `tp_block` / `ep_block` entries apply to every stack's blocks
    that have the named module."""
    tp: dict[str, str] = field(default_factory=dict)
    """Tensor-parallel styles of modules outside the blocks, by path relative to the model."""
    tp_block: dict[str, str] = field(default_factory=dict)
    """Tensor-parallel styles of modules inside each block, by path relative to the block."""
    ep_block: dict[str, str] = field(default_factory=dict)
    """Expert-parallel styles inside each block (reserved for parallelisms/expert_parallel)."""

    @property
    def stacks(self) -> tuple[str, ...]:
        """The block container attributes, in the order the model runs them."""
        return (self.block,) if isinstance(self.block, str) else tuple(self.block)

    def iter_blocks(self, model) -> list[tuple[str, "object"]]:
        """`(qualified name, block module)` for every block of every stack of `model`."""
        return [(f"{stack}.{key}", block) for stack in self.stacks for key, block in getattr(model, stack).items()]

    def __post_init__(self) -> None:
        assert self.stacks, "plan: at least one block container"
        for where in (self.tp, self.tp_block):
            for path, style in where.items():
                assert style in TP_STYLES, f"plan: unknown TP style {style!r} for {path!r}"


# The TorchTitan decoder layout that Llama 3 and Qwen 3 share: sequence-parallel residual
# stream and norms, colwise q/k/v and FFN in-projections, rowwise out-projections.
DECODER_TP: dict[str, str] = {
    "tok_embeddings": "embedding",
    "norm": "sequence_parallel",
    "output": "output",
}
DECODER_TP_BLOCK: dict[str, str] = {
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
}
