"""Rotary position embeddings in the Hugging Face "rotate_half" convention.

Tables are real `cos`/`sin` of shape [max_seq_len, head_dim] (each frequency appears twice,
once per half of the head dimension), not complex numbers. This layout is what the Hugging
Face Llama/Qwen code uses, so weight conversion is a pure rename (no q/k row permutation),
and it stays plain real arithmetic for DTensor, torch.compile and XLA/TPU lowering.

Llama 3.1 frequency scaling (`scaling_factor`, `low_freq_factor`, `high_freq_factor`,
`original_max_seq_len`) is applied when `scaling_factor` is not None. `YarnArgs`: the YaRN fields
(with their check and Hugging Face form) that gpt-oss's and DeepSeek-V3's and -V4's args share.
"""

import dataclasses
import math
from dataclasses import dataclass

import torch


def rope_inv_freq(
    head_dim: int,
    theta: float,
    *,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, optionally with Llama 3.1 scaling."""
    assert head_dim % 2 == 0, f"rotary head_dim must be even, got {head_dim}"
    # Same expression as the reference (integer arange, then float) so the tables agree bit for bit.
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim
    inv_freq = 1.0 / (theta**exponent)
    if scaling_factor is None:
        return inv_freq
    # Llama 3.1: keep high frequencies (short wavelengths), divide low frequencies by the
    # factor, and interpolate smoothly in between.
    low_freq_wavelen = original_max_seq_len / low_freq_factor
    high_freq_wavelen = original_max_seq_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling_factor, inv_freq)
    smooth = (original_max_seq_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling_factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    head_dim: int,
    max_seq_len: int,
    theta: float,
    *,
    scaling_factor: float | None = None,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_seq_len: int = 8192,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 `(cos, sin)` tables, each [max_seq_len, head_dim], for positions 0..max_seq_len-1."""
    inv_freq = rope_inv_freq(
        head_dim,
        theta,
        scaling_factor=scaling_factor,
        low_freq_factor=low_freq_factor,
        high_freq_factor=high_freq_factor,
        original_max_seq_len=original_max_seq_len,
        device=device,
    )
    positions = torch.arange(max_seq_len, dtype=torch.int64, device=device).float()
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate `q`, `k` ([batch, seq, heads, head_dim]) by tables `cos`, `sin`: [seq, head_dim]
    (positions 0..seq-1 of every row), or [batch, seq, head_dim] gathered per token
    (`rope_rows`, e.g. positions that restart at each packed document).

    The rotation runs in float32 (as TorchTitan's complex version does) and the result is cast
    back to the input dtype, which keeps bf16 training accurate at long positions.
    """
    # -> [1 or batch, seq, 1, head_dim], broadcast over the heads (and the batch).
    lead = None if cos.dim() == 2 else slice(None)
    cos = cos[lead, :, None, :].float()
    sin = sin[lead, :, None, :].float()
    q_fp32, k_fp32 = q.float(), k.float()
    q_out = q_fp32 * cos + _rotate_half(q_fp32) * sin
    k_out = k_fp32 * cos + _rotate_half(k_fp32) * sin
    return q_out.type_as(q), k_out.type_as(k)


def document_positions(segment_ids: torch.Tensor) -> torch.Tensor:
    """segment_ids [batch, seq] (constant within a segment; a new segment starts wherever the id
    changes) -> int32 positions [batch, seq] that restart at 0 at each segment start.

    Static shapes and no host read (a running max of the start indices), so it traces anywhere.
    """
    seq = segment_ids.shape[-1]
    index = torch.arange(seq, device=segment_ids.device).expand_as(segment_ids)
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[..., 1:] = segment_ids[..., 1:] != segment_ids[..., :-1]
    start_index = torch.cummax(torch.where(starts, index, 0), dim=-1).values
    return (index - start_index).to(torch.int32)


def rope_rows(
    cos: torch.Tensor, sin: torch.Tensor, seqlen: int, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of the tables [max_seq_len, head_dim] a sequence of `seqlen` tokens uses, for
    `apply_rope`: the first `seqlen` ([seqlen, head_dim]), or those at integer `positions`
    [batch, seq] ([batch, seq, head_dim]: restarted per document, or a context-parallel shard's)."""
    assert seqlen <= cos.shape[0], f"sequence length {seqlen} exceeds max_seq_len {cos.shape[0]}"
    if positions is None:
        return cos[:seqlen], sin[:seqlen]
    index = positions.long()
    return cos[index], sin[index]


@dataclass(frozen=True)
class RopeConfig:
    """Everything needed to build a model's RoPE tables (see `rope_cos_sin`)."""

    head_dim: int
    max_seq_len: int
    theta: float
    scaling_factor: float | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def cos_sin(self, device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(
            self.head_dim,
            self.max_seq_len,
            self.theta,
            scaling_factor=self.scaling_factor,
            low_freq_factor=self.low_freq_factor,
            high_freq_factor=self.high_freq_factor,
            original_max_seq_len=self.original_max_seq_len,
            device=device,
        )


@dataclass
class YarnArgs:
    """YaRN's context extension (Peng et al. 2023) as the model args of the families that use it
    (gpt-oss, DeepSeek-V3, DeepSeek-V4): frequencies turning more than `rope_beta_fast` times over
    the original context are kept, those turning fewer than `rope_beta_slow` times are divided by
    `rope_factor`, with a linear ramp between. Each family's args derive from it and restate the
    defaults of its release (a restated field keeps its place and this docstring); what the tables
    are scaled by is the family's (its model.py)."""

    rope_factor: float = 1.0
    """YaRN context-extension factor; 1.0 turns YaRN off (plain RoPE)."""
    rope_beta_fast: float = 32.0
    """YaRN: frequencies turning more than this many times over the original context are kept."""
    rope_beta_slow: float = 1.0
    """YaRN: frequencies turning fewer than this many times are divided by `rope_factor`."""
    rope_original_max_seq_len: int = 4096
    """YaRN: the context the model was pre-trained at (HF original_max_position_embeddings)."""

    def check_yarn(self) -> None:
        """ValueError for a factor below 1 (the positive lengths are checked with the family's)."""
        if self.rope_factor < 1.0:
            raise ValueError(f"rope_factor: must be >= 1.0 (1.0: no YaRN), got {self.rope_factor}; allowed: >= 1.0")

    def yarn_hf(self) -> dict[str, float | int]:
        """The YaRN entries of a Hugging Face `rope_parameters` / `rope_scaling` dict."""
        return {
            "factor": self.rope_factor,
            "beta_fast": self.rope_beta_fast,
            "beta_slow": self.rope_beta_slow,
            "original_max_position_embeddings": self.rope_original_max_seq_len,
        }

    @classmethod
    def yarn_from_hf(cls, params: dict | None) -> dict[str, float | int]:
        """The YaRN fields from a Hugging Face rope dict of type yarn (`factor` required; the betas
        and the original context default to the family's), or with `params=None` plain RoPE
        (factor 1.0, the rest the family's defaults)."""
        default = {f.name: f.default for f in dataclasses.fields(cls) if f.name in _YARN_FIELDS}
        if params is None:
            return {**default, "rope_factor": 1.0}
        return dict(
            rope_factor=float(params["factor"]),
            rope_beta_fast=float(params.get("beta_fast") or default["rope_beta_fast"]),
            rope_beta_slow=float(params.get("beta_slow") or default["rope_beta_slow"]),
            rope_original_max_seq_len=int(
                params.get("original_max_position_embeddings", default["rope_original_max_seq_len"])
            ),
        )


_YARN_FIELDS = ("rope_factor", "rope_beta_fast", "rope_beta_slow", "rope_original_max_seq_len")
