"""The contract between a model family and the rest of the product.

The trainer, the graph trainer, the parallelisms and the planner use a model only through
what is declared here; none of them reaches into a model's modules by name. A family is one
`ModelFamily` (see `models/__init__.py`):

- `plan`: its `ModelPlan` object (`models/common/plan.py`): the attribute that holds the
  repeated blocks (a `BlockStack`, what activation checkpointing, per-block compile and layer
  scan act on) and the tensor/expert-parallel styles of its modules.
- `args_cls` / `flavors`: a dataclass with fields `n_layers`, `max_seq_len` and `vocab_size`
  (the trainer may set them) and the methods of `ModelArgs` below.
- `task`: "lm" (the default) or "flow": what the trainer feeds the model and which loss it takes.
- `model_cls(args)`: an `nn.Module` with the methods of `LanguageModel` (task "lm") or
  `FlowModel` (task "flow") below.
- `hf_adapter` (optional): `from_hf`, `to_hf`, `hf_config`, `args_from_hf_config`, and
  optionally `hf_layout(hf_shapes, args)`: for each of our parameters, the boxes of HF tensors
  it is copied from (`models.common.hf_adapter.HFEntry`), from names and shapes alone. With it, HF
  weights load per rank reading only each rank's slices and convert one tensor at a time
  (docs/checkpointing.md); without it every rank reads all weights and calls `from_hf`.

docs/adding_a_model.md walks through a new family; tests/support/toy_family.py is one that lives outside
`models/` and trains under every parallelism with no edit to `trainer/` or `parallelisms/`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class ModelShape:
    """Sizes the FLOP counter, the planner's activation model and the degree checks need."""

    n_layers: int
    """Repeated blocks."""
    dim: int
    """Residual-stream width."""
    n_heads: int
    """Query heads per block (split by tensor parallelism)."""
    n_kv_heads: int
    """Key/value heads per block (split by tensor parallelism)."""
    head_dim: int
    vocab_size: int
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (Qwen 3)."""
    ffn_hidden: int = 0
    """Dense MLP width (split by tensor parallelism); 0 for MoE blocks."""
    num_experts: int = 0
    """Routed experts per block (split by expert parallelism); 0 for a dense model."""
    top_k: int = 0
    """Experts each token is routed to."""
    moe_hidden: int = 0
    """Each expert's MLP width."""
    shared_hidden: int = 0
    """The MoE block's shared experts' SwiGLU width, summed over them (run on every token beside the
    routed experts); 0: none. DeepSeek-V3 / V4 count theirs in their own planner modules."""
    shared_gate: bool = False
    """The shared experts' output is scaled per token by `sigmoid(shared_gate(x))` (Qwen 3.5 MoE)."""
    tp_splits: tuple[tuple[str, int], ...] | None = None
    """The sizes tensor parallelism splits, each named as an error would (None: the default ones,
    `n_heads`, `n_kv_heads` and the FFN or expert hidden size). DeepSeek-V4 replicates its one KV
    head over TP and splits the query heads and the output projection's groups."""
    expert_act_tensors: int = 4
    """bf16 `[rows, moe_hidden]` tensors an expert's activation keeps for its backward per routed row:
    4 for the SwiGLU (gate, up, silu(gate), product); gpt-oss's clamped SwiGLU keeps 7 (the raw
    gate and up for their clamps, the clamped gate, its sigmoid, up + 1, gate x sigmoid, the
    product). The planner's MoE activation bytes read it."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0


def causal_keys(seq_len: int, window: int = 0) -> float:
    """Keys a query attends to, on average over a causal row of `seq_len` (the "causal" convention's
    T/2 for full attention); a sliding `window` (keys the query's own included, 0: none) caps it:
    w - w^2 / 2T once T > w (T/2 up to T = w, continuous there)."""
    if not window or seq_len <= window:
        return seq_len / 2
    return window - window * window / (2 * seq_len)


class ModelArgs(Protocol):
    """What a family's args dataclass provides besides its own fields."""

    n_layers: int
    max_seq_len: int
    vocab_size: int

    def shape(self) -> ModelShape:
        """The model's sizes (no module is built)."""

    def num_params(self, *, exclude_embedding: bool = False) -> int:
        """Distinct parameters; `exclude_embedding` drops the token-embedding table."""

    def num_active_params(self, *, exclude_embedding: bool = False) -> int:
        """Parameters used per token (MoE: the routed top-k experts); FLOPs are 6x this per token."""


class LanguageModel(Protocol):
    """What the trainer calls on a built model."""

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, seq] int64 -> logits [batch, seq, vocab_size]."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """Initialise every parameter in place (they may be sharded DTensors) and rebuild buffers."""

    # Optional, for `[training] document_mask` (a family that sets `ModelFamily.document_mask`):
    # `__call__(tokens, segment_ids, positions)` and `hidden(tokens, segment_ids, positions)`,
    # segment_ids [batch, seq] integers (attention stays inside a segment) and positions
    # [batch, seq] integers (the RoPE positions) or None (0..seq-1 in every row).

    # Optional, for `[training] fused_loss`: `hidden(tokens) -> [batch, seq, dim]`, the states
    # that the `output` projection (an nn.Linear, weight [vocab_size, dim]) turns into logits.
    # A family without them trains with the plain loss (fused_loss = "on" is then an error).

    def pop_aux_loss(self) -> torch.Tensor | None:
        """Sum of the auxiliary losses (unscaled) of the last forward, or None for a model without
        any. Clears them, so no module keeps a reference into a finished autograd graph; the
        trainer scales the sum by `training.aux_loss_coef` and adds it to the LM loss."""


class FlowModel(Protocol):
    """What the trainer calls on a model of task "flow" (a rectified-flow velocity model, FLUX).

    Its args provide `shape()`, the parameter counts, `in_channels` (packed latent channels),
    `context_in_dim` (T5 width), `vec_in_dim` (pooled CLIP width) and `guidance_embed`; the
    `n_layers` / `max_seq_len` / `vocab_size` fields of `ModelArgs` are not required.
    """

    def __call__(
        self,
        img: torch.Tensor,
        img_ids: torch.Tensor,
        txt: torch.Tensor,
        txt_ids: torch.Tensor,
        timesteps: torch.Tensor,
        y: torch.Tensor,
        guidance: torch.Tensor | None,
    ) -> torch.Tensor:
        """img [B, L, in_channels] noisy packed latents, img_ids [B, L, 3], txt [B, S, context_in_dim],
        txt_ids [B, S, 3], timesteps [B] in [0, 1], y [B, vec_in_dim], guidance [B] or None
        -> predicted velocity [B, L, in_channels]."""

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        """As `LanguageModel.init_weights`."""

    def pop_aux_loss(self) -> torch.Tensor | None:
        """None (no auxiliary loss)."""
