"""Tiny random configs of architectures that `transformers` ships, for the `hf` family's tests.

Each is the architecture's own config class with small sizes (2 layers, width 32, 4 query heads,
2 key/value heads where the architecture has GQA, vocabulary 4096 = the bundled tokenizer), written
as a config.json in a folder. Nothing is downloaded.
"""

from __future__ import annotations

import json
import os

_COMMON = dict(
    vocab_size=4096,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

CONFIGS: dict[str, dict] = {
    "llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], **_COMMON),
    "qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], head_dim=8, **_COMMON),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        architectures=["Qwen3MoeForCausalLM"],
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        **_COMMON,
    ),
    "mistral": dict(
        model_type="mistral", architectures=["MistralForCausalLM"], head_dim=8, sliding_window=None, **_COMMON
    ),
    "gemma3_text": dict(
        model_type="gemma3_text",
        architectures=["Gemma3ForCausalLM"],
        head_dim=8,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
        **{**_COMMON, "tie_word_embeddings": True},
    ),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], pad_token_id=0, **_COMMON),
    "olmo2": dict(model_type="olmo2", architectures=["Olmo2ForCausalLM"], pad_token_id=0, **_COMMON),
    "gpt_neox": dict(
        model_type="gpt_neox",
        architectures=["GPTNeoXForCausalLM"],
        vocab_size=4096,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_parallel_residual=True,
    ),
    "starcoder2": dict(
        model_type="starcoder2",
        architectures=["Starcoder2ForCausalLM"],
        sliding_window=None,
        **{**_COMMON, "tie_word_embeddings": True},
    ),
}
"""Architecture key -> config.json contents."""


def write_config(folder: str, arch: str) -> str:
    """Write `CONFIGS[arch]` as `folder/arch/config.json`; return the folder holding it."""
    path = os.path.join(folder, arch)
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(CONFIGS[arch], f, indent=1)
    return path
