"""Hugging Face interop for Qwen 3: `Qwen3ForCausalLM` (dense) and `Qwen3MoeForCausalLM` (MoE)."""

from typing import Any

import torch

from models.common.hf_adapter import HFLayout, decoder_from_hf, decoder_hf_layout, decoder_to_hf
from models.qwen3.args import Qwen3Args


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: Qwen3Args) -> dict[str, torch.Tensor]:
    """HF Qwen 3 state dict (per-expert hub layout or transformers-5 fused experts) -> ours."""
    out = decoder_from_hf(hf_state_dict, tie_embeddings=args.tie_embeddings, num_experts=args.num_experts)
    if args.is_moe and args.moe_expert_bias:  # HF has no selection bias: start from zeros
        for i in range(args.n_layers):
            out[f"layers.{i}.moe.router.expert_bias"] = torch.zeros(args.num_experts, dtype=torch.float32)
    return out


def hf_layout(hf_shapes: dict[str, tuple[int, ...]], args) -> HFLayout:
    """HF names and shapes -> how each of our parameters is made of them (see models/common/hf_adapter.py)."""
    return decoder_hf_layout(hf_shapes, tie_embeddings=args.tie_embeddings, num_experts=args.num_experts)


def to_hf(
    state_dict: dict[str, torch.Tensor], args: Qwen3Args, *, fused_experts: bool = False
) -> dict[str, torch.Tensor]:
    """Our state dict -> HF Qwen 3 state dict; experts per expert (hub layout) unless `fused_experts`.
    `moe.router.expert_bias` (`moe_expert_bias`) has no HF form: zeros are dropped, anything else
    is a ValueError (the HF model would route differently)."""
    biases = [k for k in state_dict if k.endswith(".moe.router.expert_bias")]
    for key in biases:
        if bool(state_dict[key].any()):
            raise ValueError(f"{key}: a nonzero expert bias has no Qwen3MoeForCausalLM form; allowed: zeros")
    state_dict = {k: v for k, v in state_dict.items() if k not in biases}
    return decoder_to_hf(state_dict, tie_embeddings=args.tie_embeddings, fused_experts=fused_experts)


def hf_config(args: Qwen3Args) -> dict[str, Any]:
    """A `config.json` dict for `Qwen3ForCausalLM`, or `Qwen3MoeForCausalLM` when `num_experts > 0`."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen3MoeForCausalLM" if args.is_moe else "Qwen3ForCausalLM"],
        "model_type": "qwen3_moe" if args.is_moe else "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": args.n_layers,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if args.is_moe:
        cfg.update(
            num_experts=args.num_experts,
            num_experts_per_tok=args.num_experts_per_tok,
            moe_intermediate_size=args.moe_hidden_dim,
            norm_topk_prob=args.norm_topk_prob,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            output_router_logits=False,
        )
    return cfg


def args_from_hf_config(cfg: dict[str, Any]) -> Qwen3Args:
    """`Qwen3Args` from a Hugging Face Qwen 3 (dense or MoE) `config.json`; ValueError if unsupported."""
    model_type = cfg.get("model_type")
    if model_type not in ("qwen3", "qwen3_moe"):
        raise ValueError(f"model_type: {model_type!r} unsupported; allowed: 'qwen3', 'qwen3_moe'")
    if cfg.get("use_sliding_window", False):
        raise ValueError("use_sliding_window: sliding-window attention is not supported; allowed: false")
    if cfg.get("attention_bias", False):
        raise ValueError("attention_bias: biases are not supported; allowed: false")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {cfg['hidden_act']!r} unsupported; allowed: 'silu'")
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling") if params is None else (None if params.get("rope_type") == "default" else params)
    if scaling is not None:
        raise ValueError("rope_scaling: RoPE scaling (e.g. YaRN) is not supported for Qwen 3; allowed: none")
    theta = float(params["rope_theta"] if params is not None else cfg.get("rope_theta", 1000000.0))
    dim, n_heads = cfg["hidden_size"], cfg["num_attention_heads"]
    # Hub configs say num_experts; transformers 5 writes the same value as num_local_experts.
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts", 0))
    moe = {}
    if model_type == "qwen3_moe" and num_experts > 0:
        if cfg.get("mlp_only_layers") or cfg.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                "mlp_only_layers/decoder_sparse_step: mixed dense and MoE blocks are not supported; "
                "allowed: mlp_only_layers [] and decoder_sparse_step 1"
            )
        moe = dict(
            num_experts=num_experts,
            num_experts_per_tok=cfg["num_experts_per_tok"],
            moe_hidden_dim=cfg["moe_intermediate_size"],
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        )
    return Qwen3Args(
        dim=dim,
        n_layers=cfg["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=cfg.get("num_key_value_heads") or n_heads,
        head_dim=cfg.get("head_dim") or dim // n_heads,
        vocab_size=cfg["vocab_size"],
        hidden_dim=cfg["intermediate_size"],
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_seq_len=cfg.get("max_position_embeddings", 40960),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        **moe,
    )
