"""Hugging Face interop for Llama 3: `LlamaForCausalLM` state dicts and `config.json`."""

from typing import Any

import torch

from models.common.hf_adapter import HFLayout, decoder_from_hf, decoder_hf_layout, decoder_to_hf
from models.llama3.args import Llama3Args


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Llama3Args) -> dict[str, torch.Tensor]:
    """HF `LlamaForCausalLM` state dict -> our state dict (a pure rename)."""
    return decoder_from_hf(hf_state_dict, tie_embeddings=args.tie_embeddings)


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args) -> HFLayout:
    """HF names and shapes -> how each of our parameters is made of them (see models/common/hf_adapter.py)."""
    return decoder_hf_layout(hf_shapes, tie_embeddings=args.tie_embeddings)


def to_hf(state_dict: dict[str, torch.Tensor], args: Llama3Args) -> dict[str, torch.Tensor]:
    """Our state dict -> HF `LlamaForCausalLM` state dict (no `lm_head.weight` when tied)."""
    return decoder_to_hf(state_dict, tie_embeddings=args.tie_embeddings)


def hf_config(args: Llama3Args) -> dict[str, Any]:
    """A `config.json` dict for `LlamaForCausalLM` (rope keys in the hub's `rope_theta`/`rope_scaling` form)."""
    rope_scaling = None
    if args.rope_scaling_factor is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling_factor,
            "low_freq_factor": args.rope_low_freq_factor,
            "high_freq_factor": args.rope_high_freq_factor,
            "original_max_position_embeddings": args.rope_original_max_seq_len,
        }
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def _rope_params(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from either the hub form or transformers 5 `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if params is not None:
        scaling = None if params.get("rope_type", "default") == "default" else params
        return float(params["rope_theta"]), scaling
    return float(cfg.get("rope_theta", 10000.0)), cfg.get("rope_scaling")


def args_from_hf_config(cfg: dict[str, Any]) -> Llama3Args:
    """`Llama3Args` from a Hugging Face Llama `config.json` dict; ValueError for unsupported variants."""
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    if cfg.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim: {cfg['head_dim']} unsupported; allowed: hidden_size // num_attention_heads")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key, False):
            raise ValueError(f"{key}: biases are not supported; allowed: false")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {cfg['hidden_act']!r} unsupported; allowed: 'silu'")
    theta, scaling = _rope_params(cfg)
    rope = {}
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type != "llama3":
            raise ValueError(f"rope_scaling: rope_type {rope_type!r} unsupported; allowed: 'llama3' or none")
        rope = dict(
            rope_scaling_factor=float(scaling["factor"]),
            rope_low_freq_factor=float(scaling["low_freq_factor"]),
            rope_high_freq_factor=float(scaling["high_freq_factor"]),
            rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]),
        )
    return Llama3Args(
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        vocab_size=cfg["vocab_size"],
        hidden_dim=cfg["intermediate_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=theta,
        max_seq_len=cfg.get("max_position_embeddings", 8192),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **rope,
    )
